"""The import graph of ``ups.core`` has no circle, counting imports made only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import ups.core

CORE = Path(ups.core.__file__).parent


def modules() -> dict[str, Path]:
    """Every module of ``ups.core`` but the packages' ``__init__``s (which re-export lazily),
    by its dotted name beneath ``ups.core`` (``dist._context``)."""
    return {
        ".".join(p.relative_to(CORE).with_suffix("").parts): p
        for p in CORE.rglob("*.py")
        if p.name != "__init__.py"
    }


def core_imports(name: str, path: Path) -> set[str]:
    """The ``ups.core`` modules the module ``name`` imports (relative or absolute, at any
    depth, ``from package import module`` included)."""
    known = modules()
    package = name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module or "").split(".")
            elif (node.module or "").startswith("ups.core."):
                base = node.module.removeprefix("ups.core.").split(".")  # type: ignore[union-attr]
            else:
                continue
            target = ".".join(p for p in base if p)
            found.add(target)
            found.update(f"{target}.{alias.name}".lstrip(".") for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("ups.core.")
                for a in node.names
                if a.name.startswith("ups.core.")
            )
    return found & set(known)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as the path around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], node, target]
            if target not in state and (cycle := visit(target, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_import_graph_has_no_cycle() -> None:
    # the __init__s re-export lazily; the graph is that of the modules beneath them.
    graph = {name: core_imports(name, path) for name, path in modules().items()}
    assert len(graph) > 50 and "plugin._records" in graph["plugin.hookspecs"]
    assert "observe._logs" in graph["cli._main"]  # from ..observe import _logs as logs
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
