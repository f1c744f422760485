"""The import graph of ``ups.core`` has no circle, counting imports made only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import ups.core

CORE = Path(ups.core.__file__).parent


def core_imports(path: Path) -> set[str]:
    """The ``ups.core`` modules ``path`` imports (relative or absolute, at any depth)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if base == ".":  # from . import engine, logs
                found.update(alias.name for alias in node.names)
            elif base.startswith(".") or base.startswith("ups.core."):
                found.add(base.removeprefix("ups.core.").lstrip(".").split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("ups.core.").split(".")[0]
                for a in node.names
                if a.name.startswith("ups.core.")
            )
    return found & {p.stem for p in CORE.glob("*.py")}


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
    # __init__ re-exports everything; the graph is that of the modules beneath it.
    graph = {p.stem: core_imports(p) - {"__init__"} for p in CORE.glob("*.py")}
    graph.pop("__init__")
    assert len(graph) > 30 and "records" in graph["hookspecs"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
