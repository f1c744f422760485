"""The built-in commands are registered as plugins' commands are (issue 28, item 1): each is a
``CommandPlugin`` whose factory, in its own module of ``ups.core.cli``, is imported only when
its command runs; ``ups --help`` needs only their descriptions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ups.core.cli._main import _COMMANDS
from ups.core.plugin._records import CommandPlugin

PROBE = """
import contextlib, io, sys
from ups.core.cli._main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:  # --help
        pass
print(" ".join(sorted(m for m in sys.modules if m.startswith("ups.core.cli."))))
"""
"""Runs ``ups ARGS`` in a fresh interpreter; prints the modules of ``ups.core.cli`` imported."""

SHARED = ["ups.core.cli._common", "ups.core.cli._main"]


def cli_modules(*args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_the_built_in_commands_are_command_plugin_records() -> None:
    assert list(_COMMANDS) == [
        *("train", "tune", "validate", "check", "plugins", "report", "export"),
        *("launch", "status", "logs", "cancel"),
    ]
    assert all(isinstance(record, CommandPlugin) for record in _COMMANDS.values())
    assert all(record.description for record in _COMMANDS.values())


def test_ups_help_imports_no_command_module() -> None:
    assert cli_modules("--help") == SHARED


@pytest.mark.parametrize(
    ("args", "module"),
    [
        (["train", "--help"], "_train"),
        (["validate", "--help"], "_validate"),
        (["plugins"], "_plugins"),
        (["report", "--help"], "_report"),
        (["export", "--help"], "_export"),
        (["status", "--help"], "_launched"),
        (["cancel", "--help"], "_launched"),
    ],
)
def test_a_command_imports_its_own_module_only(args: list[str], module: str) -> None:
    assert cli_modules(*args) == sorted([*SHARED, f"ups.core.cli.{module}"])
