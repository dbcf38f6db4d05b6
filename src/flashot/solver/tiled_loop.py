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

from flashot.backends.kernel_sums import softmin, window_step, window_transforms

__all__ = ["DenseSoftMin", "GeomLossPotentials", "damping", "dense_softmin",
           "geomloss_potentials", "symmetric_steps"]  # fmt: skip


@dataclass(frozen=True)
class GeomLossPotentials:
    """The extrapolated potentials.

    ``f_ba`` (n,), ``g_ab`` (m,), and when debiasing ``f_aa`` (n,), ``g_bb`` (m,) (else None).
    """

    f_ba: torch.Tensor
    g_ab: torch.Tensor
    f_aa: torch.Tensor | None
    g_bb: torch.Tensor | None


#: ``soft(side, log_w, pot_rows, pot_cols, eps)``: the damped soft-minimum of one side's
#: rows over its columns with log-weights ``log_w + pot_cols/ε`` (``pot_cols`` None: none;
#: ``pot_rows``: the rows' current potential, for a truncation); sides "xy", "yx", "xx", "yy"
SoftMin = Callable[..., torch.Tensor]


def symmetric_steps(soft: SoftMin, la, lb, temps: list[float], debias: bool, start=None):
    """GeomLoss' averaged symmetric steps over ``temps``, without autograd.

    Args:
        soft: the soft-minimum of each side (:data:`SoftMin`); one with a ``both`` method
            (:class:`DenseSoftMin`) forms a step's two sides together.
        la: (n,) log-weights of x.  lb: (m,) of y.
        temps: the temperatures.  debias: also the self problems.
        start: ``(f_ba, g_ab, f_aa, g_bb)`` to continue from, or None (an initialization
            at ``temps[0]``).

    Returns:
        ``(f_ba, g_ab, f_aa, g_bb)``, the last two None unless debiased.
    """
    both = getattr(soft, "both", None)

    def pair(f, g, eps):  # the xy and yx soft-minima of one step
        if both is not None:
            return both(la, lb, f, g, eps)
        return soft("xy", lb, f, g, eps), soft("yx", la, g, f, eps)

    with torch.no_grad():
        if start is None:  # (no potentials yet: the soft-minima of the weights)
            eps = temps[0]
            f_ba, g_ab = pair(None, None, eps)
            f_aa = soft("xx", la, None, None, eps) if debias else None
            g_bb = soft("yy", lb, None, None, eps) if debias else None
        else:
            f_ba, g_ab, f_aa, g_bb = start
        for eps in temps:
            ft_ba, gt_ab = pair(f_ba, g_ab, eps)
            f_ba, g_ab = 0.5 * (f_ba + ft_ba), 0.5 * (g_ab + gt_ab)
            if f_aa is not None and g_bb is not None:
                ft_aa, gt_bb = soft("xx", la, f_aa, f_aa, eps), soft("yy", lb, g_bb, g_bb, eps)
                f_aa, g_bb = 0.5 * (f_aa + ft_aa), 0.5 * (g_bb + gt_bb)
    return f_ba, g_ab, f_aa, g_bb


def damping(eps: float, rho: float | None) -> float:
    """``λ = 1/(1 + ε/ρ)`` of a KL-relaxed soft-minimum (1 when balanced)."""
    return 1.0 if rho is None else 1.0 / (1.0 + eps / rho)


class DenseSoftMin:
    """The :data:`SoftMin` of two clouds ``{"x": …, "y": …}``: every pair, damped by ρ.

    Where the fused kernels run (:func:`~flashot.backends.kernel_sums.window_step`), a
    step's two sides come from one pass (:meth:`both`) and a self problem's side from
    half of one, each stabilized by the current potentials; elsewhere, exact soft-minima.
    """

    def __init__(self, clouds: dict, cost: Callable, rho: float | None, backend: str):
        self.clouds, self.cost, self.rho, self.backend = clouds, cost, rho, backend

    def __call__(self, side, log_w, pot_rows, pot_cols, eps):
        """The damped soft-minimum of ``side``'s rows (see :data:`SoftMin`)."""
        rows, cols = self.clouds[side[0]], self.clouds[side[1]]
        lam = damping(eps, self.rho)
        if rows is cols and pot_rows is pot_cols:  # (None: stabilized by zeros)
            pot = log_w.new_zeros(log_w.shape) if pot_rows is None else pot_rows
            got = window_step(rows, rows, log_w, log_w, pot, pot, eps, self.cost, self.backend)
            if got is not None:
                return lam * got[0]
        h = log_w if pot_cols is None else log_w + pot_cols / eps
        return lam * softmin(rows, cols, h, eps, self.cost, backend=self.backend)

    def both(self, la, lb, f, g, eps):
        """``(soft("xy", lb, f, g, eps), soft("yx", la, g, f, eps))``."""
        x, y = self.clouds["x"], self.clouds["y"]
        zf = la.new_zeros(la.shape) if f is None else f  # (None: stabilized by zeros)
        zg = lb.new_zeros(lb.shape) if g is None else g
        got = window_step(x, y, la, lb, zf, zg, eps, self.cost, self.backend)
        if got is None:
            return self("xy", lb, f, g, eps), self("yx", la, g, f, eps)
        lam = damping(eps, self.rho)
        return lam * got[0], lam * got[1]


def dense_softmin(clouds: dict, cost: Callable, rho: float | None, backend: str) -> SoftMin:
    """The :data:`SoftMin` of two clouds ``{"x": …, "y": …}``: every pair, damped by ρ."""
    return DenseSoftMin(clouds, cost, rho, backend)


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
    clouds = {"x": x.detach(), "y": y.detach()}
    soft = dense_softmin(clouds, cost, rho, backend)
    f_ba, g_ab, f_aa, g_bb = symmetric_steps(soft, la, lb, temps, debias)
    eps = temps[-1]
    lam = damping(eps, rho)
    xd, yd = clouds["x"], clouds["y"]
    # the final extrapolation, differentiated in the first argument of each cost only
    # (a pair's two sides from one window pass where it runs, a self problem's from half)
    pair = window_transforms(x, y, la, lb, f_ba, g_ab, eps, cost, backend)
    if pair is None:
        pair = (softmin(x, yd, lb + g_ab / eps, eps, cost, backend=backend),
                softmin(y, xd, la + f_ba / eps, eps, cost, backend=backend))  # fmt: skip
    f_new, g_new = lam * pair[0], lam * pair[1]
    if f_aa is not None and g_bb is not None:
        f_aa, g_bb = (lam * _self_transform(z, lw, pot, eps, cost, backend)
                      for z, lw, pot in ((x, la, f_aa), (y, lb, g_bb)))  # fmt: skip
    return GeomLossPotentials(f_new, g_new, f_aa, g_bb)


def _self_transform(z, log_w, pot, eps, cost, backend):
    """``softmin(z, z̄, log_w + pot/ε)``, differentiable in its first argument only."""
    got = window_transforms(z, z, log_w, log_w, pot, pot, eps, cost, backend)
    if got is not None:
        return got[0]
    return softmin(z, z.detach(), log_w + pot / eps, eps, cost, backend=backend)
