"""What ``ups plugins`` and ``ups validate`` say of the records plugins provide: each record's
description, and a built-in name that a plugin took over."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core import load_plugins
from ups.core.cli._main import main
from ups.core.testing import install_plugin, tiny_project

TAKEOVER = """
from ups.core import SamplerPlugin, hookimpl
from ups.core.plugin._builtins import torch_sampler


@hookimpl
def ups_samplers():
    return [SamplerPlugin(name="torch", factory=torch_sampler, description="torch's, but ours")]
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("UPS_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "")
    install_plugin(tmp_path, "ups-takeover", "ups_takeover_plugin", TAKEOVER, "2.0")
    return tmp_path


def test_plugins_shows_each_records_description_last(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["FAMILY", "NAME", "PLUGIN", "DISTRIBUTION", "STATUS", "DESCRIPTION"]
    described = {tuple(line.split()[:2]): line.split(None, 6)[6:] for line in lines[1:]}
    assert described["sampler", "torch"] == ["torch's, but ours"]
    simple = load_plugins().records("checkpoint")["simple"].record.description
    assert described["checkpoint", "simple"] == [simple]
    column = lines[0].index("DESCRIPTION")  # in one column
    assert lines[1 + list(described).index(("sampler", "torch"))][column:] == "torch's, but ours"


def test_validate_says_which_selected_name_a_plugin_took_from_a_built_in(
    site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_project(site / "project", checkpoint={"name": "simple"})
    assert main(["validate", str(config)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{config}: ok",
        "sampler.name: note: sampler 'torch' is not the built-in one: plugin "
        "'ups-takeover' (ups-takeover 2.0) replaced it",
    ]
    monkeypatch.setenv("UPS_BLOCK_PLUGINS", "ups-takeover")  # the built-in torch again
    assert main(["validate", str(config)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{config}: ok"]
