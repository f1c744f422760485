"""A plugin command's own top-level config section (ups-optuna's ``sweep``): ``ups validate``
checks it against the command record's ``options``, as it checks the rest of the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core import UsageError, load_config
from ups.core.plugin._manager import load_plugins
from ups.core.testing import install_plugin, run_ups, tiny_project

GREET = """
import attrs
from ups.core import CommandPlugin, hookimpl


@attrs.frozen(kw_only=True)
class GreetOptions:
    who: str = "world"


def greet(parser):
    return lambda args: 0


@hookimpl
def ups_commands():
    return [
        CommandPlugin(name="greet", factory=greet, options=GreetOptions),
        CommandPlugin(name="plain", factory=greet),
    ]
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    install_plugin(folder, "ups-greet", "ups_greet_plugin", GREET, entry_point="greet")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return folder


def test_the_sections_of_commands_with_options(site: Path) -> None:
    sections = load_plugins(env={"UPS_BLOCK_PLUGINS": "optuna"}).command_sections()
    assert {name: cls.__name__ for name, cls in sections.items()} == {"greet": "GreetOptions"}


def test_load_config_checks_and_leaves_out_a_commands_section(site: Path, tmp_path: Path) -> None:
    sections = load_plugins(env={}).command_sections()
    config = tiny_project(tmp_path, greet={"who": "ranks"})
    assert load_config(config, sections=sections).run.name == "tiny"
    with pytest.raises(UsageError, match=r"run.yaml: greet.who: expected a string, got 3$"):
        load_config(config, ["greet.who=3"], sections=sections)
    with pytest.raises(UsageError, match=r"run.yaml: greet: unknown key"):
        load_config(config)  # no command reads it here: not a key of a run's config


def test_ups_validate_checks_a_commands_section(site: Path, tmp_path: Path) -> None:
    config = tiny_project(tmp_path, greet={"who": "ranks"})
    result = run_ups("validate", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    result = run_ups("validate", str(config), "-o", "greet.whom=x", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"ups: error: {config}: greet.whom: unknown key; allowed: who")
    )
    assert "Traceback" not in result.stderr
