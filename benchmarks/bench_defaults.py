"""Which default update and tolerance converge (issue 14): iterations and stop causes.

python benchmarks/bench_defaults.py   # CPU, float32, torch backend; table in NOTES.md
"""

import time
import warnings

import torch

import flashot


def main():
    torch.manual_seed(0)
    data = {
        "randn 3": (torch.randn(1000, 3), torch.randn(800, 3) + 1.0),
        "cube 3": (torch.rand(1000, 3), torch.rand(900, 3)),
        "randn 64": (torch.randn(1000, 64), torch.randn(900, 64) + 0.2),
    }
    for name, (x, y) in data.items():
        for eps in (0.5, 0.05, 0.01):
            for schedule in (None, "geomloss"):
                row = [name, eps, schedule]
                for update in ("symmetric", "alternating"):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        t0 = time.time()
                        res = flashot.sinkhorn(x, y, eps=eps, eps_schedule=schedule,
                                               update=update, tol=1e-6, max_iter=5000)  # fmt: skip
                    row.append(f"{update[:3]} {res.n_iter} it, {res.marginal_error:.1e} "
                               f"({res.cause or 'converged'}, {time.time() - t0:.1f} s)")  # fmt: skip
                print(" | ".join(map(str, row)), flush=True)


if __name__ == "__main__":
    main()
