"""Where the unrolled SamplesLoss HVP spends its time on the GPU (issue 48): one double
backward at the peer's setting (blur 0.3, scaling 0.9, d = 64, N points), profiled;
prints kernel time against wall time and the top ops by device and by host time."""

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashot

N = int(os.environ.get("N", "10000"))
torch.manual_seed(0)
x, y, v = (torch.randn(N, 64, device="cuda") for _ in range(3))
loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)
xs = x.detach().requires_grad_()
(g,) = torch.autograd.grad(loss(xs, y), xs, create_graph=True)
for _ in range(2):
    torch.autograd.grad((g * v).sum(), xs, retain_graph=True)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    torch.autograd.grad((g * v).sum(), xs, retain_graph=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
ev = prof.key_averages()
# one row pass and one plan_vjp as the replay makes them, timed alone
from triton.testing import do_bench

from flashot.backends import resolve_backend
from flashot.geometry.costs import AttentionForm

be = resolve_backend("auto", x.device)
q, k = 2**0.5 * x, 2**0.5 * y
al, bl = (x * x).sum(1), (y * y).sum(1)
form = AttentionForm(q, k, al, bl, cost_bound=float(4 * (al.max() + bl.max())))
h, lw = (
    torch.zeros(N, device="cuda"),
    torch.full((N,), -float(torch.log(torch.tensor(N))), device="cuda"),
)
ra = do_bench(lambda: be.row_attend(form, h - bl, 0.09, log_w=lw), return_mode="median")
r = -be.row_attend(form, h - bl, 0.09, log_w=lw)[0]
pv = do_bench(
    lambda: be.plan_vjp(
        form,
        r,
        h,
        torch.ones_like(r),
        torch.exp(lw),
        0.09,
        r.new_ones(N, 1),
        r[:, None],
        frozenset({"row_k", "col"}),
    ),
    return_mode="median",
)
print(f"one row_attend {ra:.3f} ms, one plan_vjp {pv:.3f} ms")
dev = sum(e.self_device_time_total for e in ev) / 1e3
print(f"wall {wall * 1e3:.1f} ms, device kernels {dev:.1f} ms")
print(ev.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))

# SWEEP=1: the plan_vjp kernel's open levers (NOTES.md, second order): value products in
# TF32 instead of 3xTF32, and its tiles; each with one plan_vjp's time, the whole HVP's
# time and the HVP's error against the same double backward in float64
if os.environ.get("SWEEP"):
    import flashot.backends.triton._vjp as vjp

    def hvp_of(xx, yy, vv):
        xl = xx.detach().requires_grad_()
        (gg,) = torch.autograd.grad(loss(xl, yy), xl, create_graph=True)
        return lambda: torch.autograd.grad((gg * vv).sum(), xl, retain_graph=True)[0]

    ref = hvp_of(x.double(), y.double(), v.double())().float()
    rows = []
    for value_dot in (None, "tf32"):
        for tiles in ((32, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3)):
            vjp.VALUE_DOT, vjp.TILES = value_dot, tiles
            run = hvp_of(x, y, v)
            err = float((run() - ref).norm() / ref.norm())
            t_hvp = do_bench(run, return_mode="median")
            t_vjp = do_bench(
                lambda: be.plan_vjp(form, r, h, torch.ones_like(r), torch.exp(lw), 0.09,
                                    r.new_ones(N, 1), r[:, None], frozenset({"row_k", "col"})),
                return_mode="median",
            )  # fmt: skip
            rows.append((value_dot or "3xTF32", tiles, t_vjp, t_hvp, err))
    print("| value products | tiles (M, N, warps, stages) | plan_vjp ms | HVP ms | HVP rel. err |")
    print("|---|---|---|---|---|")
    for vd, tl_, tv, th, e in rows:
        print(f"| {vd} | {tl_} | {tv:.3f} | {th:.1f} | {e:.2e} |")
