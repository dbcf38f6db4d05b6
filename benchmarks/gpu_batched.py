"""A ragged batch in one packed solve against a Python loop (issue 18).

B problems of random sizes n, m ∈ [LO, HI] (seed 0), d = D, Gaussian clouds scaled to
unit variance per point, ε = EPS, ITERS fixed symmetric iterations (tol=None): one
``flashot.sinkhorn_varlen`` call (one launch per side per step) against a loop of
``flashot.sinkhorn`` calls over the same problems (each of those warm, CUDA graphs where
they apply), and the packed solve without the one-exp fused pass (``fused=False``).
Both for the value alone and value + gradient; each timed as the median of REPS calls
after two warm-up calls (the loop's solves replay CUDA graphs from their third call).
Costs are compared.
Env: B (64), LO (1000), HI (20000), D (64), EPS (0.5), ITERS (10), PRECISIONS
("auto,bf16").

    python benchmarks/gpu_batched.py
"""

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashot
from flashot.backends.triton import TritonBackend

warnings.simplefilter("ignore")
B = int(os.environ.get("B", "64"))
LO, HI = int(os.environ.get("LO", "1000")), int(os.environ.get("HI", "20000"))
D = int(os.environ.get("D", "64"))
EPS = float(os.environ.get("EPS", "0.5"))
ITERS = int(os.environ.get("ITERS", "10"))
PRECISIONS = os.environ.get("PRECISIONS", "auto,bf16").split(",")
REPS = int(os.environ.get("REPS", "5"))


def median_ms(fn) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def main():
    gen = torch.Generator().manual_seed(0)
    ns = torch.randint(LO, HI + 1, (B,), generator=gen).tolist()
    ms = torch.randint(LO, HI + 1, (B,), generator=gen).tolist()
    xs = [torch.randn(n, D, generator=gen).cuda() / D**0.5 for n in ns]
    ys = [(torch.randn(m, D, generator=gen) / D**0.5 + 0.1).cuda() for m in ms]
    x, y = torch.cat(xs), torch.cat(ys)
    xo = [0, *torch.tensor(ns).cumsum(0).tolist()]
    yo = [0, *torch.tensor(ms).cumsum(0).tolist()]
    elems = sum(n * m for n, m in zip(ns, ms, strict=True))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; B={B}, n,m in "
          f"[{LO}, {HI}], d={D}, eps={EPS}, {ITERS} iterations, sum n*m = {elems:.3g}")
    opts = dict(eps=EPS, tol=None, max_iter=ITERS, update="symmetric")
    rows = []
    for prec in PRECISIONS:
        def packed(grad=False, fused=True):
            xx = x.detach().requires_grad_(grad)
            engine = TritonBackend(precision=prec, fused=fused)
            res = flashot.sinkhorn_varlen(xx, y, xo, yo, backend=engine, **opts)
            if grad:
                torch.autograd.grad(res.cost.sum(), xx)
            return res.cost

        def loop(grad=False):
            out = []
            for xi, yi in zip(xs, ys, strict=True):
                xx = xi.detach().requires_grad_(grad)
                res = flashot.sinkhorn(xx, yi, precision=prec, **opts)
                if grad:
                    torch.autograd.grad(res.cost, xx)
                out.append(res.cost.detach())
            return torch.stack(out)

        t0 = time.perf_counter()
        c_packed = packed()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        c_loop = loop()
        err = float(((c_packed - c_loop).abs() / c_loop.abs()).max())
        for grad in (False, True):
            tp = median_ms(lambda: packed(grad))
            te = median_ms(lambda: packed(grad, fused=False))
            tl = median_ms(lambda: loop(grad))
            what = "value+grad" if grad else "value"
            rows.append((prec, what, tp, te, tl))
            print(f"{prec:5s} {what:10s} packed {tp:8.2f} ms (exact passes {te:8.2f})  loop "
                  f"{tl:8.2f} ms  speed-up {tl / tp:5.2f}x  max rel cost diff {err:.1e}  "
                  f"(packed first call {first:.2f} s)", flush=True)
    print("\n| precision | what | packed (ms) | packed, exact passes (ms) | loop (ms) | speed-up |"
          "\n|---|---|---|---|---|---|")
    for prec, what, tp, te, tl in rows:
        print(f"| {prec} | {what} | {tp:.2f} | {te:.2f} | {tl:.2f} | {tl / tp:.2f}× |")


if __name__ == "__main__":
    main()
