"""Residual ranges ln R, ln C of the first Sinkhorn states (what gates the fused pass).

Dense reference in chunks (no n × m matrix): GeomLoss' initialization, then balanced
averaged steps ``f ← f − ½ε ln R``, ``g ← g − ½ε ln C``. Prints, per state, the range
of ln R and ln C and the gate's bound on the next state (half their joint span).

    python benchmarks/residual_ranges.py --n 20000 --d 64 --eps 0.1 --states 3
"""

from __future__ import annotations

import argparse

import torch


def row_lse(x, y, h, log_w, eps, chunk=2048):
    """``LSE_j ((h_j − |x_i − y_j|²)/ε + log w_j)`` for every row i, a chunk of rows at a time."""
    y2 = (y * y).sum(1)
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk]
        cost = (xs * xs).sum(1)[:, None] + y2[None, :] - 2 * xs @ y.T
        out[s : s + chunk] = torch.logsumexp((h[None, :] - cost) / eps + log_w[None, :], 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--eps", type=float, default=0.1)
    ap.add_argument("--states", type=int, default=3)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.n, args.d, generator=gen, dtype=dtype).to(dev)
    y = torch.randn(args.n, args.d, generator=gen, dtype=dtype).to(dev)
    a = torch.rand(args.n, generator=gen, dtype=dtype).to(dev) + 0.1
    b = torch.rand(args.n, generator=gen, dtype=dtype).to(dev) + 0.1
    la, lb = (a / a.sum()).log(), (b / b.sum()).log()
    eps, zero = args.eps, torch.zeros(args.n, dtype=dtype, device=dev)
    f = -eps * row_lse(x, y, zero, lb, eps)
    g = -eps * row_lse(y, x, zero, la, eps)
    for state in range(args.states):
        ln_r = f / eps + row_lse(x, y, g, lb, eps)
        ln_c = g / eps + row_lse(y, x, f, la, eps)
        both = torch.cat([ln_r, ln_c])
        bound = 0.5 * float(both.max() - both.min())
        print(f"state {state}: ln R {ln_r.min():.1f} … {ln_r.max():.1f}, "
              f"ln C {ln_c.min():.1f} … {ln_c.max():.1f}; next state within ±{bound:.1f}",
              flush=True)  # fmt: skip
        f, g = f - 0.5 * eps * ln_r, g - 0.5 * eps * ln_c


if __name__ == "__main__":
    main()
