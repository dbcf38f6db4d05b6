r"""GeomLoss' fixed-schedule Sinkhorn loop for costs outside the attention form.

:func:`flashot.solver.loop.solve` drives the streaming backends, whose primitives need a
cost with attention structure (``α_i + β_j − ⟨q_i, k_j⟩``). The plain Euclidean
distance ``|x − y|`` (GeomLoss' ``p = 1``) has none: its solves, and those of any
:class:`~flashot.geometry.pair_costs.PairCost`, run this loop: GeomLoss' symmetric
ε-scaling iterations (the same
temperatures, initialization, averaged updates and final extrapolation as its
``sinkhorn_loop``) over the soft-minima of :mod:`flashot.backends.kernel_sums`, in
O((n + m) d) memory: fused Triton kernels for a pair cost with a Triton function on
CUDA, PyTorch tiles otherwise.

The iterations run without autograd; the final extrapolation is differentiated, with
the costs' second arguments detached as GeomLoss does, so that the values of
:func:`~flashot.autodiff.functions.dual_term` at these potentials have the envelope
gradients (balanced: GeomLoss'; relaxed: flashot's convention, see there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashot.backends.kernel_sums import softmin

__all__ = ["GeomLossPotentials", "geomloss_potentials"]


@dataclass(frozen=True)
class GeomLossPotentials:
    """The extrapolated potentials.

    ``f_ba`` (n,), ``g_ab`` (m,), and when debiasing ``f_aa`` (n,), ``g_bb`` (m,) (else None).
    """

    f_ba: torch.Tensor
    g_ab: torch.Tensor
    f_aa: torch.Tensor | None
    g_bb: torch.Tensor | None


def geomloss_potentials(
    a: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    cost: Callable,
    temps: list[float],
    debias: bool,
    rho: float | None = None,
    backend: str = "auto",
) -> GeomLossPotentials:
    r"""Symmetric Sinkhorn steps over ``temps``, then one differentiable extrapolation.

    Args:
        a: (n,) positive weights of x.  x: (n, d) points.
        b: (m,) positive weights of y.  y: (m, d) points.
        cost: ``cost(x_block, y_block)`` → (r, c) cost tile (``|x − y|^p / p``).
        temps: the temperatures, ending at the final ε.
        debias: also solve the self problems (a, a) and (b, b).
        rho: ρ of the KL-relaxed marginals (both sides), or None (balanced): every
            soft-minimum is then damped by ``λ = 1/(1 + ε/ρ)``.
        backend: the soft-minima's engine (:func:`~flashot.backends.kernel_sums.softmin`).
    """
    la, lb = torch.log(a).detach(), torch.log(b).detach()
    xd, yd = x.detach(), y.detach()

    def soft(rows, cols, log_w, eps):
        damping = 1.0 if rho is None else 1.0 / (1.0 + eps / rho)
        return damping * softmin(rows, cols, log_w, eps, cost, backend=backend)

    with torch.no_grad():
        eps = temps[0]
        f_ba, g_ab = soft(xd, yd, lb, eps), soft(yd, xd, la, eps)
        f_aa = soft(xd, xd, la, eps) if debias else None
        g_bb = soft(yd, yd, lb, eps) if debias else None
        for eps in temps:
            ft_ba = soft(xd, yd, lb + g_ab / eps, eps)
            gt_ab = soft(yd, xd, la + f_ba / eps, eps)
            f_ba, g_ab = 0.5 * (f_ba + ft_ba), 0.5 * (g_ab + gt_ab)
            if f_aa is not None and g_bb is not None:
                ft_aa = soft(xd, xd, la + f_aa / eps, eps)
                gt_bb = soft(yd, yd, lb + g_bb / eps, eps)
                f_aa, g_bb = 0.5 * (f_aa + ft_aa), 0.5 * (g_bb + gt_bb)
    eps = temps[-1]
    # the final extrapolation, differentiated in the first argument of each cost only
    f_new = soft(x, yd, lb + g_ab / eps, eps)
    g_new = soft(y, xd, la + f_ba / eps, eps)
    if f_aa is not None and g_bb is not None:
        f_aa = soft(x, xd, la + f_aa / eps, eps)
        g_bb = soft(y, yd, lb + g_bb / eps, eps)
    return GeomLossPotentials(f_new, g_new, f_aa, g_bb)
