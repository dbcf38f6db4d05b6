"""Quickstart: entropic OT between two point clouds, its plan and its map, in a figure.
====================================================================================

Solves OT_ε between two 2-D clouds, prints the cost, the marginal error and the
duality gap, and draws the strongest couplings of the (lazy, never stored) plan
and the barycentric map of each source point.

    python examples/quickstart.py --n 300 --out quickstart.png
"""

import argparse

import torch

import flashot


def clouds(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(n, generator=gen) * 2 * torch.pi
    x = torch.stack([torch.cos(angle), torch.sin(angle)], 1) * 0.6 + 0.05 * torch.randn(
        n, 2, generator=gen
    )  # a ring
    y = torch.randn(n, 2, generator=gen) * torch.tensor([0.15, 0.5]) + torch.tensor([1.5, 0.0])
    return x, y


def main(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--n", type=int, default=300, help="points per cloud")
    p.add_argument("--eps", type=float, default=0.05)
    p.add_argument("--out", default="quickstart.png", help="the figure ('' for none)")
    args = p.parse_args(argv)
    x, y = clouds(args.n)
    res = flashot.sinkhorn(x, y, eps=args.eps, eps_schedule="geomloss")
    print(f"OT_eps = {float(res.cost):.5f}, marginal error {res.marginal_error:.1e}, "
          f"duality gap {float(res.duality_gap):.1e}, {res.n_iter} iterations")  # fmt: skip
    mapped = res.plan.barycentric_map()
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 5))
        # the strongest coupling of each source point: one row of the plan at a time
        rows = res.plan @ torch.eye(len(y))  # (n, m): fine at example sizes only
        j = rows.argmax(1)
        for i in range(len(x)):
            ax.plot(*torch.stack([x[i], y[j[i]]]).T, c="0.8", lw=0.5, zorder=0)
        ax.scatter(*x.T, s=6, label="x (source)")
        ax.scatter(*y.T, s=6, label="y (target)")
        ax.scatter(*mapped.T, s=6, marker="x", label="barycentric map of x")
        ax.set_aspect("equal")
        ax.legend(markerscale=2)
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)
        print(f"wrote {args.out}")
    return res, mapped


if __name__ == "__main__":
    main()
