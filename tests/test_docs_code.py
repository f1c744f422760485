"""Every fenced code block of ``docs/*.md`` runs in a test, is checked, or says why not.

Every block is checked in a fresh temporary folder, as a reader who copies it would run it:
not the repository's root, and holding nothing but the files its page gives. A page gives a
file with a block marked ``<!-- save: NAME -->`` on the line before its fence (the reader
saves the block as ``NAME``; it is checked by its language too): every block of the page
finds the page's saved files in its folder.

What each block gets, by its language:

- ``python``: run, in a fresh namespace, in that folder, which is first on ``sys.path`` (as
  for a script run there, the page's saved modules import). A signature (a one-line
  ``def name(...) -> T``, or a ``class P(Protocol):`` of such lines) is instead compared with
  the real one: a hook of ``ups.core.plugin.hookspecs``, a name ``ups.core`` exports, a protocol of
  ``ups.core.plugin._records`` or of ``ups.core``.
- ``yaml``: read with ``ups.core.read_yaml`` and built into a ``Config`` (on a minimal
  ``model``/``data`` when the block has none), so every key and value is checked; a ``sweep``
  section through ``ups_optuna.parse_sweep``; the options of a plugin section, and each
  section of ``plugins``, through the installed plugin (``Registry.select``, ``Config.section``).
  A whole config (``model`` and ``data``) whose ``file.py:`` factories the page gives, or whose
  factories are all modules, is checked as ``ups validate`` checks it (its factories imported)
  and must draw no warning but one about this machine's cores; so is one whose files are
  those of the bundled examples (``examples/``), there.
- ``toml``, ``json``: parsed.
- ``bash``, ``console``: each command (every line of a bash block, each ``$ `` line of a
  console block; split at ``&&``, ``||``, ``;``, ``|``; ``NAME=value`` prefixes skipped) is
  checked: ``ups`` command lines are parsed by the ``ups`` parser itself, a ``nox -s`` session
  must exist, a ``./path`` must exist.
- ``text``: output and diagrams, not code.

A block that would check nothing fails: a python block without a statement, an empty YAML
mapping or TOML table, a console block without a ``$ `` line, a shell block of comments only,
or one without a command of those above (``pip install torch`` alone).

A block can instead say, in an HTML comment on the line before its fence, either
``<!-- not-run: REASON -->`` (the test checks that a reason is given) or
``<!-- file: PATH -->`` (the block is the file ``PATH`` of the repository, line for line; that
file is tested where it lives). The checks need every distribution and plugin installed, as
nox's ``test-plugins`` session does; a missing one fails the block naming it (nothing is
skipped).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import attrs
import pytest
import tomllib
from test_docs_hooks import protocol_lines, render

import ups.core
from ups.core import UsageError, config_from_mapping, load_plugins, read_yaml
from ups.core.cli._main import _COMMANDS, _parser
from ups.core.config._validate import validate
from ups.core.plugin import _records as records
from ups.core.plugin import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(
    r"(?:^<!-- (not-run|file|save): (.+?) -->\n)?^( *)```(\w*)\n(.*?)^\3```$",
    re.MULTILINE | re.DOTALL,
)
EXAMPLES = ROOT / "examples"
"""The bundled examples: a config of the docs naming their files is validated there."""
CORES = re.compile(r"distributed\.nproc: \d+ processes on \d+ CPU cores")
"""The warning about this machine's cores, not about the config."""
SIGNATURE = re.compile(r"def (\w+)\(.*\) -> .+")
MINIMAL = {"model": {"factory": "torch.nn:Identity"}, "data": {"factory": "tiny.py:build_dataset"}}
SECTIONS = {"sampler": "sampler", "comm_hook": "comm_hook", "checkpoint": "checkpoint"}
NOXFILE = (ROOT / "noxfile.py").read_text(encoding="utf-8")
NOX_SESSIONS = set(re.findall(r'@nox\.session\([^)]*name="([^"]+)"', NOXFILE)) | set(
    re.findall(r"@nox\.session(?:\((?:(?!name=)[^)])*\))?\ndef (\w+)\(", NOXFILE)
)
"""The sessions ``noxfile.py`` declares, by name (nox itself is not installed in the tests')."""
NO_COMMAND = {
    "console": "a console block shows commands as `$ ` lines; fence output as text",
    "bash": "a bash block without a command (comments only) checks nothing",
}


@attrs.frozen
class Block:
    page: str
    line: int
    language: str
    text: str
    marker: str | None
    argument: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in DOCS:
        source = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(source):
            marker, argument, indent, language, body = match.groups()
            text = "\n".join(line[len(indent) :] for line in body.splitlines()) + "\n"
            line = source.count("\n", 0, match.start(3)) + 1
            found.append(Block(page.name, line, language, text, marker, argument))
    return found


BLOCKS = blocks()


def fresh_folder(block: Block, tmp_path: Path) -> Path:
    """A new folder holding only the files ``block``'s page gives (its ``save:`` blocks)."""
    folder = tmp_path / "reader"
    folder.mkdir()
    for saved in BLOCKS:
        if saved.page == block.page and saved.marker == "save":
            name = saved.argument or ""
            assert "/" not in name and name not in (".", ".."), f"{saved}: save: {name!r}"
            (folder / name).write_text(saved.text, encoding="utf-8")
    return folder


def test_the_docs_have_blocks_of_every_kind() -> None:
    kinds = {b.language for b in BLOCKS} | {b.marker for b in BLOCKS}
    assert {"python", "yaml", "bash", "toml", "json", "not-run", "file", "save"} <= kinds


def run_python(block: Block, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [line for line in block.text.splitlines() if line.strip()]
    signature = SIGNATURE.fullmatch(lines[0]) if len(lines) == 1 else None
    if signature:
        name = signature.group(1)
        real = getattr(hookspecs, name, None) or getattr(ups.core, name, None)
        assert real is not None, f"{block}: {name} is neither a hook nor exported by ups.core"
        assert lines[0] == render(name, real), (
            f"{block}: the signature of {name} is not\n{lines[0]}"
        )
        return
    protocol = re.fullmatch(r"class (\w+)\(Protocol\):", lines[0]) if lines else None
    if protocol:
        expected = protocol_lines(
            getattr(records, protocol.group(1), None) or getattr(ups.core, protocol.group(1))
        )
        assert lines == expected, f"{block}: the protocol is\n" + "\n".join(expected)
        return
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))  # as for a script run there: its files import
    code = compile(block.text, str(block), "exec", flags=ast.PyCF_ONLY_AST)
    assert code.body, f"{block}: a python block without a statement checks nothing"
    exec(compile(code, str(block), "exec"), {"__name__": f"docs_{block.page}"})


def check_yaml(block: Block, folder: Path) -> None:
    data = read_yaml(block.text)
    assert isinstance(data, dict), f"{block}: not a mapping of config sections"
    assert data, f"{block}: an empty YAML block checks nothing"
    sweep = data.pop("sweep", None)
    if sweep is not None:
        from ups_optuna import parse_sweep  # the sweep section is ups-optuna's

        parse_sweep(sweep)
    config = config_from_mapping({**MINIMAL, **data}, base_dir=folder)
    registry = load_plugins()
    if {"model", "data"} <= data.keys():
        check_whole_config(block, data, folder)
    for section in data.keys() & {*SECTIONS, "launch"}:
        choice = getattr(config, section)
        if choice.name is None:  # launch: {name: null}
            continue
        family = "launcher" if section == "launch" else section
        assert choice.name in registry.records(family), (
            f"{block}: {section} {choice.name!r} is not installed (nox -s test-plugins)"
        )
        registry.select(family, choice.name, choice.options, section)
    for name in config.plugins:  # plugins: {NAME: {...}}, each through its plugin's class
        assert name in registry.records("section"), (
            f"{block}: plugins.{name} is not installed (nox -s test-plugins)"
        )
        config.section(registry.get("section", name, f"plugins.{name}").options, name)


def factories(section: object) -> list[str]:
    """The code a config names (``factory`` and ``collate`` values), at any depth."""
    if isinstance(section, list):
        return [name for item in section for name in factories(item)]
    if not isinstance(section, dict):
        return []
    named = [v for k, v in section.items() if k in ("factory", "collate") and isinstance(v, str)]
    return named + [name for value in section.values() for name in factories(value)]


def check_whole_config(block: Block, data: dict[str, object], folder: Path) -> None:
    """Validate a whole config as ``ups validate`` does, where its ``file.py:`` factories are:
    in ``folder`` (the page gives them), else in the bundled examples; no check when neither
    holds them all (a fragment about code the page shows in part)."""
    files = {name.split(":")[0] for name in factories(data) if name.split(":")[0].endswith(".py")}
    place = next((p for p in (folder, EXAMPLES) if all((p / f).is_file() for f in files)), None)
    if place is None:
        return
    config = config_from_mapping(data, base_dir=place)
    config = attrs.evolve(config, run=attrs.evolve(config.run, output_dir=str(folder / "runs")))
    warnings = [w for w in validate(config, load_plugins()) if not CORES.match(w)]
    assert not warnings, f"{block}: ups validate warns: " + "; ".join(warnings)


def check_command(block: Block, words: list[str]) -> bool:
    """Check one simple command, its words as the shell splits them; whether there was anything
    to check in it (a ``ups`` command, a ``nox -s`` session, a ``./path``)."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # NAME=value command
        words = words[1:]
    if words[:1] in (["srun"], ["sudo"]):
        words = words[1:]
    checked = words[:1] == ["ups"] or (words[:1] == ["nox"] and "-s" in words)
    if words[:1] == ["ups"]:
        args = words[1:]
        if args and args[0] not in _COMMANDS:
            assert args[0] in load_plugins().records("command"), (
                f"{block}: no command 'ups {args[0]}' (its plugin is not installed?)"
            )
        _parser(args).parse_args(args)
    elif words[:1] == ["nox"] and "-s" in words:
        session = words[words.index("-s") + 1]
        assert session in NOX_SESSIONS, f"{block}: no nox session {session!r}"
    for word in words:
        if word.startswith("./"):
            assert (ROOT / word).exists(), f"{block}: {word} does not exist"
            checked = True
    return checked


def commands(block: Block) -> list[list[str]]:
    """The simple commands of a shell block, each as its words: from a console block's ``$``
    lines, from every line of a bash block; continuation lines joined, comments dropped, a line
    split at ``&&``, ``||``, ``;`` and ``|``."""
    text = block.text.replace("\\\n", " ")
    if block.language == "console":
        lines = [line[2:] for line in text.splitlines() if line.startswith("$ ")]
    else:
        lines = text.splitlines()
    found: list[list[str]] = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= set(";&|"):
                found += [words] if words else []
                words = []
            else:
                words.append(token)
    return found


def test_a_shell_block_s_commands_are_its_simple_commands() -> None:
    def shell(language: str, text: str) -> list[list[str]]:
        return commands(Block("test.md", 1, language, text, None, None))

    assert shell("console", "$ A_1=x B='y z' ups plugins  # comment\nrecord  name\n") == [
        ["A_1=x", "B=y z", "ups", "plugins"]
    ]
    assert shell("bash", "python3 -m venv v && . v/bin/activate; ups \\\n  plugins | cat\n") == [
        ["python3", "-m", "venv", "v"],
        [".", "v/bin/activate"],
        ["ups", "plugins"],
        ["cat"],
    ]
    assert shell("console", "ups plugins\n") == []  # output only: fails the block
    assert shell("bash", "# ups plugins\n\n") == []  # comments only: fails the block
    assert not check_command(Block("test.md", 1, "bash", "", None, None), ["tensorboard"])
    with pytest.raises(UsageError):  # the NAME=value prefix skipped, ups's parser says no
        check_command(Block("test.md", 1, "bash", "", None, None), ["A=1", "ups", "train"])


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.marker == "not-run":
        assert len(block.argument or "") > 10, f"{block}: say why it is not run"
        return
    if block.marker == "file":
        assert block.text == (ROOT / (block.argument or "")).read_text(encoding="utf-8"), (
            f"{block} differs from {block.argument}"
        )
        return
    folder = fresh_folder(block, tmp_path)
    if block.language == "python":
        run_python(block, folder, monkeypatch)
    elif block.language == "yaml":
        check_yaml(block, folder)
    elif block.language == "toml":
        assert tomllib.loads(block.text), f"{block}: an empty TOML block checks nothing"
    elif block.language == "json":
        json.loads(block.text)
    elif block.language in ("bash", "console"):
        found = commands(block)
        assert found, f"{block}: " + NO_COMMAND[block.language]
        checked = [check_command(block, words) for words in found]
        assert any(checked), (
            f"{block}: no ups, nox -s or ./path command to check (<!-- not-run: WHY -->?)"
        )
    else:
        assert block.language == "text", f"{block}: a block of {block.language or 'no language'}"
