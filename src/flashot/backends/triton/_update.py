r"""The update op: both potentials of a step from their plan sums or LSEs, in one launch.

.. math::

    f' = w_{old} f + w_{new} T(g), \qquad T(g)_i = f_i − ε \ln R_i,

with ``R`` from the fused sums (:mod:`._plan_sums`) where they are exact and from the
repaired LSEs (:mod:`._attend`) elsewhere (the same for g with C); also the marginal
error and the residual range that gates the next fused launch. Kernel → :func:`update`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._common import (
    CONTROL_POINTERS,
    EPS,
    LAM_X,
    LAM_Y,
    LOG2E,
    READ_DAMPING,
    RUNTIME_INTS,
    _from_row,
)
from flashot.backends.triton._configs import cdiv
from flashot.backends.triton._launch import temp_args

__all__ = ["update"]

#: potentials per program of the update launch
BLOCK = 1024


# fmt: off
@triton.jit
def _update_side(
    pid, F, S, LSE, OFFSET, LOG_W, OUT, ERR, GATE, size, eps, shift, lo, hi, w_old, w_new,
    inv_rho,
    BLOCK: tl.constexpr, RELAXED: tl.constexpr, CHECK: tl.constexpr, GATED: tl.constexpr,
    LOG_SUMS: tl.constexpr,
):
    """One side of ``_update_kernel``."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    f = tl.load(F + offs, mask=ok, other=0.0)
    sums = tl.load(S + offs, mask=ok, other=1.0)
    valid = (sums > lo) & (sums < hi)
    # where the fused sum is out of range (or was skipped) the repair pass wrote the row
    # LSE: ln R = (f − α + lse)/ε, always finite
    offset = tl.load(OFFSET + offs, mask=ok, other=0.0)
    exact = (f - offset + tl.load(LSE + offs, mask=ok, other=0.0)) / eps
    ln_r = tl.where(valid, tl.log(tl.where(valid, sums, 1.0)) - shift / LOG2E, exact)
    if GATED:  # the largest ln R and −ln R (from 0: bounds either way)
        tl.atomic_max(GATE, tl.max(tl.where(ok, ln_r, 0.0), 0), sem="relaxed")
        tl.atomic_max(GATE + 1, tl.max(tl.where(ok, -ln_r, 0.0), 0), sem="relaxed")
    if LOG_SUMS:
        tl.store(OUT + offs, ln_r, mask=ok)
    else:
        tl.store(OUT + offs, w_old * f + w_new * (f - eps * ln_r), mask=ok)
    if CHECK:
        w = tl.exp(tl.load(LOG_W + offs, mask=ok, other=float("-inf")))
        target = w
        if RELAXED:
            target = w * tl.exp(-f * inv_rho)
        err = tl.sum(tl.where(ok, tl.abs(w * tl.exp(ln_r) - target), 0.0), 0)
        tl.atomic_add(ERR, err, sem="relaxed")


@triton.jit(
    do_not_specialize=RUNTIME_INTS["_update_kernel"],
    do_not_specialize_on_alignment=CONTROL_POINTERS["_update_kernel"],
)
def _update_kernel(
    F, R, LSE_R, ALPHA, LOG_A, F_OUT, G, C, LSE_C, BETA, LOG_B, G_OUT, ERR, GATE, n, m, eps,
    TEMP, temp_at, shift, LO, hi, w_old_x, w_new_x, w_old_y, w_new_y, inv_rho_x, inv_rho_y,
    BLOCK: tl.constexpr,
    RELAXED_X: tl.constexpr, RELAXED_Y: tl.constexpr, CHECK: tl.constexpr, GATED: tl.constexpr,
    LOG_SUMS: tl.constexpr,
):
    """Both potentials from their plan sums: ``f' = w_old f + w_new T(g)``, ``T(g) = f − ε ln R``.

    ``R_i = Σ_j b_j e^{(f_i + g_j − C_ij)/ε}`` comes from the fused pass (as ``2^shift R_i``)
    where that lies in ``(LO[0], hi)`` and from the repair pass's row LSE elsewhere (same
    for C, with LO[1]). The averaged Jacobi step is ``w_old = ½, w_new = λ/2``, the
    extrapolation ``0, λ``; with LOG_SUMS the outputs are ``ln R``, ``ln C`` instead.
    With CHECK, adds the L1 marginal error ``Σ |a R − target|`` (target a, or
    ``a e^{−f/ρ}`` when relaxed) to ERR; with GATED, the largest ``ln R``, ``ln C`` goes
    to ``GATE[0]`` and the largest ``−ln R``, ``−ln C`` to ``GATE[1]``, for the next
    fused launch. Programs ``[0, cdiv(n, BLOCK))`` do f, the rest g. ``temp_at`` ≠ 0: ε is
    read from ``TEMP``; with READ_DAMPING also λ_x, λ_y, which scale ``w_new_x``, ``w_new_y``.
    """
    eps = _from_row(TEMP, temp_at, eps, EPS)
    if (temp_at & READ_DAMPING) != 0:
        w_new_x = w_new_x * tl.load(TEMP + LAM_X)
        w_new_y = w_new_y * tl.load(TEMP + LAM_Y)
    pid = tl.program_id(0)
    blocks_f = tl.cdiv(n, BLOCK)
    if pid < blocks_f:
        _update_side(
            pid, F, R, LSE_R, ALPHA, LOG_A, F_OUT, ERR, GATE, n, eps, shift, tl.load(LO), hi,
            w_old_x, w_new_x, inv_rho_x, BLOCK, RELAXED_X, CHECK, GATED, LOG_SUMS,
        )
    else:
        _update_side(
            pid - blocks_f, G, C, LSE_C, BETA, LOG_B, G_OUT, ERR, GATE, m, eps, shift,
            tl.load(LO + 1), hi, w_old_y, w_new_y, inv_rho_y, BLOCK, RELAXED_Y, CHECK, GATED,
            LOG_SUMS,
        )
# fmt: on


def update(pot, w_old, w_new, rho, sums, lse_r, lse_c, *, shift, check=False, gate=None,
           log_sums=False, damped=False):  # fmt: skip
    """``(f', g', err or None)``: the update launch of a fused step (see module).

    Args:
        pot: the step's :class:`~flashot.backends.dual.Potentials`.
        w_old, w_new: ``(x, y)`` weights of the old potentials and of ``T``.
        rho: ``(ρ_x, ρ_y)``, None for a balanced side.
        sums: ``(R, C, lo, hi)``: the fused sums (carrying ``2^shift``) and their exact
            range (``lo`` a 2-element tensor: rows, columns).
        lse_r, lse_c: the exact LSEs where a sum is out of range.
        shift: the sums' factor, base 2.
        check: also return the L1 marginal error (a 0-d tensor).
        gate: the residual gate's slot the launch fills, or None.
        log_sums: return ``ln R``, ``ln C`` instead of potentials.
        damped: ``w_new`` is scaled by the damping of ``eps``'s device row.
    """
    form, f, g, log_a, log_b, eps = pot.parts()
    n, m, dev = f.shape[0], g.shape[0], f.device
    r, c, lo, hi = sums
    f_out, g_out = torch.empty_like(f), torch.empty_like(g)
    err = torch.zeros(1, device=dev, dtype=torch.float32) if check else f_out
    with on_device(dev):
        fire(_update_kernel, (cdiv(n, BLOCK) + cdiv(m, BLOCK),),
            F=f, R=r, LSE_R=lse_r, ALPHA=form.alpha, LOG_A=log_a, F_OUT=f_out, G=g, C=c,
            LSE_C=lse_c, BETA=form.beta, LOG_B=log_b, G_OUT=g_out, ERR=err,
            GATE=f_out if gate is None else gate, n=n, m=m, eps=eps,
            **temp_args(eps, f_out, damped=damped), shift=shift, LO=lo, hi=hi,
            w_old_x=w_old[0], w_new_x=w_new[0], w_old_y=w_old[1], w_new_y=w_new[1],
            inv_rho_x=0.0 if rho[0] is None else 1.0 / rho[0],
            inv_rho_y=0.0 if rho[1] is None else 1.0 / rho[1],
            BLOCK=BLOCK, RELAXED_X=rho[0] is not None, RELAXED_Y=rho[1] is not None,
            CHECK=check, GATED=gate is not None, LOG_SUMS=log_sums,
        )  # fmt: skip
    return f_out, g_out, (err[0] if check else None)
