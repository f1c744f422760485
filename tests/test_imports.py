"""What a distribution may import from another: the names of its ``__all__``, or of the
``__all__`` of one of its public sub-packages (``ups.core.config``, ``ups.core.dist``, ...: a
folder with an ``__init__.py`` whose name does not start with ``_``), never a module beneath
them; no production module imports the test helpers of ``ups.core.testing``; and a
distribution's package keeps its implementation private (``_name.py``) behind an ``__init__``
that imports lazily."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
PUBLIC_FILES = {"__init__.py", "__main__.py", "plugin.py", "hookspecs.py", "py.typed"}
"""The files of a package that are not private: its ``__init__`` and ``__main__``, the entry
point's module (``plugin.py``), and the hooks of the plugin contract (``ups.core.plugin.hookspecs``,
read as its table of contents)."""
SHIMS = {"batches.py", "schedule.py", "builtins.py", "arguments.py"}
"""Modules of ``ups.core`` kept at their former names for users' code (docs named them, and
``arguments`` was public): each imports its names from a sub-package, and no distribution
imports them."""


def packages() -> dict[str, Path]:
    """Every distribution's top package (``ups.core``, ``ups_tensorboard``, ...) and its folder."""
    found = {f"ups.{p.name}": p for p in ROOT.glob("packages/*/src/ups/*") if p.is_dir()}
    found |= {p.parent.name: p.parent for p in ROOT.glob("plugins/*/src/*/__init__.py")}
    return found


def public_packages(top: str, folder: Path) -> dict[str, Path]:
    """The package ``top`` and its public sub-packages (their folders), by dotted name."""
    found = {top: folder}
    for init in folder.rglob("__init__.py"):
        parts = init.parent.relative_to(folder).parts
        if parts and not any(p.startswith("_") for p in parts):
            found[".".join([top, *parts])] = init.parent
    return found


def public_names(folder: Path) -> set[str]:
    """The names of the package's ``__all__``, read without importing it."""
    return all_of(folder / "__init__.py")


def all_of(module: Path) -> set[str]:
    """The names of a module's ``__all__``, read without importing it."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def imports(path: Path, package: str) -> Iterator[tuple[str, list[str]]]:
    """``(module, names)`` for each import in ``path`` (a module of ``package``), relative
    imports made absolute; names empty for ``import module``."""
    parts = [*package.split("."), *path.relative_to(packages()[package]).with_suffix("").parts]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield module, [alias.name for alias in node.names]


def violations() -> list[str]:
    found = []
    tops = packages()
    for package, folder in tops.items():
        for path in folder.rglob("*.py"):
            where = path.relative_to(ROOT)
            for module, names in imports(path, package):
                if module.startswith("ups.core.testing") or "ups.core.testing" in {
                    f"{module}.{n}" for n in names
                }:
                    if package != "ups.core" or path.relative_to(folder).parts[0] != "testing":
                        found.append(f"{where}: imports the test helpers ups.core.testing")
                    continue
                other = next(
                    (t for t in tops if t != package and (module + ".").startswith(t + ".")), None
                )
                if other is None:
                    continue
                public = public_packages(other, tops[other])
                if module not in public:
                    found.append(f"{where}: imports {module}, not {other} or a public sub-package")
                    continue
                hidden = set(names) - public_names(public[module])
                if hidden:
                    found.append(f"{where}: imports {sorted(hidden)} not in {module}.__all__")
    return found


def test_the_rule_sees_every_distribution() -> None:
    assert {"ups.core", "ups.ckpt", "ups.cloud", "ups_tensorboard"} <= set(packages())
    assert "train" in public_names(packages()["ups.core"])


def test_distributions_import_only_each_others_public_names() -> None:
    assert violations() == []


def public_modules(folder: Path) -> list[str]:
    """The modules beneath a distribution's package that are neither private (``_name``, or
    beneath a private folder), nor a package's ``__init__``, ``__main__`` or entry point, nor a
    shim of ``ups.core``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).parts
        if any(p.startswith("_") and p not in PUBLIC_FILES for p in parts):
            continue
        if parts[-1] in PUBLIC_FILES or (
            folder.name == "core" and parts == (parts[-1],) and parts[-1] in SHIMS
        ):
            continue
        found.append("/".join(parts))
    return found


def eager_imports(init: Path) -> list[str]:
    """What a package's ``__init__`` imports at once from its own modules, beyond the lazy
    machinery (imports under ``if TYPE_CHECKING:`` are for type checkers only)."""
    found = []
    for node in ast.parse(init.read_text()).body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level
            and node.module
            not in (
                "_lazy",
                None,
            )
        ):
            found.append(f"{'.' * node.level}{node.module}")
    return found


def test_implementation_modules_are_private() -> None:
    """ups.core, ups-ckpt and ups-cloud say what is public in their packages' ``__init__``s;
    the modules beneath are private, the entry point's module and ups.core's shims aside."""
    tops = packages()
    found = {top: public_modules(tops[top]) for top in ("ups.core", "ups.ckpt", "ups.cloud")}
    assert found == {"ups.core": [], "ups.ckpt": [], "ups.cloud": []}


def test_package_inits_import_lazily() -> None:
    """``import ups.core`` (and each of its sub-packages, ups.ckpt, ups.cloud) imports none of
    its modules until a name is used (so no torch for ``ups --help``)."""
    tops = packages()
    inits = [
        init
        for top in ("ups.core", "ups.ckpt", "ups.cloud")
        for init in tops[top].rglob("__init__.py")
        if init.parent.name != "testing"
    ]
    assert {str(i.relative_to(ROOT)): eager_imports(i) for i in inits} == {
        str(i.relative_to(ROOT)): [] for i in inits
    }
