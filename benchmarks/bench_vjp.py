"""The plan's reverse-mode product on a GPU: fused Triton launches vs PyTorch tiles.

Near-converged potentials (a few Sinkhorn steps), values p = d + 1 (the value
gradient's backward) and p = 2 (the dual solve's), per tile variant of the fused
kernel: do_bench median, agreement with the PyTorch-tiles path (float32), extra memory
(MB, ``_harness``).
Env: SIZES ("10000x64,50000x64"), TILES ("64x64x8x2,64x32x4x2,...").

    python benchmarks/bench_vjp.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _harness as H

import flashot
from flashot.backends.base import Backend
from flashot.backends.triton import TritonBackend, _vjp
from flashot.geometry.costs import attention_form, get_cost

SIZES = [tuple(map(int, c.split("x")))
         for c in os.environ.get("SIZES", "10000x64,50000x64").split(",")]  # fmt: skip
TILES = [tuple(map(int, t.split("x"))) for t in
         os.environ.get("TILES", "64x64x4x2,64x64x8x2,64x32x4x2,32x64x4x2,128x64x8x1").split(",")]


def rel(u, w):
    return float((u - w).norm() / w.norm().clamp_min(1e-30))


def time_and_memory(call):
    return H.median_ms(call), H.peak_extra_mb(call)


KEYS = ("row", "row_k", "col", "col_q", "pt_d", "per_a", "per_b")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
rows = []
for n, d in SIZES:
    torch.manual_seed(0)
    x, y = torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda")
    eps = 0.09
    be = TritonBackend()
    res = flashot.sinkhorn(x, y, eps=eps, cost="half_sqeuclidean", eps_schedule="geomloss",
                           backend=be)  # fmt: skip
    f, g = res.f.detach(), res.g.detach()
    form = attention_form(get_cost("half_sqeuclidean"), x, y).detach()
    a = torch.full((n,), 1.0 / n, device="cuda")
    for p in (d + 1, 2):
        v, dd = torch.randn(n, p, device="cuda"), torch.randn(n, p, device="cuda") / n
        ref = Backend.plan_vjp(be, form, f, g, a, a, eps, v, dd)
        t, m = time_and_memory(lambda: Backend.plan_vjp(be, form, f, g, a, a, eps, v, dd))
        rows.append((n, d, p, "torch tiles", t, m, 0.0))
        print(rows[-1], flush=True)
        for tiles in TILES:
            for chunk in (32, 128):
                _vjp.TILES, _vjp.P_CHUNK = tiles, chunk
                name = "fused {}x{} w{} s{}".format(*tiles) + f" p{chunk}"
                try:
                    out = be.plan_vjp(form, f, g, a, a, eps, v, dd)
                    err = max(rel(getattr(out, k), getattr(ref, k)) for k in KEYS)
                    t, m = time_and_memory(lambda: be.plan_vjp(form, f, g, a, a, eps, v, dd))
                    rows.append((n, d, p, name, t, m, err))
                    print(rows[-1], flush=True)
                except Exception as exc:  # out of resources: the next variant
                    print(name, "failed:", str(exc)[:120], flush=True)
print("\n   n    d    p  variant                ms     extra MB   max rel. diff")
for n, d, p, who, t, m, e in rows:
    print(f"{n:6d} {d:4d} {p:4d}  {who:20s} {t:8.3f} {m:9.1f}   {e:.1e}")
