import os

import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors: this must be
# decided before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

# CI runs each property on the same examples every time: a red run must mean a change
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", help="also run the tests marked slow (CI: a second step)"
    )


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.skip(reason="slow: run with --run-slow (pytest -m slow --run-slow)")
    gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(gpu)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def clouds(gen, n=30, m=25, d=3, dtype=torch.float64, shift=1.0):
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(m, d, generator=gen, dtype=torch.float64) + shift
    return x.to(dtype), y.to(dtype)


def weights(gen, n, dtype=torch.float64, floor=0.1):
    w = torch.rand(n, generator=gen, dtype=torch.float64) + floor
    return (w / w.sum()).to(dtype)


def rel(u, v):
    u, v = torch.as_tensor(u, dtype=torch.float64), torch.as_tensor(v, dtype=torch.float64)
    return float((u - v).norm() / v.norm().clamp_min(1e-300))


def nan_rows(t):
    """``t`` as the leading rows of a buffer holding NaN in the 16 rows past its end: a
    kernel that reads past a tensor's last row (Triton's tail tiles) turns NaN."""
    buf = torch.full((len(t) + 16, *t.shape[1:]), float("nan"), device=t.device, dtype=t.dtype)
    buf[: len(t)] = t
    return buf[: len(t)]


def run_cli(argv, capsys):
    """``flashot ARGV`` in process: ``(exit code, stdout, stderr)``."""
    from flashot.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cuda_clouds(n, m, d, seed=0):
    """Two clouds on the current GPU: x ~ N(0, I), y ~ N(0.5, I) (the GPU tests' data)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g)
    y = torch.randn(m, d, device="cuda", generator=g) + 0.5
    return x, y


def triton_backend(*args, **options):
    """A TritonBackend, imported when called (Triton is an optional extra)."""
    from flashot.backends.triton import TritonBackend

    return TritonBackend(*args, **options)


def modules_loaded_by(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules under ``prefixes`` that ``code`` leaves imported, in a fresh interpreter."""
    import ast
    import subprocess
    import sys

    probe = (code + "\nimport sys\n"
             f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip())
