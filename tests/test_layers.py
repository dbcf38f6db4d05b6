"""The package's imports go one way: no circles (at import time or inside functions), and
no climbs into the tasks (they use the library like a user; nothing below imports them)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
#: the top of the house: they use the public API; nothing below imports them
TASKS = ("flashot.tasks", "flashot.compat", "flashot.cli", "flashot.bench")


def _modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in (src / "flashot").rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
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


def _circle(mods, module_level: bool) -> str | None:
    """An import circle among ``mods`` (``a -> b -> a``), or None."""
    graph = {m: _imports(p, mods, module_level) - {m} for m, p in mods.items()}
    graph["flashot"] = set()  # (the face names every public module lazily, by design)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return " -> ".join([*path, n])
            if n not in state and (found := visit(n, [*path, n])):
                return found
        state[m] = 2
        return None

    for m in sorted(mods):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


@pytest.mark.parametrize("module_level", [True, False])
def test_no_circle_among_imports(module_level):
    """Import-time imports, and also those inside functions (deferred to break a circle
    are still a circle of the design)."""
    found = _circle(_modules(), module_level)
    assert found is None, f"import circle: {found}"


def test_the_check_finds_a_planted_circle(tmp_path):
    pkg = tmp_path / "flashot"
    (pkg / "solver").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "solver" / "__init__.py").write_text("")
    (pkg / "costs.py").write_text("def f():\n    from flashot.solver import loop\n")
    (pkg / "solver" / "loop.py").write_text("from flashot import costs\n")
    mods = _modules(tmp_path)
    assert _circle(mods, module_level=True) is None  # (deferred: seen only in functions)
    assert _circle(mods, module_level=False) in (
        "flashot.costs -> flashot.solver.loop -> flashot.costs",
        "flashot.solver.loop -> flashot.costs -> flashot.solver.loop",
    )


def test_nothing_below_the_tasks_imports_them():
    mods = _modules()
    climbs = [(m, n) for m, p in mods.items() if not _is_task(m) and m != "flashot"
              for n in _imports(p, mods, module_level=False) if _is_task(n)]  # fmt: skip
    assert not climbs, climbs


def test_the_top_holds_a_dozen_modules_and_none_is_long():
    """The layout's bounds (issue 51): at most 12 modules beside the packages at the top
    of src/flashot, none of the package's modules over 600 lines."""
    top = sorted(p.name for p in (SRC / "flashot").glob("*.py"))
    assert len(top) <= 12, top
    long = {str(p.relative_to(SRC)): n for p in (SRC / "flashot").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}  # fmt: skip
    assert not long, long


@pytest.mark.parametrize("old", sorted(__import__("flashot").MOVED))
def test_an_old_module_path_is_the_moved_module_with_a_warning(old):
    import importlib
    import sys

    import flashot

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=flashot.MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(flashot.MOVED[old])


def test_benchmarks_holds_a_handful_of_scripts_that_leave_sys_path_alone():
    """Workloads live in ``flashot bench``; benchmarks/ keeps at most eight device scripts,
    which run with ``source benchmarks/h200_env.sh`` (or ``PYTHONPATH=src:.``)."""
    bench = SRC.parent / "benchmarks"
    if not bench.is_dir():
        pytest.skip("benchmarks/ is not shipped in the sdist")
    scripts = sorted(p.name for p in bench.iterdir() if p.suffix in (".py", ".sh", ".c"))
    assert len(scripts) <= 8, scripts
    edits = [name for name in scripts if "sys.path" in (bench / name).read_text()]
    assert not edits, edits
    history = (bench / "HISTORY.md").read_text().splitlines()
    assert len(history) <= 150, "HISTORY.md is a short dated log; the long account is in git"
    assert any(line.startswith("## 20") for line in history)  # dated sections


def test_nine_in_ten_modules_have_a_test_file_of_their_name():
    """tests/ mirrors src/flashot path for path (private modules and package faces aside)."""
    tests = SRC.parent / "tests"
    root = SRC / "flashot"
    faces = ("__init__.py", "__main__.py")
    mods = [p.relative_to(root) for p in root.rglob("*.py")
            if p.name not in faces and not p.name.startswith("_")]  # fmt: skip
    missing = [str(p) for p in mods if not (tests / p.parent / f"test_{p.name}").exists()]
    assert len(missing) <= 0.1 * len(mods), missing
