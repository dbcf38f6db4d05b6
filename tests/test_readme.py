"""Every Python snippet of the README runs (at CPU-sized n) and says nothing alarming.

The snippets run in order in one namespace, as a reader pastes them; sizes written
``N_000`` are divided by 1 000 (``100_000`` points become 100), the rest is verbatim.
A convergence warning fails the test: the README's calls must converge out of the box.
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

import flashot

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def scaled(code: str) -> str:
    return re.sub(r"\b(\d+)_000\b", lambda m: m.group(1), code)


def test_readme_has_python_snippets():
    assert len(python_blocks(README.read_text())) >= 2


@pytest.mark.parametrize("seed", [0])
def test_readme_snippets_run(seed, tmp_path, monkeypatch):
    """The snippets draw their data from the global RNG: a few fixed seeds, not the
    suite's order, decide what they see. They run in a scratch folder (they save files)."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(seed)
    namespace: dict = {}
    for i, block in enumerate(python_blocks(README.read_text())):
        with warnings.catch_warnings():
            warnings.simplefilter("error", flashot.ConvergenceWarning)
            try:
                # (from a file: @triton.jit reads its function's source)
                path = tmp_path / f"readme_block_{i}.py"
                path.write_text(scaled(block))
                exec(compile(path.read_text(), str(path), "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"README python block {i} failed: {type(exc).__name__}: {exc}")
