"""``flashot tune``: tune the Triton kernels' tiles on this GPU and keep them in a table.

The sweep runs the launches users meet, for each precision, feature size and cloud
size: a fixed-iteration symmetric solve with its gradient (fused steps, potential-bias
LSEs, value products), an alternating solve (plain LSEs), and in float32 a
Hessian-vector product (plan products of the dual CG). Every launch key it meets is
autotuned once and written to the table: the user's (:func:`._tables.user_table_path`)
by default, or ``out`` (how ``src/flashot/backends/triton/tiles/sm_XY.json`` is made:
``flashot tune --out src/flashot/backends/triton/tiles/sm_90.json``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["DEFAULT_DIMS", "DEFAULT_PRECISIONS", "DEFAULT_SIZES", "tune"]

DEFAULT_PRECISIONS = ("fp32", "tf32", "bf16")
#: one feature size per regime of the kernels' feature tile: up to 64, 65–128 (one
#: 128-wide chunk: twice d = 64's shared memory per stage), beyond 128 (chunked)
DEFAULT_DIMS = (3, 64, 128, 512)
DEFAULT_SIZES = (10_000, 50_000)


def tune(
    precisions: Sequence[str] = DEFAULT_PRECISIONS,
    dims: Sequence[int] = DEFAULT_DIMS,
    sizes: Sequence[int] = DEFAULT_SIZES,
    out: str | Path | None = None,
    hvp: bool = True,
    device: str = "cuda",
    log: Callable[[str], None] = print,
) -> Path:
    """Autotune every launch key of the sweep; returns the table written.

    Args:
        precisions: precision modes.  dims: feature sizes d.  sizes: n = m.
        out: table file to write (default: the user's table for this GPU).
        hvp: also run a Hessian-vector product (float32, d ≤ 128, the smallest size).
        device: the CUDA device.
        log: one line per case.
    """
    import flashot
    from flashot.backends.triton import TritonBackend, _tables
    from flashot.backends.triton._launch import _BEST

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(
            "flashot tune needs a CUDA GPU: tiles are tuned on the GPU that runs them"
        )
    arch = _tables.arch(dev.index or 0)
    path = Path(out) if out is not None else _tables.user_table_path(arch)
    gen = torch.Generator(device=dev).manual_seed(0)
    for precision in precisions:
        backend = TritonBackend(precision, autotune=True)
        for d in dims:
            for n in sizes:
                t0 = time.perf_counter()
                x = torch.randn(n, d, device=dev, generator=gen)
                y = torch.randn(n, d, device=dev, generator=gen) + 0.5
                eps = 0.05 * d  # a mid-range ε for randn clouds of this d (≈ 2d apart)
                xs = x.clone().requires_grad_()
                res = flashot.sinkhorn(xs, y, eps=eps, max_iter=10, tol=None, backend=backend)
                res.cost.backward()
                flashot.sinkhorn(x, y, eps=eps, max_iter=10, tol=None, update="alternating",
                                 backend=backend)  # fmt: skip
                if hvp and precision == "fp32" and d <= 128 and n == min(sizes):
                    v = torch.randn(n, d, device=dev, generator=gen)
                    flashot.hvp(x, y, v, eps=eps, backend=backend)
                torch.cuda.synchronize(dev)
                for key, cfg in list(_BEST.items()):
                    _tables.record(key, cfg, arch, path=path)
                log(f"{precision} d={d} n={n}: {time.perf_counter() - t0:.1f} s, "
                    f"{len(_BEST)} keys tuned so far")  # fmt: skip
    return path
