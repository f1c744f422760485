"""What a distribution may import from another: the names of its ``__all__``, or of the
``__all__`` of one of its public modules (:data:`PUBLIC_MODULES`), never another module beneath
it; and no production module imports the test helpers of ``ups.core.testing``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[1]
PUBLIC_MODULES = {"ups.core.arguments": "packages/ups-dist-core/src/ups/core/arguments.py"}
"""Modules beneath a distribution's package that others may import, by their ``__all__``:
``ups.core.arguments``, the checks of a Python API's arguments."""


def packages() -> dict[str, Path]:
    """Every distribution's top package (``ups.core``, ``ups_tensorboard``, ...) and its folder."""
    found = {f"ups.{p.name}": p for p in ROOT.glob("packages/*/src/ups/*") if p.is_dir()}
    found |= {p.parent.name: p.parent for p in ROOT.glob("plugins/*/src/*/__init__.py")}
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
                    if where.name != "testing.py" or package != "ups.core":
                        found.append(f"{where}: imports the test helpers ups.core.testing")
                    continue
                other = next(
                    (t for t in tops if t != package and (module + ".").startswith(t + ".")), None
                )
                if other is None:
                    continue
                if module in PUBLIC_MODULES:
                    hidden = set(names) - all_of(ROOT / PUBLIC_MODULES[module])
                    if hidden:
                        found.append(f"{where}: imports {sorted(hidden)} not in {module}.__all__")
                    continue
                if module != other:
                    found.append(f"{where}: imports {module}, a module beneath {other}")
                hidden = set(names) - public_names(tops[other])
                if module == other and hidden:
                    found.append(f"{where}: imports {sorted(hidden)} not in {other}.__all__")
    return found


def test_the_rule_sees_every_distribution() -> None:
    assert {"ups.core", "ups.ckpt", "ups.cloud", "ups_tensorboard"} <= set(packages())
    assert "train" in public_names(packages()["ups.core"])


def test_distributions_import_only_each_others_public_names() -> None:
    assert violations() == []
