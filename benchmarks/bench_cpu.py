"""CPU acceptance numbers of issue 2 (torch backend), same machine, same run.

1. n = m = 5 000, d = 3: flashot.SamplesLoss vs geomloss.SamplesLoss(backend="tensorized"),
   same settings (blur 0.05, scaling 0.5: the same ε schedule and iteration count).
2. n = m = 100 000, d = 3: a 5-iteration solve (a dense float32 matrix would be 40 GB);
   peak resident memory of the process (run it alone, ``--only-large``, so that
   GeomLoss' dense matrices of part 1 do not count).
3. ``--contention``: the debiased call of part 1 (value and gradient) with one and with
   two threads, on an idle machine and with a busy loop on another core (issue 14, item
   4: small shared VMs).

    python benchmarks/bench_cpu.py --skip-large && python benchmarks/bench_cpu.py --only-large
    python benchmarks/bench_cpu.py --contention
"""

from __future__ import annotations

import argparse
import platform
import resource
import subprocess
import sys
import time

import torch

import flashot


def best_of(fn, reps=3):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def contention():
    """Seconds of the debiased value+gradient call at n = 5 000: threads × (idle, busy)."""
    torch.manual_seed(0)
    x, y = torch.rand(5000, 3, requires_grad=True), torch.rand(5000, 3)
    loss = flashot.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, debias=True,
                               backend="torch")  # fmt: skip

    def call():
        torch.autograd.grad(loss(x, y), x)

    before = torch.get_num_threads()
    for busy in (False, True):
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                t = best_of(call)
                where = "busy loop on another core" if busy else "idle machine"
                print(f"contention: n=5000 debiased value+grad, {threads} thread(s), {where}: "
                      f"{t:.2f} s")  # fmt: skip
        finally:
            torch.set_num_threads(before)
            if spin is not None:
                spin.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--only-large", action="store_true", help="peak RSS of the large solve alone")
    ap.add_argument("--contention", action="store_true", help="1 and 2 threads, idle and busy")
    args = ap.parse_args()
    if args.contention:
        return contention()
    cpu = platform.processor() or "cpu"
    print(f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    torch.manual_seed(0)
    x, y = torch.randn(5000, 3), torch.randn(5000, 3) + 0.5
    import geomloss

    for debias in () if args.only_large else (False, True):
        ref = geomloss.SamplesLoss(
            "sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias, backend="tensorized"
        )
        ours = flashot.SamplesLoss(
            "sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias, backend="torch"
        )
        t_ref, t_ours = best_of(lambda: ref(x, y)), best_of(lambda: ours(x, y))
        print(
            f"n=5000 d=3 debias={debias}: geomloss tensorized {t_ref:.2f} s, flashot torch "
            f"{t_ours:.2f} s ({t_ref / t_ours:.1f}x), values {ref(x, y).item():.6f} / "
            f"{ours(x, y).item():.6f}"
        )
    if not args.skip_large:
        n = 100_000
        x, y = torch.randn(n, 3), torch.randn(n, 3) + 0.5
        t0 = time.perf_counter()
        res = flashot.sinkhorn(x, y, eps=0.1, max_iter=5, tol=None, backend="torch")
        dt = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"n=m=100000 d=3, 5 iterations: {dt:.0f} s, cost {res.cost.item():.6f}, "
            f"peak RSS {rss:.0f} MB (a dense float32 matrix: 40000 MB)"
        )


if __name__ == "__main__":
    main()
