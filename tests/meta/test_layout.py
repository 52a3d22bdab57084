"""The codebase's shape (DESIGN.md "Layout", STYLE.md): what a newcomer relies on finding.

- every module of the distribution lives under ``headrace.*``; nothing imports the old top-level
  names (``shared``, ``buffer``, ``rollout``, ``trainer``, ``deploy``);
- no import cycles between modules, counting imports inside functions (a lazy import hides a
  cycle from the interpreter, not from the reader);
- no source file over 500 lines;
- no service imports another (``shared`` imports no service; ``deploy`` may start them all).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.procs import REPO

SERVICES = ("shared", "buffer", "rollout", "trainer", "deploy")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder in SERVICES:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(["headrace", *parts])] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package-internal modules ``name`` imports anywhere in its file."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):   # a package's own parents are not cycles
                out.add(t)
    return out


def test_no_old_top_level_imports() -> None:
    bad = []
    roots = [REPO / d for d in (*SERVICES, "tests", "bench", "examples", "headrace")]
    for path in (p for r in roots for p in r.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in SERVICES]
    assert not bad, "import through the headrace namespace:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    # Tarjan's strongly connected components: any with more than one module is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    assert not cycles, "import cycles (each line one set of modules that import each other):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_file_over_the_limit() -> None:
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split these files (limit {MAX_LINES} lines):\n" + "\n".join(long)


def test_services_do_not_import_each_other() -> None:
    allowed = {"shared": {"shared"}, "buffer": {"shared", "buffer"}, "rollout": {"shared", "rollout"},
               "trainer": {"shared", "trainer"}, "deploy": set(SERVICES)}
    mods = _modules()
    bad = []
    for m, p in mods.items():
        own = m.split(".")[1]
        bad += [f"{m} imports {t}" for t in _imports(m, p, set(mods)) if t.split(".")[1] not in allowed[own]]
    assert not bad, "\n".join(sorted(bad))


def test_no_test_module_imports_another() -> None:
    """Fixtures live in conftest.py files and helpers in support modules (STYLE.md 13)."""
    bad = []
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                last = node.module.rsplit(".", 1)[1]
                if last.startswith("test_") or last == "conftest":
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}")
    assert not bad, "\n".join(bad)
