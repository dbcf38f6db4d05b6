"""Where one call's time goes: GPU kernel time vs wall time, per kernel (diagnostics).

python benchmarks/profile_call.py --n 10000 --d 64 --precision tf32
python benchmarks/profile_call.py --call samples_loss   # GeomLoss-style: blur 0.3, scaling 0.9
python benchmarks/profile_call.py --call hvp --cg-tol 1e-3   # loss, gradient, HVP (double backward)
python benchmarks/profile_call.py --call geomloss --d 3 --precision fp32 [--packed]
    # gpu_typical's call (blur 0.05, scaling 0.5, debiased, unit cube, value and gradient);
    # --packed: on a batch of one (its three problems in one packed solve)
python benchmarks/profile_call.py --call bench --workload converge --d 64 --precision auto
    # exactly the call `flashot bench` times for flashot-triton (its problem, ε and options)
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import flashot
from flashot.backends.triton import TritonBackend


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--grad", action="store_true", help="forward and gradient w.r.t. x")
    ap.add_argument("--timeline", action="store_true", help="also every flashot kernel in order")
    ap.add_argument("--host", action="store_true", help="also a Python profile of the host side")
    ap.add_argument("--call", default="sinkhorn",
                    choices=("sinkhorn", "samples_loss", "hvp", "geomloss", "bench"))  # fmt: skip
    ap.add_argument("--packed", action="store_true", help="--call geomloss on a batch of one")
    ap.add_argument("--workload", default="gradient",
                    help="--call bench: its workload (forward, gradient, converge, hvp, plan)")
    ap.add_argument("--trace", type=int, default=0,
                    help="also the wall time of each of the first N calls (warm-up pattern)")
    ap.add_argument("--cg-tol", type=float, default=None, help="dual CG tolerance (--call hvp)")
    ap.add_argument("--eps", type=float, default=0.1, help="--call sinkhorn's ε")
    ap.add_argument("--update", default=None, help="--call sinkhorn: update")
    ap.add_argument("--probe", type=int, default=1, help="0: no probe at the second step (A/B)")
    ap.add_argument("--presplit", choices=("auto", "0", "1"), default="auto",
                    help="backend presplit (0: 3xTF32 per tile, no triples at d ≤ 5)")  # fmt: skip
    args = ap.parse_args()
    if not args.probe:
        from flashot.backends import triton as triton_backend

        triton_backend.PROBE_FROM = 2**62
    g = torch.Generator(device="cuda").manual_seed(0)
    draw = torch.rand if args.call == "geomloss" else torch.randn
    x = draw(args.n, args.d, device="cuda", generator=g)
    y = draw(args.n, args.d, device="cuda", generator=g)
    presplit = {"auto": None, "0": False, "1": True}[args.presplit]
    be = TritonBackend(args.precision, graphs=bool(args.graphs), presplit=presplit)

    bench_call = None
    if args.call == "bench":  # the suite's problem (N(0, I), random weights) and call
        from flashot.bench.harness import SCALED_EPS
        from flashot.bench.providers import Flashot, make_problem

        eps = args.eps * (args.d if args.workload in SCALED_EPS else 1)
        pb = make_problem(args.n, args.n, args.d, torch.device("cuda"), eps=eps)
        bench_call = Flashot("triton", args.precision).prepare(args.workload, pb)

    kw = dict(eps=args.eps) if args.update is None else dict(eps=args.eps, update=args.update)

    def call():
        if bench_call is not None:
            return bench_call()
        if args.call != "sinkhorn":
            return geomloss_call()
        if args.grad:
            xg = x.detach().requires_grad_()
            cost = flashot.sinkhorn(xg, y, max_iter=10, tol=None, backend=be, **kw).cost
            return torch.autograd.grad(cost, xg)[0]
        with torch.no_grad():
            return flashot.sinkhorn(x, y, max_iter=10, tol=None, backend=be, **kw).cost

    def geomloss_call():
        from flashot.autodiff.second_order import dual_solve_options

        typical = args.call == "geomloss"
        loss_fn = flashot.SamplesLoss(p=2, blur=0.05 if typical else 0.3,
                                      scaling=0.5 if typical else 0.9, debias=typical,
                                      backend=be)  # fmt: skip
        xg = x.detach().requires_grad_(args.call == "hvp" or args.grad or typical)
        with dual_solve_options(cg_tol=args.cg_tol):  # the loss's pieces keep the options
            loss = loss_fn(xg[None], y[None]).sum() if args.packed else loss_fn(xg, y)
            if not xg.requires_grad:
                return loss
            (grad,) = torch.autograd.grad(loss, xg, create_graph=args.call == "hvp")
            if args.call == "hvp":
                return torch.autograd.grad((grad * y).sum(), xg)[0]
        return grad

    for i in range(max(args.trace, 5 if args.call in ("sinkhorn", "bench") else 2)):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        if i < args.trace:
            print(f"  call {i + 1}: {(time.perf_counter() - t0) * 1e3:.3f} ms", flush=True)
    t0 = time.perf_counter()
    reps = 20 if args.call in ("sinkhorn", "bench") else 3
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time / 1e3
    gpu = sum(v[1] for v in per.values())
    print(f"{args.call} n={args.n} d={args.d} {args.precision} graphs={args.graphs} grad={args.grad}: "
          f"wall {wall:.3f} ms/call, "
          f"GPU kernels {gpu:.3f} ms in {sum(v[0] for v in per.values())} launches")  # fmt: skip
    for name, (count, ms) in sorted(per.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"  {ms:8.3f} ms  {count:4d}x  {name[:90]}")
    if args.timeline:  # which launches of a kind are long (full passes) or short (skipped)
        ours = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                and e.name.startswith("_")]  # fmt: skip
        ours.sort(key=lambda e: e.time_range.start)
        print(
            "  " + " ".join(f"{e.name.split('_')[1][:6]}:{e.device_time / 1e3:.3f}" for e in ours)
        )

    from flashot.backends.triton._launch import _BEST

    for key, cfg in _BEST.items():  # the tiles this process tuned
        print("  tiles", key, cfg.kwargs, f"warps={cfg.num_warps} stages={cfg.num_stages}")

    if args.host:  # where the host's time goes (it adds to the GPU's: the call ends in a sync)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("cumulative").print_stats(35)
        stats.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
