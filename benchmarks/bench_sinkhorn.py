"""FlashSinkhorn targets (issue 3): flashot vs flash-sinkhorn 0.4.1 on one GPU, same process.

Workload (the peer's own benchmark): x, y ~ N(0, I), random weights, ε = 0.1,
10 fixed symmetric iterations, float32 inputs, squared Euclidean cost. flashot is
timed through its public API (``flashot.sinkhorn(..., max_iter=10, tol=None)``,
which also runs its final extrapolation; repeated calls replay a CUDA graph at
launch-bound sizes); the peer through
``flash_sinkhorn.SamplesLoss`` as its benchmark does (TF32).

    python benchmarks/bench_sinkhorn.py --out benchmarks/results

Without a GPU, ``TRITON_INTERPRET=1 python benchmarks/bench_sinkhorn.py --accuracy-only
--accuracy-n 256`` (4 minutes on 2 cores) measures the precision table with the kernels
under Triton's interpreter (CPU): faithful for "fp32" (IEEE there), "bf16" and "fp16"
(operands are rounded before the kernels); "tf32" is skipped (the interpreter computes
IEEE dots).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _harness as H

import flashot
from flashot.backends import triton_interpreted
from flashot.backends.triton import TritonBackend

EPS, ITERS = 0.1, 10
CASES = {  # name: (kind, n, d)
    "fwd_10k_d64": ("fwd", 10_000, 64),
    "fwd_50k_d64": ("fwd", 50_000, 64),
    "fwd_10k_d512": ("fwd", 10_000, 512),
    "fwd_50k_d512": ("fwd", 50_000, 512),
    "grad_10k_d64": ("grad", 10_000, 64),
    "grad_50k_d64": ("grad", 50_000, 64),
    "grad_10k_d512": ("grad", 10_000, 512),
    "fwd_1M_d64": ("fwd", 1_000_000, 64),
}


def data(n: int, d: int, seed: int = 0, device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, device=device, generator=g)
    y = torch.randn(n, d, device=device, generator=g)
    a = torch.rand(n, device=device, generator=g) + 0.1
    b = torch.rand(n, device=device, generator=g) + 0.1
    return x, y, a / a.sum(), b / b.sum()


def flashot_fn(kind, x, y, a, b, backend):
    def run():
        if kind == "fwd":
            with torch.no_grad():
                return flashot.sinkhorn(
                    x, y, a, b, eps=EPS, max_iter=ITERS, tol=None, backend=backend
                ).cost
        xg = x.detach().requires_grad_()
        cost = flashot.sinkhorn(
            xg, y, a, b, eps=EPS, max_iter=ITERS, tol=None, backend=backend
        ).cost
        return torch.autograd.grad(cost, xg)[0]

    return run


def peer_fn(kind, x, y, a, b):
    from flash_sinkhorn import SamplesLoss

    loss = SamplesLoss(
        "sinkhorn",
        backend="symmetric",
        use_epsilon_scaling=False,
        eps=EPS,
        n_iters=ITERS,
        debias=False,
        potentials=False,
        normalize=False,
        autotune=True,
        last_extrapolation=False,
        allow_tf32=True,
    )

    def run():
        if kind == "fwd":
            with torch.no_grad():
                return loss(a, x, b, y)
        xg = x.detach().requires_grad_()
        return torch.autograd.grad(loss(a, xg, b, y), xg)[0]

    return run


def methods(skip_peer: bool, variants: bool):
    out = {
        "flashot_tf32": TritonBackend("tf32"),
        "flashot_bf16": TritonBackend("bf16"),
        "flashot_fp32": TritonBackend("fp32"),
        # the default before v16: score operands split per tile by 3xTF32
        "flashot_fp32x3": TritonBackend("fp32", presplit=False),
    }
    if variants:
        out["flashot_tf32_twopass"] = TritonBackend("tf32", fused=False)
        out["flashot_tf32_nograph"] = TritonBackend("tf32", graphs=False)
    if not skip_peer:
        out["peer_tf32"] = "peer"
    return out


def accuracy(n: int = 8192, d: int = 64, device: str = "cuda") -> list[dict]:
    """Error of each mode's 10-iteration solve against the float64 torch backend."""
    x, y, a, b = data(n, d, seed=1, device=device)
    ref = flashot.sinkhorn(
        x.double(),
        y.double(),
        a.double(),
        b.double(),
        eps=EPS,
        max_iter=ITERS,
        tol=None,
        backend="torch",
    )
    rows = []
    # the interpreter computes IEEE dots: a "tf32" row there would measure nothing
    modes = ("fp32", "bf16", "fp16") if triton_interpreted() else ("fp32", "tf32", "bf16", "fp16")
    for mode in (*modes, "fp32x3"):
        be = TritonBackend("fp32", presplit=False) if mode == "fp32x3" else TritonBackend(mode)
        name = f"flashot_{mode}"
        res = flashot.sinkhorn(x, y, a, b, eps=EPS, max_iter=ITERS, tol=None, backend=be)
        rows.append(
            dict(
                mode=name,
                n=n,
                d=d,
                cost_rel_err=abs(res.cost.item() - ref.cost.item()) / abs(ref.cost.item()),
                f_rel_err=float((res.f.double() - ref.f).norm() / ref.f.norm()),
                marginal_error=res.marginal_error,
            )
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time diagnostic variants")
    ap.add_argument("--methods", nargs="*", default=None, help="subset of the methods")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the precision table")
    ap.add_argument("--name", default="sinkhorn_h200", help="file name of the results")
    ap.add_argument("--accuracy-only", action="store_true", help="only the precision table")
    ap.add_argument("--accuracy-n", type=int, default=8192, help="points per cloud there")
    ap.add_argument("--probe", type=int, default=1, help="0: no probe at the second step (A/B)")
    args = ap.parse_args()
    if not args.probe:
        from flashot.backends import triton as triton_backend

        triton_backend.PROBE_FROM = 2**62
    rows = []
    for case in [] if args.accuracy_only else args.cases:
        kind, n, d = CASES[case]
        x, y, a, b = data(n, d)
        inputs_mb = (x.numel() + y.numel() + a.numel() + b.numel()) * 4 / 1e6
        for name, be in methods(args.skip_peer or n > 100_000, args.variants).items():
            if args.methods and name not in args.methods:
                continue
            fn = peer_fn(kind, x, y, a, b) if be == "peer" else flashot_fn(kind, x, y, a, b, be)
            if be != "peer" and n > 2**16:  # tune the capped size bucket at 2^16 points, where
                small = data(2**16, d, seed=2)  # tuning takes seconds, not minutes
                flashot_fn(kind, *small, be)()
                del small
            try:
                first = H.first_call_s(fn)
                ms = H.median_ms(fn, long=n > 100_000)
                mem = H.peak_extra_mb(fn) if kind == "fwd" else float("nan")
            except Exception as err:  # report, keep going: one table for all
                print(f"{case} {name}: {type(err).__name__}: {err}", flush=True)
                continue
            mode = "bf16" if "bf16" in name else "fp32" if "fp32" in name else "tf32"
            floor = H.sinkhorn_floor_ms(n, n, d, ITERS, mode)["floor_ms"]
            rows.append(
                dict(
                    case=case,
                    method=name,
                    ms=ms,
                    floor_ms=floor,
                    x_floor=ms / floor,
                    first_call_s=first,
                    extra_mem_mb=mem,
                    inputs_mb=inputs_mb,
                )
            )
            print(rows[-1], flush=True)
            H.write(rows, args.out, args.name)  # keep what a time limit cuts
        del x, y, a, b
        torch.cuda.empty_cache()
    if rows:
        H.write(rows, args.out, args.name)
    gpu = torch.cuda.is_available()
    acc = [] if args.no_accuracy else accuracy(args.accuracy_n, device="cuda" if gpu else "cpu")
    if acc:
        H.write(acc, args.out, "precision_h200" if gpu else "precision_interpreter")
    if rows:
        print("\n| case | method | ms | floor ms | x floor | first call s | extra MB |")
    for r in rows:
        print(
            f"| {r['case']} | {r['method']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | "
            f"{r['x_floor']:.1f} | {r['first_call_s']:.1f} | {r['extra_mem_mb']:.1f} |"
        )
    for r in acc:
        print(r)


if __name__ == "__main__":
    main()
