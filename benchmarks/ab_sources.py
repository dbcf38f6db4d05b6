"""A/B of source trees: one call, timed in the process of the tree that PYTHONPATH picks.

Each call's time from the first (warm-up, graph capture) and do_bench medians with 50
and 300 ms windows. ``CALL=sinkhorn`` (default): the bench's 10k d64 forward + gradient.
``CALL=geomloss``: ``SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True)``, value and
gradient, uniform data in the unit cube (``N``, ``D``: 10 000, 3), on fixed data and on
data moved by fresh 1e-3 noise every call (a training loop: the ε schedule moves).

    mkdir -p .ab/head && git archive HEAD src | tar -x -C .ab/head
    for v in .ab/head/src src; do PYTHONPATH=$PWD/$v python benchmarks/ab_sources.py; done
"""

import os
import time

import torch
from triton.testing import do_bench

import flashot

CALL = os.environ.get("CALL", "sinkhorn")
N = int(os.environ.get("N", "10000"))
D = int(os.environ.get("D", "64" if CALL == "sinkhorn" else "3"))
gen = torch.Generator(device="cuda").manual_seed(0)
if CALL == "sinkhorn":
    x, y = (torch.randn(N, D, device="cuda", generator=gen) for _ in range(2))
    a, b = (torch.rand(N, device="cuda", generator=gen) + 0.1 for _ in range(2))
    a, b = a / a.sum(), b / b.sum()
    options = dict(eps=0.1, tol=None, max_iter=10, update="symmetric")

    def gradient():
        xs = x.detach().requires_grad_()
        return torch.autograd.grad(flashot.sinkhorn(xs, y, a, b, **options).cost, xs)

    def forward():
        return flashot.sinkhorn(x, y, a, b, **options).cost

    calls = (("gradient", gradient), ("forward", forward), ("gradient", gradient))
else:
    x, y = (torch.rand(N, D, device="cuda", generator=gen) for _ in range(2))
    loss = flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True)

    def fixed(points=None):
        xs = (x if points is None else points).detach().requires_grad_()
        return torch.autograd.grad(loss(xs, y), xs)

    def moving():
        return fixed(x + 1e-3 * torch.randn_like(x))

    calls = (("geomloss", fixed), ("geomloss moving", moving), ("geomloss", fixed))

tree = flashot.__file__.rsplit("/src/", 1)[0]
for name, fn in calls:
    times = []
    for _ in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    short, long = do_bench(fn, warmup=5, rep=50), do_bench(fn, warmup=25, rep=300)
    calls_ms = " ".join(f"{t:.2f}" for t in times)
    print(f"{tree} {name} n={N} d={D}: calls 1-8 {calls_ms} ms | do_bench 50 ms {short:.3f}, "
          f"300 ms {long:.3f}", flush=True)  # fmt: skip
