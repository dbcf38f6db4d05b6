"""Point-cloud registration: fit an affine map with Newton-CG on a Sinkhorn divergence.
====================================================================================

A cloud X is registered onto Y = X A* + t* (the points unpaired) by minimizing
S_ε(X A + t, Y) over (A, t): Newton-CG (exact Hessian-vector products through double
backward) against Adam at a tuned step size with many more steps. Prints both losses
and the recovered map's error, and writes a figure of the clouds and loss curves.

    python examples/registration.py --n 200 --out registration.png
"""

import argparse

import torch

import flashot
from flashot.numerics.optim import NewtonCG


def problem(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=gen, dtype=torch.float64) * 3 * torch.pi
    X = torch.stack([t * torch.cos(t), t * torch.sin(t)], 1) / 5  # a spiral
    X = X + 0.05 * torch.randn(n, 2, generator=gen, dtype=torch.float64)
    A_true = torch.tensor([[1.2, 0.5], [-0.3, 0.9]], dtype=torch.float64)
    t_true = torch.tensor([0.4, -0.6], dtype=torch.float64)
    return X, X @ A_true + t_true, (A_true, t_true)


def fit(X, Y, method: str, steps: int, eps: float, lr: float = 0.05):
    """(A, t, losses) after ``steps`` steps of ``method`` ("newton" or "adam")."""
    A = torch.eye(2, dtype=X.dtype, requires_grad=True)
    t = torch.zeros(2, dtype=X.dtype, requires_grad=True)

    def closure():
        return flashot.sinkhorn_divergence(X @ A + t, Y, eps=eps, tol=1e-9, max_iter=5000)

    opt = NewtonCG([A, t]) if method == "newton" else torch.optim.Adam([A, t], lr=lr)
    losses = []
    for _ in range(steps):
        if method == "newton":
            opt.step(closure)
        else:
            opt.zero_grad()
            closure().backward()
            opt.step()
        with torch.no_grad():
            losses.append(float(closure()))
    return A.detach(), t.detach(), losses


def main(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--n", type=int, default=200, help="points in the cloud")
    p.add_argument("--eps", type=float, default=0.5)
    p.add_argument("--newton-steps", type=int, default=10)
    p.add_argument("--adam-steps", type=int, default=100)
    p.add_argument("--out", default="registration.png", help="the figure ('' for none)")
    args = p.parse_args(argv)
    X, Y, (A_true, t_true) = problem(args.n)
    results = {}
    for method, steps in (("newton", args.newton_steps), ("adam", args.adam_steps)):
        A, t, losses = fit(X, Y, method, steps, args.eps)
        err = float((A - A_true).norm() + (t - t_true).norm())
        results[method] = (A, t, losses)
        print(f"{method:6s} {steps:4d} steps: loss {losses[-1]:.3e}, map error {err:.2e}")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4.5))
        A, t, _ = results["newton"]
        ax0.scatter(*X.T, s=4, label="X")
        ax0.scatter(*Y.T, s=30, facecolors="none", edgecolors="C1", label="Y = X A* + t*")
        ax0.scatter(*(X @ A + t).T, s=4, c="C2", label="X A + t (Newton-CG)")
        ax0.legend(markerscale=3)
        ax0.set_aspect("equal")
        for method, (_, _, losses) in results.items():
            ax1.semilogy(range(1, len(losses) + 1), [max(v, 1e-16) for v in losses], label=method)
        ax1.set_xlabel("step")
        ax1.set_ylabel("S_eps(X A + t, Y)")
        ax1.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
