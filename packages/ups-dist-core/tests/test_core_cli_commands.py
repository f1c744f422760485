"""Commands that plugins add to ``ups`` (``ups_commands``): parsed, run, listed, refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core.cli._main import main
from ups.core.testing import install_plugin

HELLO = """
from ups.core import CommandPlugin, UsageError, hookimpl


def hello(parser):
    parser.add_argument("who")
    parser.add_argument("--times", type=int, default=1)

    def run(args):
        if args.times < 1:
            raise UsageError(f"--times must be >= 1, not {args.times}")
        print(" ".join(["hello " + args.who] * args.times))
        return 3

    return run


@hookimpl
def ups_commands():
    return [CommandPlugin(name="hello", factory=hello, description="say hello")]
"""

CLASH = """
from ups.core import CommandPlugin, hookimpl


@hookimpl
def ups_commands():
    return [CommandPlugin(name="train", factory=lambda parser: lambda args: 0)]
"""


def last_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The last line of stderr: the error (a plugin of the environment may log before it)."""
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("UPS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    install_plugin(tmp_path, "ups-hello", "ups_hello_plugin", HELLO)
    return tmp_path


def test_a_plugin_command_parses_its_arguments_and_returns_its_status(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hello", "world", "--times", "2"]) == 3
    assert capsys.readouterr().out == "hello world hello world\n"


def test_its_usage_errors_are_one_line_and_exit_2(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hello", "world", "--times", "0"]) == 2
    assert last_line(capsys) == "ups: error: --times must be >= 1, not 0"
    assert main(["hello"]) == 2
    assert "the following arguments are required: who" in capsys.readouterr().err


def test_help_and_plugins_list_it(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "say hello" in capsys.readouterr().out
    assert main(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["command", "hello", "ups-hello", "ups-hello", "0.1", "enabled", "say", "hello"] in rows


def test_plugins_credits_records_to_the_distribution_that_loaded_them(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two distributions with one entry-point name: one loads, the other fails, and each row
    names its own distribution."""
    for dist in ("ups-alpha", "ups-beta"):
        source = HELLO.replace('"hello"', repr(dist.removeprefix("ups-")))
        install_plugin(site, dist, f"{dist.replace('-', '_')}_plugin", source, entry_point="dup")
    assert main(["plugins"]) == 0
    rows = [line.split()[:6] for line in capsys.readouterr().out.splitlines()]
    enabled = [row for row in rows if row[0] == "command" and row[2] == "dup"]
    failed = [row for row in rows if row[2] == "dup" and row[5] == "failed:"]
    assert len(enabled) == 1 and len(failed) == 1, rows
    command, dist = enabled[0][1], enabled[0][3]
    assert dist == f"ups-{command}"
    assert failed[0][3] == ("ups-beta" if command == "alpha" else "ups-alpha")


def test_a_command_named_like_a_built_in_is_refused_naming_the_plugin(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    install_plugin(site, "ups-clash", "ups_clash_plugin", CLASH)
    assert main(["hello", "x"]) == 2
    assert last_line(capsys) == (
        "ups: error: plugin 'ups-clash' registers the command 'train', which is built in; "
        "uninstall it or block it with UPS_BLOCK_PLUGINS"
    )


def test_blocking_the_plugin_removes_its_command(
    site: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "ups-hello")
    assert main(["hello", "x"]) == 2
    assert "invalid choice: 'hello'" in capsys.readouterr().err
