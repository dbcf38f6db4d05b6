"""Dual-potential helpers shared by the solver, the backends and the results.

With potentials (f, g) the plan is ``P_ij = a_i b_j exp((f_i + g_j − C_ij)/ε)``; in
attention form its rows are softmaxes of the biased scores ``⟨q_i, k_j⟩ + h_j`` with
``h = g − β`` and the weights b kept apart (see ``Backend.row_attend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashot.backends.temperature import device_value

if TYPE_CHECKING:
    from flashot.geometry.costs import AttentionForm

__all__ = [
    "Potentials",
    "log_residual",
    "marginal_error",
    "mass_excess",
    "phi_sum",
    "plan_times",
    "relaxed_weight",
    "row_mass",
]


@dataclass(frozen=True)
class Potentials:
    r"""The dual problem at potentials (f, g): all that the plan needs.

    .. math::

        P_{ij} = a_i b_j \exp\big((f_i + g_j - C_{ij})/\varepsilon\big),
        \qquad C_{ij} = \alpha_i + \beta_j - \langle q_i, k_j\rangle.

    Attributes:
        form: the attention form (q (n, d'), k (m, d'), α (n,), β (m,)), detached.
        f: (n,), g: (m,) potentials.
        log_a: (n,), log_b: (m,) log weights (``-inf`` for zero weights).
        eps: ε (a float, or a :class:`~flashot.backends.temperature.Temperature`).
    """

    form: AttentionForm
    f: torch.Tensor
    g: torch.Tensor
    log_a: torch.Tensor
    log_b: torch.Tensor
    eps: float

    @property
    def T(self) -> Potentials:
        """The transposed problem's (rows and columns swapped)."""
        return Potentials(self.form.T, self.g, self.f, self.log_b, self.log_a, self.eps)

    def parts(self) -> tuple:
        """``(form, f, g, log_a, log_b, eps)``, for code that reads all six."""
        return self.form, self.f, self.g, self.log_a, self.log_b, self.eps


def log_residual(
    pot: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor, eps: float
) -> torch.Tensor:
    """``ln R_i = (f_i − α_i + lse_i)/ε``: the log of a row's plan mass per unit weight.

    ``lse`` is the row LSE of the other potential's bias; 0 at the Sinkhorn fixed point.
    """
    return (pot - offset + lse) / device_value(eps)


def row_mass(
    pot: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor, log_w: torch.Tensor, eps: float
) -> torch.Tensor:
    """Row sums ``r_i = a_i exp((f_i − α_i + lse_i)/ε)`` of the plan.

    ``lse`` is the row LSE of the other potential's bias.
    """
    return torch.exp(log_w + log_residual(pot, lse, offset, eps))


def plan_times(backend, pot: Potentials, v: torch.Tensor) -> torch.Tensor:
    """``P v`` (n, p) for values v (m, p): one streaming ``row_attend`` pass, row-scaled.

    Args:
        backend: the streaming primitives.  pot: the problem at its potentials.
    """
    form = pot.form
    lse, out = backend.row_attend(form, pot.g - form.beta, pot.eps, v, pot.log_b)
    r = row_mass(pot.f, lse, form.alpha, pot.log_a, pot.eps)[:, None]
    if out.requires_grad or r.requires_grad:
        return r * out
    return out.mul_(r)  # the pass's own output: scaled in place, no second (n, p) array


def marginal_error(
    pot: torch.Tensor, mass: torch.Tensor, log_w: torch.Tensor, rho: float | None
) -> torch.Tensor:
    """L1 violation of one marginal condition of the plan ``P = a b e^{(f⊕g−C)/ε}``.

    The target of the row sums ``r`` is ``a`` when balanced and ``a e^{−f/ρ}`` (the
    unbalanced first-order condition) otherwise.

    Args:
        pot: (n,) potential f.  mass: (n,) row sums r.  log_w: (n,) log a.
        rho: ρ of this side or None.
    """
    target = log_w if rho is None else log_w - pot / rho
    return (mass - torch.exp(target)).abs().sum()


def mass_excess(backend, pot: Potentials, r: torch.Tensor) -> torch.Tensor:
    r"""``m(P) − m(a) m(b)``, the plan's mass over that of ``a ⊗ b``, to a few ulps of the cost.

    The relaxed dual value holds ``ε (m(P) − m(a) m(b))``. From the row sums ``r`` its
    error is ε times an ulp of the masses: at ε far above the cost that is larger than
    the answer. There (:func:`~flashot.backends.near.is_near_uniform`) the rows are
    taken again with normalized weights ``π = b/m(b)``,

    .. math::

        m(P) - m(a) m(b) = m(b) \sum_i a_i \operatorname{expm1}(\delta_i), \qquad
        \delta_i = (f_i - \alpha_i + \ell_i^\pi)/\varepsilon,

    where ``δ`` is a difference of cost-sized terms over ε, so ``ε·expm1(δ)`` keeps
    the accuracy of the cost. Elsewhere ``Σ r − m(a) m(b)`` is as accurate.

    Args:
        backend: the solve's backend.  pot: the problem at its potentials.
        r: (n,) row sums of the plan.
    """
    from flashot.backends.near import is_near_uniform, log_mass  # (backends import this module)

    form, f, g, log_a, log_b, eps = pot.parts()

    m_a, m_b = torch.exp(log_a).sum(), torch.exp(log_b).sum()
    if not is_near_uniform(form, eps):
        return r.sum() - m_a * m_b
    log_pi, log_total = log_mass(log_b)
    lse, _ = backend.row_attend(form, g - form.beta, eps, log_w=log_pi)
    delta = log_residual(f, lse, form.alpha, eps)
    return torch.exp(log_total).to(r.dtype) * (torch.exp(log_a) * torch.expm1(delta)).sum()


def phi_sum(pot: torch.Tensor, weights: torch.Tensor, rho: float | None,
            total=torch.sum) -> torch.Tensor:  # fmt: skip
    """``Σ_i w_i φ(f_i)`` of the dual: ``φ(t) = t`` balanced, ``−ρ expm1(−t/ρ)`` relaxed.

    Args:
        pot: (n,) potential (detached on a relaxed side).  weights: (n,).  rho: ρ or None.
        total: the sum over i (per problem for a packed batch: ``Segments.sum``).
    """
    if rho is None:
        return total(weights * pot)
    return -rho * total(weights * torch.expm1(-pot.detach() / rho))


def relaxed_weight(pot, w, rho):
    """``w e^{−f/ρ}``, the target of a relaxed side's marginal (w when balanced)."""
    return w if rho is None else w * torch.exp(-pot / rho)
