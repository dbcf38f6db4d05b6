r"""The dual system of a small problem, solved directly (the small-problem fast path).

:func:`flashot.autodiff.implicit.solve_dual` solves ``S w_g = r`` with the Schur
complement

.. math::

    S = (1 + \delta) D_c - P^\top D_r^{-1} P \;[+\, \hat c\, c^\top \text{ per balanced problem}]

by conjugate gradients, two streaming passes per iteration: hundreds of passes for an
accurate HVP at small ε. When the plan has few entries (:data:`DENSE_UP_TO`) and S is
small (:data:`DENSE_COLUMNS` columns), forming P and S in float64 and factoring S
once (Cholesky) costs less than a few CG iterations, and every later solve on the same
potentials (each HVP of a Lanczos or Newton loop) is two triangular solves. The
answer is the same system's, to float64 rounding instead of to ``cg_tol``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashot.backends.dual import relaxed_weight
from flashot.geometry.costs import AttentionForm
from flashot.geometry.segments import problem_sums

__all__ = ["DENSE_COLUMNS", "DENSE_UP_TO", "DenseDual", "clear_dense_factors", "dense_dual"]

#: direct solves up to this many plan entries n·m (P in float64: 8 MB)
DENSE_UP_TO = 1 << 20
#: and up to this many columns m (S and its factor: 8 MB each)
DENSE_COLUMNS = 1024

#: the last factor, with the tensors it was built from (held, so their storage cannot be
#: reused by other data while the key names it)
_LAST: list = []


@dataclass(frozen=True)
class DenseDual:
    """A factored dual system: P (n, m), ``D_r⁻¹`` (n,), the Cholesky factor of S (m, m).

    ``project`` is the deflation's projection of right-hand sides (balanced problems),
    applied as ``r − ĉ Σ_problem r``: (m, m) or None.
    """

    plan: torch.Tensor
    d_r_inv: torch.Tensor
    factor: torch.Tensor
    project: torch.Tensor | None

    def solve(self, f_bar: torch.Tensor, g_bar: torch.Tensor, eps: float):
        """``(w_f, w_g, residual)`` for right-hand sides (n,), (m,) or (n, k), (m, k).

        Float64 inside; ``residual`` is the worst column's ``‖r − S w_g‖ / ‖r‖``.
        """
        vector = f_bar.dim() == 1
        fb = (f_bar[:, None] if vector else f_bar).double()
        gb = (g_bar[:, None] if vector else g_bar).double()
        d_r_inv = self.d_r_inv[:, None]
        rhs = eps * (gb - self.plan.T @ (d_r_inv * fb))
        if self.project is not None:  # (the part along 1 is a gauge dependence: dropped)
            rhs = self.project @ rhs
        w_g = torch.cholesky_solve(rhs, self.factor)
        w_f = d_r_inv * (eps * fb - self.plan @ w_g)
        lower = self.factor
        gap = (rhs - lower @ (lower.T @ w_g)).norm(dim=0) / rhs.norm(dim=0).clamp_min(1e-300)
        if vector:
            w_f, w_g = w_f[:, 0], w_g[:, 0]
        return w_f.to(f_bar.dtype), w_g.to(g_bar.dtype), float(gap.max())


def fits(form: AttentionForm) -> bool:
    """Whether a problem's dual system is solved directly (CPU tensors, small sizes)."""
    n, m = form.q.shape[0], form.k.shape[0]
    return form.q.device.type == "cpu" and n * m <= DENSE_UP_TO and m <= DENSE_COLUMNS


def dense_dual(form: AttentionForm, f, g, a, b, eps: float, rho,
               shift: float) -> DenseDual | None:  # fmt: skip
    """The factored system of a problem (the cached one when its inputs are the same).

    ``shift`` is the relative shift of ``D_c`` the CG uses. None when the factorization
    fails (S not positive definite to rounding): the caller falls back to CG.
    """
    tensors = (form.q, form.k, form.alpha, form.beta, f, g, a, b)
    key = (tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors),
           float(eps), rho, id(form.segments), shift)  # fmt: skip
    if _LAST and _LAST[0][0] == key:
        return _LAST[0][2]
    system = _factor(form, f, g, a, b, eps, rho, shift)
    _LAST.clear()
    if system is not None:
        _LAST.append((key, tensors, system))
    return system


def clear_dense_factors() -> None:
    """Drop the kept factor (and its references to the problem's tensors)."""
    _LAST.clear()


def _factor(form, f, g, a, b, eps, rho, shift) -> DenseDual | None:
    rho_x, rho_y = rho
    d64 = AttentionForm(form.q.double(), form.k.double(), form.alpha.double(),
                        form.beta.double(), segments=form.segments)  # fmt: skip
    f, g, a, b = (t.double() for t in (f, g, a, b))
    log_p = torch.log(a)[:, None] + torch.log(b)[None, :]
    log_p = log_p + (f[:, None] + g[None, :] - d64.dense()) / eps
    plan = torch.exp(log_p)  # (+inf costs between packed problems: exactly 0)
    r, c = plan.sum(1), plan.sum(0)
    d_r = r if rho_x is None else r + (eps / rho_x) * relaxed_weight(f, a, rho_x)
    d_c = c if rho_y is None else c + (eps / rho_y) * relaxed_weight(g, b, rho_y)
    d_r_inv = torch.where(d_r > 0, 1.0 / d_r, torch.zeros_like(d_r))
    schur = torch.diag((1 + shift) * d_c) - plan.T @ (d_r_inv[:, None] * plan)
    project = None
    if rho_x is None and rho_y is None:
        col_seg = None if form.segments is None else form.segments.T
        c_unit = c / problem_sums(c, col_seg)
        # (Σ over i's problem of c_j w_j, as a matrix: row i holds c_j for j in i's problem)
        same = problem_sums(torch.diag(c), col_seg)
        same = same if same.dim() == 2 else same.expand(len(c), -1)
        schur = schur + c_unit[:, None] * same
        eye = torch.eye(len(c), dtype=c.dtype)
        ones = problem_sums(eye, col_seg)
        ones = ones if ones.dim() == 2 else ones.expand(len(c), -1)
        project = eye - c_unit[:, None] * ones
    schur = 0.5 * (schur + schur.T)
    factor, info = torch.linalg.cholesky_ex(schur)
    if int(info) != 0:
        return None
    return DenseDual(plan, d_r_inv, factor, project)
