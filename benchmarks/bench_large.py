"""One large solve, timed alone: n = m = 1 000 000, d = 64, ε = 0.1, 10 iterations.

Tiles come from the capped autotuning bucket (tuned once at 65k points, where tuning
takes seconds); each phase prints as it ends, so a time limit keeps what finished.

    python benchmarks/bench_large.py --n 1000000 --precision tf32
"""

from __future__ import annotations

import argparse
import time

import torch

import flashot
from flashot.backends.triton import TritonBackend


def timed(label: str, fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    print(f"{label}: {s:.3f} s", flush=True)
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    be = TritonBackend(args.precision)
    g = torch.Generator(device="cuda").manual_seed(0)

    def solve(n):
        x = torch.randn(n, args.d, device="cuda", generator=g)
        y = torch.randn(n, args.d, device="cuda", generator=g)

        @torch.no_grad()
        def call():
            return flashot.sinkhorn(x, y, eps=0.1, max_iter=10, tol=None, backend=be)

        return call

    timed("tune at 65536 (first call)", solve(65_536))
    big = solve(args.n)
    label = f"n={args.n} d={args.d} {args.precision} call"
    times = [timed(f"{label} {i}", big) for i in range(args.repeats)]
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = big()
    extra = (torch.cuda.max_memory_allocated() - base) / 1e6
    print(f"RESULT n={args.n} d={args.d} {args.precision}: best {min(times):.3f} s, "
          f"extra memory {extra:.1f} MB, cost {res.cost.item():.6f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
