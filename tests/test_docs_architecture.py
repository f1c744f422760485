"""``docs/architecture.md`` stays true to the tree: every module has its row, and every name it
cites exists.

The page's module tables (``| module | names | what it holds |``) sit under headings that name
a package in backticks (``## `ups.ckpt`, module by module``, ``### `ups.core.engine`: ...``,
``### `ups_blocks```); a row's path is relative to the folder of the package at the top of its
distribution (``engine/_run.py`` in ``ups.core``). Every ``.py`` file of ``packages/*/src`` and
``plugins/*/src`` has exactly one row, ``__init__.py`` files included (a sub-package's
``__init__.py`` is its public names), under a heading of its own package. Each name of a row's
``names`` column is an attribute of that module, and every dotted ``ups.`` name the page cites
in backticks, anywhere, resolves.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
SOURCES = sorted([*ROOT.glob("packages/*/src"), *ROOT.glob("plugins/*/src")])
HEADING = re.compile(r"^#{2,3} [^`]*`([\w.]+)`")
"""A heading whose first backticked word names a package (or sub-package) owning its tables."""
ROW = re.compile(r"^\| `([\w/]+\.py)` \|([^|]*)\|")
"""A module table's row: its path, then its names column."""
CITED = re.compile(r"`((?:ups|ups_\w+)\.[\w.]*\w)")
"""A dotted name in backticks that starts with a package of this repository."""
NAME = re.compile(r"`(\w+(?:\.\w+)*)`")


@attrs.frozen
class Row:
    line: int
    package: str
    """The package of the heading above the row (``ups.core.engine``)."""
    module: str
    """The module the row's path names (``ups.core.engine._run``)."""
    names: tuple[str, ...]

    def __str__(self) -> str:
        return f"architecture.md:{self.line}: {self.module}"


def top_packages() -> dict[str, Path]:
    """Each distribution's package (``ups.core``, ``ups_blocks``) and its folder."""
    found = {}
    for source in SOURCES:
        for init in source.glob("**/__init__.py"):
            folder = init.parent
            # The top package: the first folder below ``src`` with an __init__.py (``ups`` is
            # a namespace package, without one).
            if not (folder.parent / "__init__.py").exists():
                found[".".join(folder.relative_to(source).parts)] = folder
    return found


PACKAGES = top_packages()


def module_name(package: str, path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def tree_modules() -> set[str]:
    """Every module of every distribution's package, as a dotted name."""
    return {
        module_name(package, file.relative_to(folder).as_posix())
        for package, folder in PACKAGES.items()
        for file in folder.glob("**/*.py")
    }


def top_of(name: str) -> str | None:
    """The distribution package ``name`` is in or below, if any."""
    for package in PACKAGES:
        if name == package or name.startswith(package + "."):
            return package
    return None


def rows(text: str) -> list[Row]:
    """The module tables' rows of ``text``, each with the package of the heading above it."""
    found = []
    package: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        heading = HEADING.match(line)
        if heading:
            package = heading.group(1) if top_of(heading.group(1)) else None
        row = ROW.match(line)
        if row:
            assert package, f"architecture.md:{number}: a module row under no package's heading"
            path, names = row.groups()
            module = module_name(top_of(package) or package, path)
            found.append(Row(number, package, module, tuple(NAME.findall(names))))
    return found


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a module's attribute (through attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def test_every_module_has_one_row_under_its_package() -> None:
    found = rows(page())
    listed = [row.module for row in found]
    problems = {
        "modules it does not list": sorted(tree_modules() - set(listed)),
        "rows of modules that do not exist": [
            str(row) for row in found if row.module not in tree_modules()
        ],
        "modules listed more than once": sorted(
            {module for module in listed if listed.count(module) > 1}
        ),
        "rows under another package's heading": [
            f"{row} (under `{row.package}`)"
            for row in found
            if not (row.module == row.package or row.module.startswith(row.package + "."))
        ],
    }
    wrong = {problem: modules for problem, modules in problems.items() if modules}
    assert not wrong, f"architecture.md's module tables: {wrong}"


def source_of(module: str) -> Path:
    """The file of ``module``, a module of one of the distributions' packages."""
    top = top_of(module)
    assert top, module
    folder = PACKAGES[top].joinpath(
        *module.removeprefix(top).strip(".").split(".") if module != top else ()
    )
    return folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")


def defined(path: Path) -> set[str]:
    """The names a module defines, imports or lists in ``__all__`` at its top level (under
    ``if`` blocks too: ``TYPE_CHECKING``), read without importing it, so that the modules of
    plugins not installed here are checked too."""
    found: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If | ast.Try):
            body += [*node.body, *node.orelse]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            names = {t.id for t in flat if isinstance(t, ast.Name)}
            found |= names
            if "__all__" in names and node.value is not None:
                found.update(ast.literal_eval(node.value))
    return found


def test_every_name_of_a_module_row_is_in_its_module() -> None:
    absent = [
        f"{row}: {name}"
        for row in rows(page())
        if row.module in tree_modules()
        for name in row.names
        if name not in defined(source_of(row.module))
    ]
    assert not absent, f"names architecture.md cites that their modules lack: {absent}"


def test_every_dotted_name_it_cites_resolves() -> None:
    text = page()
    unresolved = sorted(
        {
            f"architecture.md:{text.count(chr(10), 0, match.start()) + 1}: {match.group(1)}"
            for match in CITED.finditer(text)
            if top_of(match.group(1)) and not resolves(match.group(1))
        }
    )
    assert not unresolved, f"dotted names architecture.md cites that do not exist: {unresolved}"


def test_the_checks_see_the_page() -> None:
    """The patterns match what the page is written with, so the checks above check something."""
    found = rows(page())
    assert len(found) > 50
    assert sum(len(row.names) for row in found) > 100
    assert len(CITED.findall(page())) > 10
