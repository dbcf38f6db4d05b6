"""Per-pass times of the Triton primitives against their floors (diagnostics).

python benchmarks/bench_passes.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _harness as H

from flashot.backends.triton import TritonBackend
from flashot.geometry.costs import attention_form, get_cost
from flashot.solver.loop import solve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="*", type=int, default=[256, 10_000, 50_000])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--modes", nargs="*", default=["tf32", "bf16", "fp32"])
    ap.add_argument("--ops", nargs="*", default=None, help="subset of the ops to time")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--block-d", type=int, default=None, help="feature chunk for d > 128")
    ap.add_argument("--name", default="passes_h200", help="file name of the results")
    ap.add_argument(
        "--balance",
        nargs="*",
        type=int,
        default=[1],
        help="split counts to time: 0 the first guess, 1 balanced waves (the default)",
    )
    args = ap.parse_args()
    from flashot.backends.triton import _launch as backend
    from flashot.backends.triton import _configs

    resident = _configs.resident_programs
    if args.block_d:  # diagnostic: another feature chunk (run each in its own process)
        default = _configs.block_d
        _configs.block_d = lambda d, itemsize=4: (
            (args.block_d, -(-d // args.block_d)) if d > 128 else default(d)
        )
    rows, eps = [], 0.1
    for n in args.sizes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, args.d, device="cuda", generator=g)
        y = torch.randn(n, args.d, device="cuda", generator=g)
        la = torch.full((n,), -float(torch.log(torch.tensor(float(n)))), device="cuda")
        for mode in args.modes:
            be = TritonBackend(mode)
            form = attention_form(get_cost("sqeuclidean"), x, y, rounding=be.rounding)
            # near-converged potentials, so that the fast path is valid
            out = solve(
                form, la, la, [eps], lambda e: (1.0, 1.0), (None, None), be, max_iter=30, tol=None
            )
            f, gg = out.f, out.g
            state = be.fast_state(x.device)
            state.slots.zero_()  # gate open: the fused pass runs
            h = gg - form.beta + eps * la
            v = torch.randn(n, args.d, device="cuda")
            cases = {
                "attend_lse": lambda: be.row_attend(form, h, eps),
                "attend_v64": lambda: be.row_attend(form, h, eps, v),
                "plan_sums": lambda: be.plan_sums(form, f, gg, la, la, eps),
                "step_exact": lambda: be.jacobi_step(
                    form, f, gg, la, la, eps, (1, 1), (None, None)
                ),
                "step_fused": lambda: be.jacobi_step(
                    form, f, gg, la, la, eps, (1, 1), (None, None), state=state
                ),
            }
            fl = H.sinkhorn_floor_ms(n, n, args.d, 1, mode)
            for balance in args.balance:
                # unbalanced: the occupancy is unknown, so launches keep the first guess
                _configs.resident_programs = resident if balance else lambda *a: None
                backend._RESIDENT.clear()
                for name, fn in cases.items():
                    if args.ops and name not in args.ops:
                        continue
                    fn()
                    ms = H.median_ms(fn)
                    floor = fl["floor_ms"] * (2 if name == "step_exact" else 1)
                    rows.append(
                        dict(n=n, d=args.d, block_d=args.block_d or 0, balance=balance,
                             mode=mode, op=name, ms=ms, floor_ms=floor,
                             x_floor=ms / floor, Gelem_per_s=n * n / ms / 1e6)
                    )  # fmt: skip
                    print(rows[-1], flush=True)
                    H.write(rows, args.out, args.name)  # keep what a time limit cuts
            r, c = be.plan_sums(form, f, gg, la, la, eps)
            lo, hi = be.valid_range(n)
            ok = float(((r > lo) & (r < hi)).float().mean() + ((c > lo) & (c < hi)).float().mean())
            print(f"fused sums in range: {ok / 2:.1%}", flush=True)
    H.write(rows, args.out, args.name)
    from flashot.backends.triton._launch import _BEST

    for key, cfg in _BEST.items():  # the tuned tiles and how many programs an SM holds
        resident = backend._RESIDENT.get((key, str(cfg)))
        print("tiles", key, cfg.kwargs, f"warps={cfg.num_warps} stages={cfg.num_stages}",
              f"resident={resident}")  # fmt: skip
    print("\n| n | mode | balance | op | ms | floor | x floor |")
    for r in rows:
        cells = (r["n"], r["mode"], r["balance"], r["op"], f"{r['ms']:.4f}",
                 f"{r['floor_ms']:.4f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + f" | {r['x_floor']:.1f} |")


if __name__ == "__main__":
    main()
