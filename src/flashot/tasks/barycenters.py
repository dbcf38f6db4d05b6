r"""Free-support entropic barycenters of weighted point clouds, streamed.

The barycenter of K clouds :math:`\beta_k = \sum_j w^k_j \delta_{y^k_j}` with weights
:math:`\lambda_k` is sought as a cloud :math:`\alpha = \sum_i b_i \delta_{x_i}` of
fixed weights b and moving points x minimizing

.. math::

    \sum_k \lambda_k\, \mathrm{OT}_\varepsilon(\alpha, \beta_k)
    \quad\text{or, with ``debias=True``,}\quad
    \sum_k \lambda_k\, S_\varepsilon(\alpha, \beta_k),

for the cost :math:`|x - y|^2`. With the barycentric maps :math:`T_k(x_i) = \sum_j
P^k_{ij} y^k_j / b_i` of the plans, the gradient in :math:`x_i` is
:math:`2 b_i (x_i - \sum_k \lambda_k T_k(x_i))` (plus :math:`2 b_i (T_\alpha(x_i) - x_i)`
for the debiasing term :math:`-\tfrac12 \mathrm{OT}_\varepsilon(\alpha, \alpha)`, whose
plan moves both arguments), so the fixed-point steps

.. math::

    x \leftarrow \sum_k \lambda_k T_k(x) \qquad
    \big(\text{debiased: } x \leftarrow x + \sum_k \lambda_k T_k(x) - T_\alpha(x)\big)

are gradient steps preconditioned by :math:`1/(2b_i)` (Cuturi & Doucet 2014; POT's
``free_support_sinkhorn_barycenter``; the debiased one after Janati et al. 2020). Every
map is a streamed plan product (:meth:`flashot.TransportPlan.barycentric_map`), each
solve warm-started from the previous step's potentials.

Example::

    import torch, flashot
    clouds = [torch.randn(3000, 2) + 3, torch.randn(2000, 2) - 3]
    bar = flashot.free_support_barycenter(clouds, torch.randn(500, 2), eps=1.0,
                                          debias=True)
    bar.points  # (500, 2)

Limits: the squared-Euclidean cost; balanced problems; the points are not
differentiable (the steps run without autograd).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import flashot
from flashot.problem import check_count, check_positive, probability_weights

__all__ = ["BarycenterResult", "free_support_barycenter"]


@dataclass(frozen=True)
class BarycenterResult:
    """A free-support barycenter.

    Attributes:
        points: (k, d) the barycenter's support.
        weights: (k,) its weights b (as given, normalized).
        n_iter: fixed-point steps run.
        converged: the last step moved the points by at most ``tol`` (relative, see
            :func:`free_support_barycenter`).
        displacements: ``Σ_i |x_i^new − x_i|²`` of every step (POT's log).
    """

    points: torch.Tensor
    weights: torch.Tensor
    n_iter: int
    converged: bool
    displacements: list[float] = field(default_factory=list)


def _tensor(name: str, z, like: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(z, torch.Tensor):
        z = torch.as_tensor(z)
    if like is not None:
        z = z.to(device=like.device, dtype=like.dtype)
    elif not z.dtype.is_floating_point:
        z = z.double()
    if not bool(torch.isfinite(z).all()):
        raise ValueError(f"{name} holds non-finite values")
    return z.detach()


def free_support_barycenter(
    clouds: Sequence,
    x_init,
    *,
    eps: float,
    cloud_weights: Sequence | None = None,
    lambdas=None,
    b=None,
    debias: bool = False,
    max_iter: int = 100,
    tol: float = 1e-4,
    inner_tol: float | str | None = "auto",
    inner_max_iter: int = 1000,
    backend="auto",
    precision: str = "auto",
    warn: bool = True,
) -> BarycenterResult:
    r"""The free-support entropic barycenter of K clouds (see the module).

    Args:
        clouds: K arrays (m_k, d), the clouds (their sizes may differ).
        x_init: (k, d) the barycenter's initial support (its size is kept).
        eps: ε of the entropic problems, in units of ``|x − y|²``.
        cloud_weights: K arrays (m_k,) of weights, or None (uniform each).
        lambdas: (K,) the clouds' weights in the barycenter (normalized), None for 1/K.
        b: (k,) the barycenter's weights, None for uniform.
        debias: minimize Sinkhorn divergences instead of OT_ε (no entropic shrinking).
        max_iter: fixed-point steps at most.
        tol: stop when a step moves the points by ``(Σ_i b_i |Δx_i|²)^½ ≤ tol · s``,
            with s the clouds' pooled spread ``(Σ_k λ_k Σ_j w^k_j |y^k_j − ȳ|²)^½``
            (a relative move: float32 solves leave moves of about 1e-6; POT's
            ``stopThr`` is an absolute ``Σ_i |Δx_i|²``, recorded in ``displacements``).
        inner_tol: each Sinkhorn solve's ``tol``.  inner_max_iter: its ``max_iter``.
        backend: as :func:`flashot.sinkhorn`.  precision: as :func:`flashot.sinkhorn`.
        warn: warn (:class:`flashot.ConvergenceWarning`) when ``tol`` or an inner
            solve's tolerance was missed.

    Returns:
        A :class:`BarycenterResult` (not differentiable: the steps run without autograd).
    """
    eps, tol = check_positive(eps, "eps"), check_positive(tol, "tol", allow_zero=True)
    check_count(max_iter, "max_iter")
    if debias not in (True, False):
        raise TypeError(f"debias must be True or False, got {debias!r}")
    x = _tensor("x_init", x_init)
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"x_init must be a non-empty (k, d) array, got shape {tuple(x.shape)}")
    if isinstance(clouds, torch.Tensor) or not isinstance(clouds, Sequence) or not clouds:
        raise TypeError("clouds must be a non-empty list of (m_k, d) arrays")
    ys = [_tensor(f"clouds[{i}]", y, x) for i, y in enumerate(clouds)]
    for i, y in enumerate(ys):
        if y.dim() != 2 or y.shape[0] == 0 or y.shape[1] != x.shape[1]:
            raise ValueError(f"clouds[{i}] must be a non-empty (m, {x.shape[1]}) array like "
                             f"x_init, got shape {tuple(y.shape)}")  # fmt: skip
    if cloud_weights is None:
        cloud_weights = [None] * len(ys)
    if len(cloud_weights) != len(ys):
        raise ValueError(f"cloud_weights must hold one array per cloud ({len(ys)}), got "
                         f"{len(cloud_weights)}")  # fmt: skip
    ws = [probability_weights(f"cloud_weights[{i}]", w, len(y), x)
          for i, (y, w) in enumerate(zip(ys, cloud_weights, strict=True))]  # fmt: skip
    lam = probability_weights("lambdas", lambdas, len(ys), x)
    bw = probability_weights("b", b, x.shape[0], x)
    opts = dict(eps=eps, tol=inner_tol, max_iter=inner_max_iter, backend=backend,
                precision=precision, warn=False)  # fmt: skip
    mean = sum(lam[i] * (ws[i] @ ys[i]) for i in range(len(ys)))
    spread = float(sum(lam[i] * (ws[i] @ (ys[i] - mean).square().sum(1)) for i in range(len(ys))))
    scale = math.sqrt(spread) if spread > 0 else 1.0
    starts: list = [None] * (len(ys) + 1)
    moves: list[float] = []
    relative = math.inf
    missed = 0
    converged = False
    with torch.no_grad():
        for _ in range(max_iter):
            new = torch.zeros_like(x)
            for i, (y, w) in enumerate(zip(ys, ws, strict=True)):
                res = flashot.sinkhorn(x, y, bw, w, init=starts[i], **opts)
                missed += res.converged is False
                starts[i] = (res.f, res.g)
                new += lam[i] * res.plan.barycentric_map()
            if debias:  # (a measure against itself: flashot's symmetric updates)
                res = flashot.sinkhorn(x, x, bw, bw, init=starts[-1], **opts)
                missed += res.converged is False
                starts[-1] = (res.f, res.g)
                new += x - res.plan.barycentric_map()
            step = (new - x).square().sum(1)
            moves.append(float(step.sum()))
            relative = math.sqrt(float(bw @ step)) / scale
            x = new
            if not math.isfinite(relative):
                raise FloatingPointError(f"free_support_barycenter: the points became "
                                         f"non-finite (eps={eps:g} too small?)")  # fmt: skip
            if relative <= tol:
                converged = True
                break
    if warn and not converged:
        warnings.warn(f"free_support_barycenter: the last step moved the points by "
                      f"{relative:.3g} of the clouds' spread, above tol={tol:g}, after "
                      f"max_iter={max_iter} steps", flashot.ConvergenceWarning,
                      stacklevel=2)  # fmt: skip
    if warn and missed:
        warnings.warn(f"free_support_barycenter: {missed} Sinkhorn solves missed "
                      f"inner_tol={inner_tol!r} within inner_max_iter={inner_max_iter}",
                      flashot.ConvergenceWarning, stacklevel=2)  # fmt: skip
    return BarycenterResult(x, bw, len(moves), converged, moves)
