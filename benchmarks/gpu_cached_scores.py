"""Cached scores (``TritonBackend(scores="cache")``) against streamed (issue 50).

The default precision, the suite's forward workload (ε = 0.1, 10 symmetric iterations,
weighted randn clouds) and its gradient, streamed / cached / streamed again; the cost's
error against a float64 torch-backend solve (n ≤ REF_MAX), the cached cost's and
gradient's difference from the streamed ones, the forward's peak above the inputs; at
d ≥ 256 the peer and OTT-JAX dense (PEERS) in the same process. CASES="NxD,...".

    CASES=10000x512,50000x512,50000x64 python benchmarks/gpu_cached_scores.py
"""

import os
import time
import warnings

import torch
from triton.testing import do_bench

import flashot
from flashot.backends.triton import TritonBackend
from flashot.bench.providers import make_problem, providers

warnings.simplefilter("ignore")
DEV = torch.device("cuda")
CASES = [tuple(int(v) for v in case.split("x")) for case in
         os.environ.get("CASES", "10000x512,50000x512,50000x64,10000x64").split(",")]  # fmt: skip
PEERS = [p for p in os.environ.get("PEERS", "flash-sinkhorn,ott-dense").split(",") if p]
REF_MAX = int(os.environ.get("REF_MAX", "10000"))
rows: list[tuple] = []


def median_ms(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=1, rep=300, return_mode="median")


def rel(a, b):
    return float((a - b).norm() / b.norm())


def flashot_rows(pb, n, d, ref):
    kw = dict(eps=pb.eps, tol=None, max_iter=pb.iters, update="symmetric")
    costs, grads = {}, {}
    for name in ("stream", "cache", "stream"):
        backend = TritonBackend(scores=name)

        def forward():
            return flashot.sinkhorn(pb.x, pb.y, pb.a, pb.b, backend=backend, **kw).cost

        def with_grad():
            xs = pb.x.detach().requires_grad_()
            cost = flashot.sinkhorn(xs, pb.y, pb.a, pb.b, backend=backend, **kw).cost
            return cost.detach(), torch.autograd.grad(cost, xs)[0]

        t0 = time.time()
        costs[name] = forward()
        torch.cuda.synchronize()
        first = time.time() - t0
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_ms = median_ms(forward)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        grads[name] = with_grad()[1]
        err = abs(float(costs[name]) - ref) / abs(ref)
        rows.append((n, d, f"flashot {name}", fwd_ms, median_ms(with_grad), err, peak, first))
        print(rows[-1], flush=True)
    print(f"  cache vs stream: cost {rel(costs['cache'], costs['stream']):.2e}, gradient "
          f"{rel(grads['cache'], grads['stream']):.2e}", flush=True)  # fmt: skip


for n, d in CASES:
    pb = make_problem(n, n, d, DEV)
    ref = float("nan")
    if n <= REF_MAX:
        ref = float(flashot.sinkhorn(pb.x.double(), pb.y.double(), pb.a.double(), pb.b.double(),
                                     eps=pb.eps, tol=None, max_iter=pb.iters, update="symmetric",
                                     backend="torch").cost)  # fmt: skip
    flashot_rows(pb, n, d, ref)
    for peer in providers(DEV, PEERS) if d >= 256 else ():
        if peer.unavailable(DEV):
            print(peer.name, "unavailable:", peer.unavailable(DEV), flush=True)
            continue
        forward, gradient = peer.prepare("forward", pb), peer.prepare("gradient", pb)
        err = abs(float(forward()) - ref) / abs(ref)
        rows.append((n, d, peer.name, median_ms(forward), median_ms(gradient), err))
        print(rows[-1], flush=True)
    del pb
    torch.cuda.empty_cache()
print("n, d, who, forward ms, forward + gradient ms, cost error vs float64, peak MiB, first s")
for row in rows:
    print(row)
