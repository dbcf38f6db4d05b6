"""The package's imports go one way: no circles (at import time or inside functions), and
no climbs into the tasks (they use the library like a user; nothing below imports them)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
#: the top of the house: they use the public API; nothing below imports them
TASKS = ("flashot.tasks", "flashot.compat", "flashot.cli", "flashot.bench")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "flashot").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, mods, module_level: bool) -> set[str]:
    """flashot modules imported by a file (``from pkg import sub`` counts as ``pkg.sub``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else list(ast.walk(tree))
    found = set()
    for node in nodes:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in mods] or [node.module]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name.startswith("flashot"):
                found.add(name)
    return found


def _is_task(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TASKS)


@pytest.mark.parametrize("module_level", [True, False])
def test_no_circle_among_imports(module_level):
    """Import-time imports, and also those inside functions (deferred to break a circle
    are still a circle of the design). The face (``flashot/__init__``) is left out: it
    names every public module lazily, by design."""
    mods = _modules()
    graph = {m: _imports(p, mods, module_level) - {m} for m, p in mods.items()}
    graph["flashot"] = set()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import circle: {' -> '.join([*path, n])}"
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_nothing_below_the_tasks_imports_them():
    mods = _modules()
    climbs = [(m, n) for m, p in mods.items() if not _is_task(m) and m != "flashot"
              for n in _imports(p, mods, module_level=False) if _is_task(n)]  # fmt: skip
    assert not climbs, climbs
