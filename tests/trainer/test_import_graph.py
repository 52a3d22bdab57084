"""The trainer's modules form no import cycle: no module imports one that imports it back, not even
lazily inside a function or under ``TYPE_CHECKING`` (every ``import`` statement counts). Also: no
file of the trainer is longer than 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "trainer"
PKG = "headrace.trainer"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PKG, *parts])] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Trainer modules that ``path`` names in any import statement."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}   # `from pkg import submodule`
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (one per back edge)."""
    cycles, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return cycles


def test_trainer_has_no_import_cycle():
    graph = import_graph()
    assert "headrace.trainer.model.loading" in graph["headrace.trainer.model.decoder"]   # the graph is real
    assert _cycles(graph) == []


def test_cycle_search_finds_a_lazy_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_trainer_files_stay_under_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
