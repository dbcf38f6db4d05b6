"""Dual-potential helpers shared by the solver, the backends and the results.

With potentials (f, g) the plan is ``P_ij = a_i b_j exp((f_i + g_j − C_ij)/ε)``; in
attention form its rows are softmaxes of the biased scores ``⟨q_i, k_j⟩ + h_j`` with
``h = g − β`` and the weights b kept apart (see ``Backend.row_attend``).
"""

from __future__ import annotations

import torch

__all__ = ["log_residual", "marginal_error", "row_mass"]


def log_residual(
    pot: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor, eps: float
) -> torch.Tensor:
    """``ln R_i = (f_i − α_i + lse_i)/ε``: the log of a row's plan mass per unit weight.

    ``lse`` is the row LSE of the other potential's bias; 0 at the Sinkhorn fixed point.
    """
    return (pot - offset + lse) / eps


def row_mass(
    pot: torch.Tensor, lse: torch.Tensor, offset: torch.Tensor, log_w: torch.Tensor, eps: float
) -> torch.Tensor:
    """Row sums ``r_i = a_i exp((f_i − α_i + lse_i)/ε)`` of the plan.

    ``lse`` is the row LSE of the other potential's bias.
    """
    return torch.exp(log_w + log_residual(pot, lse, offset, eps))


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
