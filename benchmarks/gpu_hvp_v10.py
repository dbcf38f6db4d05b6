"""v10 (issue 13) on a GPU: HVPs (double backward) against flash-sinkhorn 0.4.1.

Setup of the peer's HVP numbers: GeomLoss convention p=2 (|x−y|²/2: the peer's
half_cost=True), blur 0.3 (ε = 0.09), scaling 0.9, not debiased, uniform weights, randn
clouds, one direction. Each side is timed as what a user runs: loss, gradient with
create_graph, HVP. Accuracy: against flashot's float64 torch backend on the same
schedule (tests/ check float64 itself against finite differences). Prints a table last.
"""

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashot  # noqa: E402
from flashot.autodiff.implicit import last_dual_solve  # noqa: E402

warnings.simplefilter("ignore")
dev = os.environ.get("DEVICE", "cuda")
SIZES = [tuple(map(int, c.split("x"))) for c in os.environ.get("SIZES", "10000x64,50000x64,10000x512").split(",")]
from triton.testing import do_bench  # noqa: E402
from flashot.autodiff.second_order import dual_solve_options  # noqa: E402

try:
    from flash_sinkhorn import SamplesLoss as PeerLoss
except Exception as exc:  # noqa: BLE001
    PeerLoss = None
    print("peer unavailable:", exc)


CG_MAX = int(os.environ.get("CG_MAX", "2000"))


def ours(x, y, v, backend="auto"):
    xs = x.detach().requires_grad_()
    with dual_solve_options(cg_max_iter=CG_MAX):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, backend=backend)(xs, y)
        (g,) = torch.autograd.grad(loss, xs, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), xs)
    return h


def peer(x, y, v):
    xs = x.detach().requires_grad_()
    loss = PeerLoss(p=2, blur=0.3, scaling=0.9, debias=False, half_cost=True)(xs, y)
    (g,) = torch.autograd.grad(loss, xs, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    return h


def rel(u, w):
    return float((u.double() - w.double()).norm() / w.double().norm())


rows = []
for n, d in SIZES:
    torch.manual_seed(0)
    x = torch.randn(n, d, device=dev)
    y = torch.randn(n, d, device=dev)
    v = torch.randn(n, d, device=dev)
    t0 = time.time()
    h = ours(x, y, v)
    first = time.time() - t0
    cg = dict(last_dual_solve)
    ref = None
    if os.environ.get("REF") and n <= 10_000:
        ref = ours(x.double(), y.double(), v.double(), backend="torch")
    extra = float("nan")
    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ours(x, y, v)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    t0 = time.time()
    ours(x, y, v)
    t_ours = 1000 * (time.time() - t0)
    if dev == "cuda":
        t_ours = do_bench(lambda: ours(x, y, v), warmup=1, rep=1, return_mode="median")
    row = dict(case=f"n={n} d={d}", ours_ms=t_ours, first_s=first, cg_iters=cg.get("n_iter"),
               cg_res=cg.get("residual"), extra_mb=extra,
               err=None if ref is None else rel(h, ref))  # fmt: skip
    if PeerLoss is not None:
        try:
            hp = peer(x, y, v)
            row["peer_ms"] = do_bench(lambda: peer(x, y, v), warmup=1, rep=1,
                                      return_mode="median")  # fmt: skip
            row["peer_err"] = None if ref is None else rel(hp, ref)
            row["ours_vs_peer"] = rel(h, hp)
        except Exception as exc:  # noqa: BLE001
            row["peer_ms"] = f"failed: {exc}"[:80]
    rows.append(row)
    print(row, flush=True)

print("\ncase            ours ms  peer ms  CG it  CG res   extra MB  err(ours)  err(peer)")
for r in rows:
    pm = r.get("peer_ms")
    pm = f"{pm:8.1f}" if isinstance(pm, float) else "       -"
    print(f"{r['case']:15s} {r['ours_ms']:7.1f} {pm}  {r['cg_iters']!s:5s} {r['cg_res'] or 0:8.1e} "
          f"{r['extra_mb']:8.1f}  {r['err'] or float('nan'):9.2e}  "
          f"{r.get('peer_err') or float('nan'):9.2e}")
