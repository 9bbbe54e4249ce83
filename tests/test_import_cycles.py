"""No module of the three packages imports, directly or through others, a module that imports it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _imports() -> dict[str, set[str]]:
    """Each module's imports of the project's own modules (TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = found
    return {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}


def test_no_import_cycles() -> None:
    """The import graph of src/ is acyclic, package __init__ re-exports aside."""
    graph = _imports()
    # A package's __init__ may re-export its submodules; a submodule importing its package's
    # public names from a sibling is what counts, so edges into an __init__ from below are kept
    # but edges from an __init__ to its own submodules are not.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not d.startswith(name + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []
