"""HVP products on the CPU: the dual system by CG against the direct (dense) solve.

One HessianOperator per row (a solve at the defaults), then the mean of three products;
the error is against a float64 HVP solved to tol 1e-12 with cg_tol 1e-13. Prints a
markdown table (BENCHMARKS.md, "Small problems").

    python benchmarks/cpu_dense_dual.py
"""

import time
import warnings

import torch

import flashot
from flashot.autodiff import dense_dual

CASES = [(500, 0.1), (500, 0.02), (1000, 0.05)]  # (n = m, ε), d = 3


def main():
    warnings.simplefilter("ignore")
    gen = torch.Generator().manual_seed(0)
    direct_up_to = dense_dual.DENSE_UP_TO
    rows = []
    for n, eps in CASES:
        x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
        y = torch.randn(n, 3, generator=gen, dtype=torch.float64) + 0.5
        v = torch.randn(n, 3, generator=gen, dtype=torch.float64)
        dense_dual.DENSE_UP_TO = 0  # (the reference by CG)
        ref = flashot.hvp(x, y, v, eps=eps, cg_tol=1e-13, tol=1e-12, max_iter=100_000)
        for dtype in (torch.float32, torch.float64):
            for mode in ("cg", "direct"):
                dense_dual.DENSE_UP_TO = 0 if mode == "cg" else direct_up_to
                xs, ys, vs = x.to(dtype), y.to(dtype), v.to(dtype)
                op = flashot.HessianOperator(xs, ys, eps=eps)
                op(vs)  # (the direct solve's factor)
                start = time.perf_counter()
                for _ in range(3):
                    out = op(vs)
                ms = (time.perf_counter() - start) / 3 * 1e3
                err = float((out.double() - ref).norm() / ref.norm())
                with flashot.record_dual_solves() as log:
                    op(vs)
                rows.append((n, eps, str(dtype).split(".")[-1], mode, f"{ms:.1f}", f"{err:.1e}",
                             log.last.n_iter))  # fmt: skip
    dense_dual.DENSE_UP_TO = direct_up_to
    print("| n = m | ε | dtype | dual solve | ms per product | rel. error vs float64 | CG "
          "iterations |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
