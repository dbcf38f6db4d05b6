"""Dual-potential helpers shared by the solver, the backends and the results.

With potentials (f, g) the plan is ``P_ij = a_i b_j exp((f_i + g_j − C_ij)/ε)``; in
attention form its rows are softmaxes of the biased scores ``⟨q_i, k_j⟩ + h_j``.
"""

from __future__ import annotations

import torch

__all__ = ["bias", "marginal_error"]


def bias(
    potential: torch.Tensor, offset: torch.Tensor, log_w: torch.Tensor, eps: float
) -> torch.Tensor:
    """Score bias of a potential: ``h = g − β + ε log b`` (``-inf`` where b = 0)."""
    return potential - offset + eps * log_w


def marginal_error(
    pot: torch.Tensor,
    lse: torch.Tensor,
    offset: torch.Tensor,
    log_w: torch.Tensor,
    eps: float,
    rho: float | None,
) -> torch.Tensor:
    """L1 violation of one marginal condition of the plan ``P = a b e^{(f⊕g−C)/ε}``.

    With ``lse`` the row LSE of the other potential's bias, the plan's row sums are
    ``r_i = a_i exp((f_i − α_i + lse_i)/ε)``; the target is ``a_i`` when balanced and
    ``a_i exp(−f_i/ρ)`` (the unbalanced first-order condition) otherwise.

    Args:
        pot: (n,) potential f.  lse: (n,) row LSE.  offset: (n,) α.
        log_w: (n,) log a.  eps: ε.  rho: ρ of this side or None.
    """
    log_r = log_w + (pot - offset + lse) / eps
    target = log_w if rho is None else log_w - pot / rho
    return (torch.exp(log_r) - torch.exp(target)).abs().sum()
