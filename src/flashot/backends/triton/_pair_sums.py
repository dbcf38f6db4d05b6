r"""Both soft-minima of a symmetric step of a pair cost, one exponential per score.

GeomLoss' symmetric step needs, from the same cost tiles, the rows' and the columns'
soft-minima

.. math::

    \tilde f_i = -ε \log \sum_j b_j e^{(g_j - C_{ij})/ε}
              = f_i - ε \ln R_i, \qquad
    R_i = \sum_j b_j\, 2^{(f_i + g_j - C_{ij})\,\log_2 e/ε},

and :math:`\tilde g_j = g_j - ε \ln C_j` with :math:`C_j = \sum_i a_i 2^{(\dots)}`, for
any stabilizers f, g: the current potentials, which keep :math:`R_i` and :math:`C_j`
near 1 as the iterations settle. ``_pair_sums_kernel`` forms each score once (as
:mod:`._pairwise` does: product form or differences, φ applied per tile), takes one
exponential and adds it to both sums: half the score work, square roots and exponentials
of two exact passes (:mod:`._pairwise`'s ``_softmin_kernel``, with its running maximum).
Without a maximum a sum is exact only inside a window (no term overflows, the terms
that matter are normal floats): :data:`WINDOW`. Rows and columns outside it, which
early steps of a schedule can produce, are recomputed by the exact kernel, which skips
on the device every row block whose sums were valid (no host round trip).

Column-stationary: a program keeps BLOCK_N columns on chip and streams the row tiles
of its row split. Column sums accumulate elementwise in a register tile, reduced once
at the end into that split's partials (no atomics); row sums are reduced along the
tile's cheap axis and added atomically (their order varies: not bit-reproducible, so
:func:`window_softmins` is not used under ``torch.use_deterministic_algorithms``).
A self problem (x against x, f = g) needs the column sums only (``ROWS`` false): by
symmetry they are its rows'. Block-sparse (the multiscale mode's fine steps): a column
block streams only the row intervals a truncation mask keeps for it, each side's repair
its own layout's intervals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends import temperature as _row
from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.triton import _configs
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._common import _stationary_tiles
from flashot.backends.triton._configs import cdiv
from flashot.backends.triton._pair_functions import triton_functions
from flashot.backends.triton._pair_operands import pair_scope, prepared, score_operands
from flashot.backends.triton._pairwise import (
    GRAD_UP_TO,
    _interval,
    _interval_span,
    _launch_forward,
    _layout,
    _pair_stats,
    _precision,
)
from flashot.geometry.pair_costs import PairCost

__all__ = ["MAX_D", "WINDOW", "window_softmins"]

#: a window sum S is exact when ``2^-WINDOW < S < 2^WINDOW``: no term overflowed (each is
#: below S), and the terms lost below float32's normal range (< 2^-126 each, flushed)
#: add up to under m·2^-126 = S·m·2^-66: a relative 2^-34 for m up to 2^32 points
WINDOW = 60.0
#: the widest features the window pass takes (its stationary columns in one chunk)
MAX_D = GRAD_UP_TO


@triton.jit
def _pair_sums_kernel(
    X, Y, XN, YN, F, LA, G, LB, R, CP, PTR, IV, n, m, d, scale, per, sxn, sxd, syn, syd,
    XP, YP, INV_X, INV_Y, x_lo, y_lo,
    COST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, DIFF: tl.constexpr, PRECISION: tl.constexpr,
    PRESPLIT: tl.constexpr, ROWS: tl.constexpr, SPARSE: tl.constexpr = False,
):  # fmt: skip
    """Column partials ``CP[split, j] = Σ_i a_i E_ij`` and (ROWS) row sums ``R_i``.

    ``E_ij = 2^{(F_i + G_j − φ_ij)·scale}``; with ROWS also ``R_i += Σ_j b_j E_ij``
    (atomically; R zeroed). F, G: the stabilizers; ``a = e^LA``, ``b = e^LB``: the
    weights; ``scale = log2 e/ε``. Grid: (column blocks, row splits of ``per`` rows). XP,
    YP, INV_X, INV_Y, x_lo, y_lo, PRESPLIT: the score operands (:mod:`._pairwise`'s
    ``_pair_stats``). SPARSE (one split): column block b streams only the row intervals
    ``IV[PTR[b]:PTR[b + 1]]`` (a block-sparse layout of the transposed problem, BLOCK_N
    its blocks' size).
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    col_ok = offs_n < m
    yt, yt_lo, unscale = _stationary_tiles(YP, y_lo, offs_n, m, d, syn, syd, INV_X, INV_Y,
                                           BLOCK_D, D_CHUNKS, True, PRESPLIT)  # fmt: skip
    v = tl.where(col_ok, tl.load(G + offs_n, mask=col_ok, other=0.0) * scale, float("-inf"))
    b = tl.exp(tl.load(LB + offs_n, mask=col_ok, other=float("-inf")))  # (none past the tail)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lo, hi = _interval_span(PTR, SPARSE)
    for r in range(lo, hi):
        row_lo, row_hi = _interval(IV, r, split, per, n, SPARSE)
        for start in range(row_lo, row_hi, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < row_hi
            u = tl.where(row_ok, tl.load(F + offs_m, mask=row_ok, other=0.0) * scale,
                         float("-inf"))  # fmt: skip
            a = tl.exp(tl.load(LA + offs_m, mask=row_ok, other=float("-inf")))
            s, t, an, bn, _ = _pair_stats(X, Y, XN, YN, XP, YP, offs_m, offs_n, n, m, d, sxn,
                                          sxd, syn, syd, yt, yt, yt_lo, yt_lo, x_lo, y_lo,
                                          unscale, BLOCK_M, BLOCK_N, BLOCK_D, D_CHUNKS, DIFF,
                                          PRECISION, True, PRESPLIT)  # fmt: skip
            e = tl.exp2(u[:, None] + v[None, :] - COST(s, t, an, bn) * scale)
            acc += a[:, None] * e
            if ROWS:
                tl.atomic_add(R + offs_m, tl.sum(e * b[None, :], 1), mask=row_ok)
    tl.store(CP + split * m + offs_n, tl.sum(acc, 0), mask=col_ok)


def _sums(xs, ys, xn, yn, f, la, g, lb, scale: float, cost: PairCost, rows: bool,
          sparse=None):  # fmt: skip
    """``(R (n,) or None, C (m,))``: the window sums of prepared clouds (see the module).

    ``sparse``: a block-sparse layout of the columns (y's blocks over x's intervals).
    """
    fn, _ = triton_functions(cost)
    n, m, d = xs.shape[0], ys.shape[0], xs.shape[1]
    diff, block_d, chunks, _ = _layout(d, d <= GRAD_UP_TO, forward=True)
    bm, bn, warps, stages = _configs.PAIRWISE_SUMS_TILES
    if triton_interpreted():
        bm, bn = 16, 16
    bn = sparse[2] if sparse else bn  # (the layout's blocks)
    splits, per = (1, n) if sparse else _configs.column_grid(cdiv(m, bn), n, bm, xs.device)
    r = torch.zeros(n if rows else 1, device=xs.device, dtype=torch.float32)
    cp = torch.empty(splits, m, device=xs.device, dtype=torch.float32)
    ptr, iv = sparse[:2] if sparse else (cp, cp)
    options = {} if triton_interpreted() else {"num_warps": warps, "num_stages": stages}
    score, presplit = score_operands(xs, ys, diff)
    with on_device(xs.device):
        fire(_pair_sums_kernel, (cdiv(m, bn), splits),
            xs, ys, xn, yn, f, la, g, lb, r, cp, ptr, iv, n, m, d, scale, per, *xs.stride(),
            *ys.stride(), *score, COST=fn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
            D_CHUNKS=chunks, DIFF=diff, PRECISION=_precision(), PRESPLIT=presplit, ROWS=rows,
            SPARSE=sparse is not None, **options,
        )  # fmt: skip
    return (r if rows else None), cp.sum(0)


def window_softmins(x, y, la, lb, f, g, eps: float, cost: PairCost, sparse=None,
                    lse: bool = False):  # fmt: skip
    """``(f̃, g̃)``: ``softmin(x, y, lb + g/ε)`` (n,) and ``softmin(y, x, la + f/ε)`` (m,).

    One window pass (see the module), then the exact kernel's REPAIR launch per side,
    which streams only the row blocks holding a sum outside the window and writes every
    row's result. A self problem (``y is x``, with ``la is lb`` and ``f is g``) runs the
    columns only and returns its soft-minimum twice. Float32, no autograd.

    Args:
        x: (n, d), y: (m, d) clouds.  la: (n,), lb: (m,) log-weights.
        f: (n,), g: (m,) the current potentials (the stabilizers; finite).
        eps: ε > 0.  cost: a :class:`PairCost` with a Triton function.
        sparse: None, or block-sparse layouts ``(rows, cols)``
            (:func:`~flashot.backends.kernel_sums.block_intervals`, clouds sorted by
            cluster): x's blocks over y's intervals and y's over x's, of one mask and its
            transpose (a self problem: one symmetric layout, twice). The window pass
            streams the columns' layout, each side's repair its own; a row's window sum
            covers the kept pairs as its exact soft-minimum does, padded differently
            (terms below the truncation).
        lse: each side as ``(soft-minimum, lse2)`` instead, lse2 the base-2 LSE the
            kernels keep (:func:`~._pairwise.fused_softmin`'s, which its gradient takes).
    """
    self_problem = y is x and la is lb and f is g
    scale = _row.LOG2E / eps
    rows_layout, cols_layout = sparse if sparse is not None else (None, None)
    f, g, la, lb = (t.detach().float().contiguous() for t in (f, g, la, lb))
    with pair_scope():  # (the sums and both repairs share one preparation of the clouds)
        xs, ys, xn, yn = prepared(x, y, cost)
        rows, cols = _sums(xs, ys, xn, yn, f, la, g, lb, scale, cost, rows=not self_problem,
                           sparse=cols_layout)  # fmt: skip
        g_new = _settled(y, x, la, g, f, cols, scale, cost, cols_layout)
        if rows is None:  # (a self problem)
            return (g_new, g_new) if lse else (g_new[0], g_new[0])
        f_new = _settled(x, y, lb, f, g, rows, scale, cost, rows_layout)
        return (f_new, g_new) if lse else (f_new[0], g_new[0])


def _settled(x, y, lw, pot, pot_cols, sums, scale: float, cost: PairCost, sparse=None):
    """``(softmin(x, y, lw + pot_cols/ε), its lse2)`` from the window ``sums`` at ``pot``.

    ``pot − ε ln sums`` where the sums are exact; the exact kernel in the row blocks
    holding one that is not (one REPAIR launch either way; over ``sparse``'s intervals).
    """
    parts = _launch_forward(x, y, lw, scale, cost, False, sparse=sparse,
                            repair=(sums, pot, pot_cols, WINDOW))  # fmt: skip
    return (-1.0 / scale) * parts[0], parts[0]
