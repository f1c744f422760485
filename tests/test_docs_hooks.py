"""docs/hooks.md documents every hook of ``ups.core.plugin.hookspecs``, with its exact signature, and
no hook that does not exist (as datasette's ``test_plugin_hooks_are_documented``).

A hook's documented signature is a fenced ``python`` block of one line, ``def ups_x(...) -> T``,
under its heading ``### ups_x``: the text ``inspect.signature`` gives for the spec, with the
annotations written as source (``hookspecs`` uses ``from __future__ import annotations``).
For the registration hooks, the section also shows every field of the record type (a table row
per field) and the factory protocol the record's ``factory`` must satisfy, method by method.
"""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Sampler

from ups.core import Config, RunContext, Strategy
from ups.core.plugin import hookspecs
from ups.core.plugin._manager import FAMILIES
from ups.core.plugin._markers import NAME

ANNOTATED = {
    "Config": Config,
    "DistributedDataParallel": DistributedDataParallel,
    "RunContext": RunContext,
    "Sampler": Sampler,
    "Strategy": Strategy,
}
"""Names ``ups.core.plugin._records`` imports for its annotations only (under ``TYPE_CHECKING``, so
that listing the plugins imports no torch)."""
HOOKS_MD = Path(__file__).resolve().parents[1] / "docs" / "hooks.md"
TEXT = HOOKS_MD.read_text(encoding="utf-8")

HOOKS = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if name.startswith("ups_") and inspect.isfunction(fn) and fn.__module__ == hookspecs.__name__
}
RECORDS = {hook: record for hook, record in FAMILIES.values()}

FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SIGNATURE = re.compile(r"def (ups_\w+)\(.*\) -> .+")
HEADING = re.compile(r"^### (\S+)$", re.MULTILINE)


class _Source:
    """An annotation kept as a string, shown as the source text (no quotes) in a signature."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation: object) -> object:
    return _Source(annotation) if isinstance(annotation, str) else annotation


def render(name: str, fn: Any) -> str:
    """``def name(params) -> ret``, annotations as written in the source."""
    sig = inspect.signature(fn)
    sig = sig.replace(
        parameters=[p.replace(annotation=_unquoted(p.annotation)) for p in sig.parameters.values()],
        return_annotation=_unquoted(sig.return_annotation),
    )
    return f"def {name}{sig}"


def documented_signatures() -> dict[str, list[str]]:
    """Every one-line ``def ups_*`` python block in hooks.md, by hook name."""
    found: dict[str, list[str]] = {}
    for block in FENCE.findall(TEXT):
        line = block.strip()
        match = SIGNATURE.fullmatch(line)
        if match and "\n" not in line:
            found.setdefault(match.group(1), []).append(line)
    return found


def section(hook: str) -> str:
    """The text of hooks.md from the heading ``### hook`` to the next heading."""
    match = re.search(rf"^### {re.escape(hook)}\n(.*?)(?=^#{{1,3}} |\Z)", TEXT, re.M | re.S)
    assert match, f"docs/hooks.md has no heading '### {hook}'"
    return match.group(1)


def protocol_lines(protocol: type) -> list[str]:
    """``class P(Protocol):`` and one ``    def m(...) -> T: ...`` line per method."""
    methods = [
        name
        for name, value in vars(protocol).items()
        if inspect.isfunction(value) and (name == "__call__" or not name.startswith("_"))
    ]
    return [f"class {protocol.__name__}(Protocol):"] + [
        f"    {render(name, getattr(protocol, name))}: ..." for name in methods
    ]


DOCUMENTED = documented_signatures()
MENTIONED = sorted(
    set(re.findall(r"\bups_[a-z_]+\b", TEXT)) | set(HEADING.findall(TEXT)) | set(DOCUMENTED)
)


def test_hookspecs_has_hooks() -> None:
    assert HOOKS, "no ups_* functions found in ups.core.plugin.hookspecs"


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_is_a_spec(hook: str) -> None:
    assert hasattr(HOOKS[hook], f"{NAME}_spec"), f"{hook} is not marked with @hookspec"


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_hook_is_documented_with_its_signature(hook: str) -> None:
    expected = render(hook, HOOKS[hook])
    documented = DOCUMENTED.get(hook, [])
    assert documented, f"docs/hooks.md does not document {hook}; add:\n```python\n{expected}\n```"
    assert documented == [expected], f"docs/hooks.md documents {hook} as {documented}"
    signature_block = FENCE.search(section(hook))
    assert signature_block, f"no python block under '### {hook}'"
    assert signature_block.group(1).strip() == expected, (
        f"the first python block under '### {hook}' is not its signature"
    )


@pytest.mark.parametrize("hook", MENTIONED)
def test_documented_hook_exists(hook: str) -> None:
    assert hook in HOOKS, f"docs/hooks.md mentions {hook}, which ups.core.plugin.hookspecs lacks"


@pytest.mark.parametrize("hook", sorted(RECORDS))
def test_registration_record_and_factory_are_documented(hook: str) -> None:
    text = section(hook)
    record = RECORDS[hook]
    for field in attrs.fields(record):
        assert re.search(rf"^\| `{field.name}` +\|", text, re.M), (
            f"the table of {record.__name__} under '### {hook}' lacks a row for `{field.name}`"
        )
    factory = typing.get_type_hints(record).get("factory")
    if factory is None:  # a config section: options only, nothing to build
        return
    protocols = [factory]
    made = typing.get_type_hints(factory.__call__, localns=ANNOTATED).get("return")
    if getattr(made, "_is_protocol", False):
        protocols.append(made)
    for protocol in protocols:
        for line in protocol_lines(protocol):
            assert line in text.splitlines(), f"'### {hook}' lacks the line:\n{line}"
