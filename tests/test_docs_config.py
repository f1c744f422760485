"""docs/config.md, the configuration reference, is tested against the attrs classes of
``ups.core.config._config``: every key of every section has a row with its real default, no row names
a key that does not exist, and the plugin sections and the schedule name every key they take."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
import yaml

from ups.core import Config
from ups.core.config._config import PluginChoice
from ups.core.engine._schedule import Rule

CONFIG_MD = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text(encoding="utf-8")
HINTS = typing.get_type_hints(Config)


def _section_class(name: str) -> type | None:
    """The attrs class a top-level key is built into (``eval: EvalConfig | None`` too); not
    the rules of ``schedule``, a tuple."""
    if typing.get_origin(HINTS[name]) is tuple:
        return None
    for candidate in (HINTS[name], *typing.get_args(HINTS[name])):
        if attrs.has(candidate):
            return candidate  # type: ignore[no-any-return]
    return None


TABLED = {
    f.name: cls
    for f in attrs.fields(Config)
    if (cls := _section_class(f.name)) is not None and not issubclass(cls, PluginChoice)
}
PLUGIN_SECTIONS = {
    f.name: cls
    for f in attrs.fields(Config)
    if (cls := _section_class(f.name)) is not None and issubclass(cls, PluginChoice)
}


def section(heading: str) -> str:
    """The text of config.md under ``### heading``, to the next heading of level 1 to 3."""
    match = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^#{{1,3}} |\Z)", CONFIG_MD, re.M | re.S)
    assert match, f"docs/config.md has no heading '### {heading}'"
    return match.group(1)


def rows(text: str) -> dict[str, dict[str, str]]:
    """The first table of ``text``: its rows by their first cell's `key`, as {column: cell}."""
    table_lines = re.search(r"^\|.*?(?=^[^|]|\Z)", text, re.M | re.S)
    assert table_lines, "no table"
    lines = table_lines.group(0).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    table = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        key = re.fullmatch(r"`(\w+)`", cells[0])
        if key:
            table[key.group(1)] = dict(zip(header, cells, strict=False))
    return table


def documented_default(cell: str) -> Any:
    return yaml.safe_load(cell.strip("`"))


def test_every_section_is_documented() -> None:
    for name in (*TABLED, "schedule"):
        section(f"`{name}`")
    assert set(PLUGIN_SECTIONS) == {"sampler", "comm_hook", "strategy", "checkpoint", "launch"}


@pytest.mark.parametrize("name", sorted(TABLED))
def test_a_section_has_a_row_per_key_with_its_default(name: str) -> None:
    cls = TABLED[name]
    table = rows(section(f"`{name}`"))
    fields = {f.name: f for f in attrs.fields(cls)}
    assert set(table) == set(fields), f"docs/config.md's `{name}` table differs from {cls.__name__}"
    for key, field in fields.items():
        cell = table[key]["default"]
        if field.default is attrs.NOTHING:
            assert cell == "required", f"{name}.{key} is required"
        elif isinstance(field.default, bool | int | float | str | None):
            assert documented_default(cell) == field.default, f"{name}.{key}: {cell}"


@pytest.mark.parametrize("name", sorted(PLUGIN_SECTIONS))
def test_a_plugin_section_names_every_key_and_its_default(name: str) -> None:
    text = section("Plugin sections: `sampler`, `comm_hook`, `strategy`, `checkpoint`, `launch`")
    assert set(rows(text)) == {f.name for f in attrs.fields(PluginChoice)}
    row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    cls = PLUGIN_SECTIONS[name]
    assert documented_default(cells[1]) == attrs.fields_dict(cls)["name"].default
    for extra in set(attrs.fields_dict(cls)) - set(attrs.fields_dict(PluginChoice)):
        assert f"`{extra}`" in cells[2], f"the {name} row lacks its key `{extra}`"


def test_the_schedule_section_names_every_trigger_and_action() -> None:
    text = section("`schedule`")
    for part in attrs.fields(Rule):
        for key in attrs.fields_dict(typing.get_type_hints(Rule)[part.name]):
            assert f"`{key}`" in text, f"schedule: `{part.name}.{key}` is not named"


def test_the_simple_checkpoint_backend_has_a_row_per_option() -> None:
    """Every option of the built-in ``simple`` backend (``keep_best`` too) has its row."""
    from ups.core.checkpoint import SimpleCheckpointOptions

    text = section("Plugin sections: `sampler`, `comm_hook`, `strategy`, `checkpoint`, `launch`")
    for key in attrs.fields_dict(SimpleCheckpointOptions):
        assert f"| `checkpoint` | `simple` | `{key}` |" in text, f"checkpoint.options.{key}"
