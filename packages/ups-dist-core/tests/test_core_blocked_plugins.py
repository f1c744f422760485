"""``UPS_BLOCK_PLUGINS`` turns a plugin off whatever the config says: its ``plugins.NAME``
section is accepted and ignored, while a section no installed plugin provides stays an error."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ups.core import ConfigError, load_config
from ups.core.config._validate import validate
from ups.core.plugin._manager import BLOCK_ENV, load_plugins
from ups.core.testing import install_plugin, run_ups, tiny_project

TRACKER = """
import attrs
from ups.core import SectionPlugin, hookimpl


@attrs.frozen(kw_only=True)
class TrackerOptions:
    project: str = "ups"


@hookimpl
def ups_config_sections():
    return [SectionPlugin(name="tracker", options=TrackerOptions)]
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site folder with the plugin ``tracker`` installed, on ``sys.path`` and
    ``PYTHONPATH``."""
    folder = tmp_path / "site"
    folder.mkdir()
    install_plugin(folder, "ups-tracker", "ups_tracker_plugin", TRACKER, entry_point="tracker")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    return folder


def test_a_blocked_plugins_section_is_ignored_with_one_info_line(
    site: Path, tmp_path: Path
) -> None:
    config = load_config(tiny_project(tmp_path, plugins={"tracker": {"project": 3}}))
    registry = load_plugins(env={BLOCK_ENV: "tracker"})
    with capture_logs() as logs:
        validate(config, registry)  # the bad value unchecked: the plugin is off
    ignored = [e for e in logs if e["event"] == "config section of a blocked plugin ignored"]
    assert ignored == [
        {
            "event": "config section of a blocked plugin ignored",
            "section": "plugins.tracker",
            "log_level": "info",
        }
    ]
    with pytest.raises(ConfigError, match=r"^plugins.tracker.project: expected a string"):
        validate(config, load_plugins(env={}))  # not blocked: checked


def test_ups_validate_accepts_a_blocked_plugins_section(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_project(tmp_path, plugins={"tracker": {"project": "pde"}})
    monkeypatch.setenv(BLOCK_ENV, "tracker")
    result = run_ups("validate", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"{config}: ok"


def test_a_section_of_no_installed_plugin_stays_an_error_with_the_nearest_name(
    site: Path, tmp_path: Path
) -> None:
    config = load_config(tiny_project(tmp_path, plugins={"trackr": {}}))
    for env in ({}, {BLOCK_ENV: "tracker"}):
        # blocked or not, a name no installed plugin has is a mistake
        with pytest.raises(ConfigError, match=r"^plugins.trackr: unknown section 'trackr'"):
            validate(config, load_plugins(env=env))
    with pytest.raises(ConfigError, match="did you mean 'tracker'"):
        validate(config, load_plugins(env={}))
