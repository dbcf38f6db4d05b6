"""The bench's 10k d64 forward + gradient call in the flashot PYTHONPATH picks (A/B of trees).

Each call's time from the first (warm-up, graph capture) and do_bench medians with the
harness's old 50 ms window and a 300 ms one, to compare two source trees:

    mkdir -p .ab/v28 && git archive 4359992 src | tar -x -C .ab/v28
    for v in .ab/v28/src src; do PYTHONPATH=$PWD/$v python benchmarks/ab_sources.py; done
"""

import time

import torch
from triton.testing import do_bench

import flashot

N, D = 10_000, 64
gen = torch.Generator(device="cuda").manual_seed(0)
x, y = (torch.randn(N, D, device="cuda", generator=gen) for _ in range(2))
a, b = (torch.rand(N, device="cuda", generator=gen) + 0.1 for _ in range(2))
a, b = a / a.sum(), b / b.sum()
options = dict(eps=0.1, tol=None, max_iter=10, update="symmetric")


def gradient():
    xs = x.detach().requires_grad_()
    return torch.autograd.grad(flashot.sinkhorn(xs, y, a, b, **options).cost, xs)


def forward():
    return flashot.sinkhorn(x, y, a, b, **options).cost


tree = flashot.__file__.rsplit("/src/", 1)[0]
for name, fn in (("gradient", gradient), ("forward", forward), ("gradient", gradient)):
    times = []
    for _ in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    short, long = do_bench(fn, warmup=5, rep=50), do_bench(fn, warmup=25, rep=300)
    calls = " ".join(f"{t:.2f}" for t in times)
    print(f"{tree} {name}: calls 1-8 {calls} ms | do_bench 50 ms {short:.3f}, 300 ms {long:.3f}",
          flush=True)  # fmt: skip
