r"""Shuffled (permuted) linear regression by entropic optimal transport.

The observations are ``Y = Π X W* + noise`` with ``Π`` an unknown permutation of the
rows: which row of ``Y`` belongs to which row of ``X`` is lost. Only the two point
clouds ``{x_i W}`` and ``{y_j}`` can be compared, so the estimate minimizes

.. math::

    L(W) = \mathrm{OT}_\varepsilon\big(\tfrac1n \textstyle\sum_i \delta_{x_i W},\;
        \tfrac1m \sum_j \delta_{y_j}\big)

(squared Euclidean cost, :func:`flashot.sinkhorn`'s ``.cost``). ``L`` is not convex.
When the law of ``X`` is (nearly) symmetric under a permutation ``P`` of its features,
``W`` and ``P W`` fit (nearly) equally well, the set ``{P W = W}`` is (nearly)
invariant under any coordinate-wise optimizer, and a run that starts on it, e.g.
from ``W = 0``, crawls to the best symmetric fit: a saddle, where Adam stalls. The
hybrid ``method="adam-newton"`` (:class:`flashot.numerics.optim.AdamNewton`) sees the plateau,
finds the negative curvature by Lanczos on streamed Hessian-vector products, steps
off along it and finishes with Newton steps.

Everything here uses the public API only: :func:`flashot.sinkhorn`,
:mod:`flashot.numerics.optim`, :func:`flashot.numerics.linalg.lanczos` and PyTorch's double
backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import flashot
from flashot.numerics.linalg import lanczos
from flashot.numerics.optim import AdamNewton, NewtonCG

__all__ = [
    "METHODS",
    "ShuffledProblem",
    "ShuffledRegression",
    "make_shuffled_regression",
    "shuffled_regression",
    "smallest_hessian_eigenvalue",
]

METHODS = ("adam-newton", "adam", "newton")


@dataclass(frozen=True)
class ShuffledProblem:
    """A generated instance: ``Y[i] = X[perm[i]] @ W + noise_i``.

    Attributes:
        X: (n, p) features.  Y: (n, q) shuffled responses.
        W: (p, q) the true coefficients.  perm: (n,) the hidden permutation.
    """

    X: torch.Tensor
    Y: torch.Tensor
    W: torch.Tensor
    perm: torch.Tensor

    def relative_error(self, W: torch.Tensor) -> float:
        """``‖W − W*‖_F / ‖W*‖_F``."""
        return float((W.detach().to(self.W) - self.W).norm() / self.W.norm())


def make_shuffled_regression(
    n: int = 200,
    p: int = 1,
    q: int = 2,
    *,
    noise: float = 0.1,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> ShuffledProblem:
    """A shuffled regression whose natural start ``W = 0`` is a saddle.

    ``X`` has i.i.d. centered Exp(1) entries: skewed, so the law of ``XW`` tells ``W``
    from ``−W`` (a symmetric law could not), and of mean zero, so at ``W = 0`` (all
    points at the origin, every row's transport target the same mean) the gradient
    ``−2 (Σ_i a_i x_i) ȳᵀ`` vanishes up to rounding. The curvature there is negative
    along the directions in which ``Y`` spreads more than ε allows, so ``W = 0`` is
    a strict saddle between the basins of ``W*`` and of a spurious minimum near
    ``−W*``. ``W*`` has i.i.d. standard normal entries; ``Y = X[perm] W* + noise·N(0, 1)``.

    Args:
        n: rows.  p: features.  q: responses.
        noise: standard deviation of the Gaussian noise added to ``Y``.
        generator: RNG (default: seeded with 0).  dtype: of the tensors.
    """
    if n < 2 or p < 1 or q < 1:
        raise ValueError(f"need n ≥ 2, p ≥ 1 and q ≥ 1, got n={n}, p={p}, q={q}")
    if not noise >= 0:
        raise ValueError(f"noise must be ≥ 0, got {noise}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    X = torch.empty(n, p, dtype=torch.float64).exponential_(1.0, generator=gen)
    X = X - X.mean(0)
    W = torch.randn(p, q, generator=gen, dtype=torch.float64)
    perm = torch.randperm(n, generator=gen)
    Y = X[perm] @ W + noise * torch.randn(n, q, generator=gen, dtype=torch.float64)
    return ShuffledProblem(X.to(dtype), Y.to(dtype), W.to(dtype), perm)


@dataclass
class ShuffledRegression:
    """The estimate of :func:`shuffled_regression`.

    Attributes:
        W: (p, q) the estimate.
        loss: ``L(W)`` at the estimate.
        history: one dict per step: ``loss`` and ``grad_norm`` before it, ``step``
            (``"adam"``, ``"negative_curvature"``, ``"newton"``, ``"gradient"``,
            ``"rejected"``, ``"converged"``), ``lambda_min`` where computed (by the
            hybrid's test or the ``monitor_every`` monitor), ``cg_iters``.
        method: the method run.  converged: ``‖∇L‖ ≤ grad_tol`` at a point with no
            negative curvature below ``−tau`` seen (the hybrid), or ``‖∇L‖ ≤ grad_tol``.
    """

    W: torch.Tensor
    loss: float
    method: str
    converged: bool
    history: list[dict] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"ShuffledRegression(method={self.method!r}, loss={self.loss:.6g}, "
                f"steps={len(self.history)}, converged={self.converged}, "
                f"W shape={tuple(self.W.shape)})")  # fmt: skip


def smallest_hessian_eigenvalue(
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    W: torch.Tensor,
    *,
    max_iter: int = 20,
    generator: torch.Generator | None = None,
) -> float:
    """λ_min of the Hessian of ``loss_fn`` at ``W``, by Lanczos on double-backward HVPs."""
    W = W.detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(loss_fn(W), W, create_graph=True)

    def hvp(v):
        with torch.enable_grad():
            (hv,) = torch.autograd.grad(grad, W, grad_outputs=v.view_as(W), retain_graph=True)
        return hv.reshape(-1).detach()

    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    vals, _ = lanczos(hvp, W.numel(), k=1, max_iter=min(max_iter, W.numel()),
                      generator=gen, dtype=W.dtype, device=W.device)  # fmt: skip
    return float(vals[0])


def _check(X, Y, eps, method, max_steps, W0):
    for name, t in (("X", X), ("Y", Y)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = getattr(t, "shape", None)
            raise ValueError(f"{name} must be a 2-D tensor (rows, features), got "
                             f"{type(t).__name__} of shape {shape}")  # fmt: skip
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if X.dtype != Y.dtype or X.device != Y.device:
        raise ValueError(f"X and Y must share dtype and device, got {X.dtype}/{X.device} "
                         f"and {Y.dtype}/{Y.device}")  # fmt: skip
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
    if W0 is not None and tuple(W0.shape) != (X.shape[1], Y.shape[1]):
        raise ValueError(f"W0 must have shape (p, q) = {(X.shape[1], Y.shape[1])}, "
                         f"got {tuple(W0.shape)}")  # fmt: skip


def shuffled_regression(
    X: torch.Tensor,
    Y: torch.Tensor,
    *,
    eps: float,
    method: str = "adam-newton",
    debias: bool = False,
    W0: torch.Tensor | None = None,
    max_steps: int = 500,
    lr: float = 2e-2,
    grad_tol: float = 1e-5,
    plateau_steps: int = 20,
    plateau_rtol: float = 1e-3,
    tau: float = 1e-6,
    monitor_every: int = 0,
    callback: Callable[[int, torch.Tensor, dict], None] | None = None,
    generator: torch.Generator | None = None,
    **sinkhorn_options,
) -> ShuffledRegression:
    """Estimate ``W`` from shuffled observations by minimizing ``OT_ε(XW, Y)``.

    Args:
        X: (n, p) features.  Y: (m, q) responses, in any row order.
        eps: the entropic temperature ε of the loss (squared-distance units).
        method: ``"adam-newton"`` (Adam, then at a plateau or small gradient the
            smallest Hessian eigenvalue: a negative-curvature step below ``−tau``, else
            Newton-CG), ``"adam"`` (Adam alone) or ``"newton"`` (Newton-CG with a line
            search from the start).
        debias: minimize the Sinkhorn divergence ``S_ε(XW, Y)``
            (:func:`flashot.sinkhorn_divergence`) instead of ``OT_ε``: no entropic bias
            toward a contracted ``XW``, at three solves per evaluation.
        W0: (p, q) start (default zeros).
        max_steps: optimizer steps at most.  lr: Adam's step.
        grad_tol: stop once ``‖∇L‖ ≤ grad_tol`` (the hybrid also when no Newton step
            on a positive-definite Hessian lowers the loss: its accuracy is reached).
        plateau_steps, plateau_rtol: the hybrid examines curvature once the loss fell
            by less than ``plateau_rtol`` (relative) over ``plateau_steps`` Adam steps.
        tau: the negative-curvature threshold.
        monitor_every: every that many steps, also record ``lambda_min`` by Lanczos
            (any method; costs about 20 HVPs each). 0: never.
        callback: ``callback(step, W, entry)`` after each step.
        generator: RNG of the Lanczos start vectors.
        sinkhorn_options: passed to :func:`flashot.sinkhorn` (``backend``, ``tol``,
            ``max_iter``, ``cost``…).

    Returns:
        :class:`ShuffledRegression`.
    """
    _check(X, Y, eps, method, max_steps, W0)
    W = (torch.zeros(X.shape[1], Y.shape[1], dtype=X.dtype, device=X.device) if W0 is None
         else W0.detach().to(X).clone())  # fmt: skip
    W.requires_grad_(True)
    gen = generator if generator is not None else torch.Generator().manual_seed(0)

    warm: list = [None]  # the last solve's potentials: neighbouring steps start there

    def loss_fn(w):
        if debias:
            return flashot.sinkhorn_divergence(X @ w, Y, eps=eps, **sinkhorn_options)
        res = flashot.sinkhorn(X @ w, Y, eps=eps, init=warm[0], **sinkhorn_options)
        warm[0] = (res.f.detach(), res.g.detach())
        return res.cost

    history: list[dict] = []
    if method == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam([W], lr=lr)
    elif method == "newton":
        opt = NewtonCG([W], grad_tol=grad_tol)
    else:
        opt = AdamNewton([W], lr=lr, switch_grad_norm=grad_tol, tau=tau, grad_tol=grad_tol,
                         plateau_steps=plateau_steps, plateau_rtol=plateau_rtol,
                         generator=gen)  # fmt: skip
    converged = False
    for it in range(max_steps):
        if method == "adam":
            with torch.enable_grad():
                loss = loss_fn(W)
                (grad,) = torch.autograd.grad(loss, W)
            entry: dict[str, Any] = dict(loss=float(loss.detach()), step="adam", cg_iters=0,
                                         grad_norm=float(grad.norm()))  # fmt: skip
            if entry["grad_norm"] <= grad_tol:
                entry["step"] = "converged"
            else:
                W.grad = grad
                opt.step()
        else:
            opt.step(lambda: loss_fn(W))
            entry = dict(opt.log[-1])  # type: ignore[attr-defined]
        if monitor_every and it % monitor_every == 0 and "lambda_min" not in entry:
            entry["lambda_min"] = smallest_hessian_eigenvalue(loss_fn, W, generator=gen)
        history.append(entry)
        if callback is not None:
            callback(it, W.detach(), entry)
        if entry["step"] == "converged":
            converged = True
            break
    with torch.no_grad():
        final = float(loss_fn(W))
    return ShuffledRegression(W.detach(), final, method, converged, history)
