r"""The streaming reverse-mode product of the plan (second-order primitive).

For the plan ``P_ij = a_i b_j exp((f_i + g_j − α_i − β_j + ⟨q_i, k_j⟩)/ε)``, values
``V`` (m, p) and a cotangent ``D`` (n, p) of ``P V``, the sensitivities

.. math::

    S_{ij} = P_{ij} \big(d^0_i + \langle D_i, V_j \rangle\big)

give every derivative of ``⟨D, P V⟩ + ⟨d⁰, P 1⟩`` (``d⁰``, optional, is the cotangent
of the row sums: a ones column of ``V`` without the widened copies): ``∂/∂f_i = Σ_j S_ij / ε``,
``∂/∂q_i = Σ_j S_ij k_j / ε``, ``∂/∂a_i = Σ_j S_ij / a_i`` (summed without the
division, so zero weights get their derivative too) and the same by columns, and
``∂/∂V = Pᵀ D`` (without ``d⁰``). This is the statistic of an attention backward pass
(without the softmax's normalization term), streamed here tile by tile in PyTorch:
nothing of size n × m is stored, only a score tile of at most ``budget`` elements.

A backward rarely needs every reduction (points without gradients need no ``col_q``,
internal values no ``Pᵀ D``): ``need`` names the outputs to form (:func:`outputs_for`
derives it from an autograd Function's ``needs_input_grad``); the others may be
None and cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashot.backends.row_pool import tile_sizes

__all__ = ["ALL", "PlanVJP", "outputs_for", "plan_vjp_tiles"]

#: every output of a plan_vjp: row (with per_a), row_k, col (with per_b), col_q, pt_d
ALL = frozenset({"row", "row_k", "col", "col_q", "pt_d"})


def outputs_for(needs_input_grad) -> frozenset:
    """The outputs whose gradients of ``(q, α, k, β, a, b[, f, g[, V]])`` are asked for.

    ``needs_input_grad`` in that order (an autograd Function's flags); missing entries
    count as not needed.
    """
    q, alpha, k, beta, a, b, f, g, v = (tuple(bool(t) for t in needs_input_grad) + (False,) * 9)[:9]
    wanted = {"row_k": q, "row": alpha or a or f, "col_q": k, "col": beta or b or g, "pt_d": v}
    return frozenset(name for name, yes in wanted.items() if yes)


@dataclass(frozen=True)
class PlanVJP:
    """Row and column reductions of ``S = P ⊙ (D Vᵀ)`` and ``Pᵀ D`` (None: not asked for).

    Attributes:
        row: (n,) ``Σ_j S_ij``.  row_k: (n, d') ``Σ_j S_ij k_j``.
        col: (m,) ``Σ_i S_ij``.  col_q: (m, d') ``Σ_i S_ij q_i``.
        pt_d: (m, p) ``Pᵀ D``.
        per_a: (n,) ``Σ_j S_ij / a_i``.  per_b: (m,) ``Σ_i S_ij / b_j``.
    """

    row: torch.Tensor | None
    row_k: torch.Tensor | None
    col: torch.Tensor | None
    col_q: torch.Tensor | None
    pt_d: torch.Tensor | None
    per_a: torch.Tensor | None
    per_b: torch.Tensor | None


def plan_vjp_tiles(
    form, f, g, a, b, eps: float, v, d, budget: int = 1 << 20, need: frozenset = ALL, d0=None
) -> PlanVJP:
    """:meth:`~flashot.backends.base.Backend.plan_vjp` by score tiles in PyTorch.

    Args:
        form: attention form (detached), q (n, d'), k (m, d').
        f: (n,), g: (m,) potentials.  a: (n,), b: (m,) weights.  eps: ε.
        v: (m, p) values.  d: (n, p) cotangent of ``P v``.
        budget: largest score tile, in elements.
        need: the outputs to form (a subset of :data:`ALL`).
        d0: (n,) cotangent of the row sums ``P 1``, or None.
    """
    q, k = form.q, form.k
    n, m = q.shape[0], k.shape[0]
    dtype = q.dtype
    # the kernel E_ij = P_ij / (a_i b_j) is at most 1/(a_i b_j): no overflow
    row_bias, col_bias = (f - form.alpha) / eps, (g - form.beta) / eps

    def zeros(want, *shape):
        return torch.zeros(*shape, dtype=dtype, device=q.device) if want in need else None

    per_a, row_k, per_b = zeros("row", n), zeros("row_k", *q.shape), zeros("col", m)
    col_q, pt_d = zeros("col_q", *k.shape), zeros("pt_d", m, v.shape[1])
    sensitivities = bool(need - {"pt_d"})
    block_m, block_n = tile_sizes(n, m, budget)
    for i0 in range(0, n, block_m):
        i1 = min(n, i0 + block_m)
        for j0 in range(0, m, block_n):
            j1 = min(m, j0 + block_n)
            z = torch.addmm(col_bias[j0:j1], q[i0:i1], k[j0:j1].T, alpha=1.0 / eps)
            e = torch.exp(z + row_bias[i0:i1, None])
            ai, bj = a[i0:i1], b[j0:j1]
            if pt_d is not None:
                pt_d[j0:j1] += (ai[:, None] * e * bj).T @ d[i0:i1]
            if not sensitivities:
                continue
            u = d[i0:i1] @ v[j0:j1].T
            t = e * (u if d0 is None else u + d0[i0:i1, None])  # S / (a ⊗ b)
            if per_a is not None:
                per_a[i0:i1] += t @ bj
            if per_b is not None:
                per_b[j0:j1] += t.T @ ai
            s = ai[:, None] * t * bj
            if row_k is not None:
                row_k[i0:i1] += s @ k[j0:j1]
            if col_q is not None:
                col_q[j0:j1] += s.T @ q[i0:i1]
    return PlanVJP(None if per_a is None else a * per_a, row_k,
                   None if per_b is None else b * per_b, col_q, pt_d, per_a, per_b)  # fmt: skip
