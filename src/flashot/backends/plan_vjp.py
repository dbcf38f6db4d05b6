r"""The streaming reverse-mode product of the plan (second-order primitive).

For the plan ``P_ij = a_i b_j exp((f_i + g_j − α_i − β_j + ⟨q_i, k_j⟩)/ε)``, values
``V`` (m, p) and a cotangent ``D`` (n, p) of ``P V``, the sensitivities

.. math::

    S_{ij} = P_{ij} \langle D_i, V_j \rangle

give every derivative of ``⟨D, P V⟩``: ``∂/∂f_i = Σ_j S_ij / ε``,
``∂/∂q_i = Σ_j S_ij k_j / ε``, ``∂/∂a_i = Σ_j S_ij / a_i`` (summed without the
division, so zero weights get their derivative too) and the same by columns, and
``∂/∂V = Pᵀ D``. This is the statistic of an attention backward pass
(without the softmax's normalization term), streamed here tile by tile in PyTorch:
nothing of size n × m is stored, only a score tile of at most ``budget`` elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PlanVJP", "plan_vjp_tiles"]


@dataclass(frozen=True)
class PlanVJP:
    """Row and column reductions of ``S = P ⊙ (D Vᵀ)`` and ``Pᵀ D``.

    Attributes:
        row: (n,) ``Σ_j S_ij``.  row_k: (n, d') ``Σ_j S_ij k_j``.
        col: (m,) ``Σ_i S_ij``.  col_q: (m, d') ``Σ_i S_ij q_i``.
        pt_d: (m, p) ``Pᵀ D``.
        per_a: (n,) ``Σ_j S_ij / a_i``.  per_b: (m,) ``Σ_i S_ij / b_j``.
    """

    row: torch.Tensor
    row_k: torch.Tensor
    col: torch.Tensor
    col_q: torch.Tensor
    pt_d: torch.Tensor
    per_a: torch.Tensor
    per_b: torch.Tensor


def plan_vjp_tiles(form, f, g, a, b, eps: float, v, d, budget: int = 1 << 20) -> PlanVJP:
    """:meth:`~flashot.backends.base.Backend.plan_vjp` by score tiles in PyTorch.

    Args:
        form: attention form (detached), q (n, d'), k (m, d').
        f: (n,), g: (m,) potentials.  a: (n,), b: (m,) weights.  eps: ε.
        v: (m, p) values.  d: (n, p) cotangent of ``P v``.
        budget: largest score tile, in elements.
    """
    from flashot.backends.torch_backend import tile_sizes  # (its module imports base)

    q, k = form.q, form.k
    n, m = q.shape[0], k.shape[0]
    dtype = q.dtype
    # the kernel E_ij = P_ij / (a_i b_j) is at most 1/(a_i b_j): no overflow
    row_bias, col_bias = (f - form.alpha) / eps, (g - form.beta) / eps
    per_a = torch.zeros(n, dtype=dtype, device=q.device)
    row_k = torch.zeros_like(q)
    per_b = torch.zeros(m, dtype=dtype, device=q.device)
    col_q = torch.zeros_like(k)
    pt_d = torch.zeros(m, v.shape[1], dtype=dtype, device=q.device)
    block_m, block_n = tile_sizes(n, m, budget)
    for i0 in range(0, n, block_m):
        i1 = min(n, i0 + block_m)
        for j0 in range(0, m, block_n):
            j1 = min(m, j0 + block_n)
            z = torch.addmm(col_bias[j0:j1], q[i0:i1], k[j0:j1].T, alpha=1.0 / eps)
            e = torch.exp(z + row_bias[i0:i1, None])
            t = e * (d[i0:i1] @ v[j0:j1].T)  # S / (a ⊗ b)
            ai, bj = a[i0:i1], b[j0:j1]
            per_a[i0:i1] += t @ bj
            per_b[j0:j1] += t.T @ ai
            s = ai[:, None] * t * bj
            row_k[i0:i1] += s @ k[j0:j1]
            col_q[j0:j1] += s.T @ q[i0:i1]
            pt_d[j0:j1] += (ai[:, None] * e * bj).T @ d[i0:i1]
    return PlanVJP(a * per_a, row_k, b * per_b, col_q, pt_d, per_a, per_b)
