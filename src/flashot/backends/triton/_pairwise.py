r"""Fused soft-minima of pair costs (:class:`~flashot.geometry.pair_costs.PairCost`).

The soft C-transform of a cost outside the attention form,

.. math::

    s_i = -\varepsilon \log \sum_j \exp\big(h_j - C_{ij}/\varepsilon\big), \qquad
    C_{ij} = \varphi(|x_i - y_j|^2, \langle x_i, y_j\rangle, |x_i|^2, |y_j|^2),

streamed like attention: a program owns BLOCK_M rows, forms each (BLOCK_M, BLOCK_N)
tile's statistics on chip (the product by ``tl.dot``, or coordinate differences for
d ≤ :data:`~flashot.geometry.pair_costs.DIFFERENCES_UP_TO`), applies φ (the cost's
``@triton.jit`` function, a constexpr argument) and keeps an online base-2 log-sum-exp.
No n × m array is stored. The gradient, with ``W_ij = ḡ_i exp(h_j − C_ij/ε − lse_i)``
(ḡ the cotangent of s), is two more streaming launches:

* rows: ``x̄_i = Σ_j W_ij (2φ_s (x_i − y_j) + φ_t y_j + 2φ_a x_i)``;
* columns: ``ȳ_j = Σ_i W_ij (2φ_s (y_j − x_i) + φ_t x_i + 2φ_b y_j)``,
  ``h̄_j = −ε Σ_i W_ij``;

with ``(φ_s, φ_t, φ_a, φ_b)`` from the cost's ``triton_grad``. Every program owns its
outputs: no atomics, deterministic sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends import temperature as _row
from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.triton import _configs
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._common import (
    LOG2E,
    _load_tile,
    _rows_in,
    _running_total,
    _running_update,
    _score_tile,
    _stationary_tiles,
)
from flashot.backends.triton._configs import cdiv, next_pow2
from flashot.backends.triton._pair_functions import LINEAR, RADIAL, triton_functions
from flashot.backends.triton._pair_operands import prepared, score_operands
from flashot.geometry.pair_costs import DIFFERENCES_UP_TO, PairCost

__all__ = ["GRAD_UP_TO", "fused_grads", "fused_kernel_sum", "fused_softmin"]

#: widest features the gradient kernels take with the product form (one feature chunk)
GRAD_UP_TO = 128
#: the forward's feature chunk beyond GRAD_UP_TO (up to it, one chunk: the forward forms
#: each score as the gradient kernels do, so their weights see the same rounding)
D_CHUNK = 64
#: tiles holding a pair with ``|x − y|² < NEAR (|x|² + |y|²)`` form it from differences:
#: beyond, the product form's error in ``|x − y|`` stays within ~10× float32's
NEAR = tl.constexpr(1e-2)


@triton.jit
def _pair_stats(
    X,
    Y,
    XN,
    YN,
    XP,
    YP,
    offs_m,
    offs_n,
    n,
    m,
    d,
    sxn,
    sxd,
    syn,
    syd,
    x_tile,
    yt_tile,
    x_lo_tile,
    yt_lo_tile,
    x_lo,
    y_lo,
    unscale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr,
    DIFF: tl.constexpr,
    PRECISION: tl.constexpr,
    HOIST_K: tl.constexpr,
    PRESPLIT: tl.constexpr,
):
    """The tile's ``(s, t, a, b, near)``.

    Shapes (BLOCK_M, BLOCK_N) ×2, (BLOCK_M, 1), (1, BLOCK_N); ``near``: whether ``s``
    came from differences (a scalar). Rows and columns past ``n`` and ``m`` repeat the
    last ones (``_rows_in``): callers mask the tail's terms. The product form's
    ``t = ⟨x_i, y_j⟩`` is the attention kernels' score tile (``_common._score_tile``) of
    the score operands XP, YP (the clouds, or with PRESPLIT their split half parts, lo
    at ``x_lo``/``y_lo``, ``unscale`` their scales' product); with one feature chunk the
    stationary side comes hoisted: the rows' ``x_tile`` (``x_lo_tile``), or with HOIST_K
    the columns' transposed ``yt_tile`` (``yt_lo_tile``), from ``_stationary_tiles``.
    """
    rows, cols = _rows_in(offs_m, n), _rows_in(offs_n, m)
    a = tl.load(XN + rows)[:, None]
    b = tl.load(YN + cols)[None, :]
    if DIFF:  # exact differences, one feature at a time (d small)
        near = tl.full((), 1, tl.int32)
        s, t = _differences(X, Y, rows, cols, d, sxn, sxd, syn, syd, BLOCK_M, BLOCK_N)
    else:
        raw = _score_tile(XP, YP, x_tile, yt_tile, offs_m, offs_n, n, m, d, sxn, sxd, syn, syd,
                          BLOCK_D, D_CHUNKS, HOIST_K, PRECISION, x_lo_tile, yt_lo_tile, x_lo, y_lo,
                          PRESPLIT)  # fmt: skip
        ab = a + b
        s = tl.maximum(ab - (2.0 * unscale) * raw, 0.0)
        t = raw * unscale  # (unscale a power of two; no work where the cost ignores t)
        # near pairs (s < NEAR (a + b)) lose digits to cancellation: the tile is redone
        # from differences (a self problem's diagonal tiles, close clouds)
        near = tl.min(s - ab * NEAR) < 0.0
        if near:
            s = _differences(X, Y, rows, cols, d, sxn, sxd, syn, syd, BLOCK_M, BLOCK_N)[0]
    return s, t, a, b, near


@triton.jit
def _differences(X, Y, rows, cols, d, sxn, sxd, syn, syd, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """``(|x_i − y_j|², ⟨x_i, y_j⟩)`` of a tile from coordinate differences, one at a time."""
    s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, d):
        xk = tl.load(X + rows * sxn + k * sxd)
        yk = tl.load(Y + cols * syn + k * syd)
        diff = xk[:, None] - yk[None, :]
        s += diff * diff
        t += xk[:, None] * yk[None, :]
    return s, t


@triton.jit
def _exact_part(X, Y, offs_m, offs_n, offs_d, n, m, d, sxn, sxd, syn, syd, ws, wt, acc,
                COLUMNS: tl.constexpr, RADIAL: tl.constexpr):  # fmt: skip
    """``acc`` plus Σ 2φ_s (own − other) + φ_t other, from exact differences per feature."""
    for k in range(0, d):
        xk = tl.load(X + offs_m * sxn + k * sxd, mask=offs_m < n, other=0.0)
        yk = tl.load(Y + offs_n * syn + k * syd, mask=offs_n < m, other=0.0)
        diff = xk[:, None] - yk[None, :]
        if COLUMNS:
            part = tl.sum(-ws * diff if RADIAL else wt * xk[:, None] - ws * diff, 0)
        else:
            part = tl.sum(ws * diff if RADIAL else ws * diff + wt * yk[None, :], 1)
        acc += tl.where(offs_d[None, :] == k, part[:, None], 0.0)
    return acc


@triton.jit
def _interval_span(PTR, SPARSE: tl.constexpr):
    """The program's streamed intervals ``[lo, hi)``: its row block's (sparse) or one."""
    if SPARSE:
        return tl.load(PTR + tl.program_id(0)), tl.load(PTR + tl.program_id(0) + 1)
    else:
        return 0, 1


@triton.jit
def _interval(IV, r, split, per, size, SPARSE: tl.constexpr):
    """The r-th streamed interval ``[c0, c1)``: a layout's, or the split's columns."""
    if SPARSE:
        return tl.load(IV + 2 * r), tl.load(IV + 2 * r + 1)
    else:
        return split * per, tl.minimum(split * per + per, size)


@triton.jit
def _softmin_kernel(
    X, Y, XN, YN, H, LSE, PTR, IV, n, m, d, scale, per, sxn, sxd, syn, syd,
    XP, YP, INV_X, INV_Y, x_lo, y_lo, S, POT, HP, sum_lo, sum_hi,
    COST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, DIFF: tl.constexpr, PRECISION: tl.constexpr, SUM: tl.constexpr,
    SPARSE: tl.constexpr, PRESPLIT: tl.constexpr, REPAIR: tl.constexpr = False,
):  # fmt: skip
    """``LSE[split, i]``: the base-2 log-sum-exp of row i over one split's columns.

    H holds ``h log2 e``; ``scale = log2 e / ε``. ``SUM``: instead the kernel sum
    ``Σ_j φ_ij w_j`` over the split, with H holding the weights w. ``SPARSE``: a row
    block streams the column intervals ``IV[PTR[b]:PTR[b + 1]]`` (block-sparse), no split.
    XP, YP: the product form's score operands (see ``_pair_stats``; ``INV_X``, ``INV_Y``
    the split parts' inverse scales). ``REPAIR`` (not SUM; one split): the
    step after :mod:`._pair_sums`' window sums ``S`` of the rows' stabilizer ``POT``. H
    holds log-weights and HP the columns' potentials (``h = H log2 e + HP·scale``); a row
    block whose sums all lie in ``(sum_lo, sum_hi)`` streams nothing and writes the
    window's ``log2 S_i − POT_i·scale``, any other the exact LSE.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # DIFF: the tile's blocked layout spreads a row over many lanes, where a reduction per
    # tile costs a shuffle tree (384 shuffles of 1383 instructions a tile at d = 3, sm_90):
    # elementwise running (max, sum) tiles instead, one exp per score, reduced at the end
    acc_max = tl.full((BLOCK_M, BLOCK_N), float("-inf"), dtype=tl.float32)
    acc_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lo, hi = _interval_span(PTR, SPARSE)
    if REPAIR:  # (an empty range when every row's window sum was exact)
        sums = tl.load(S + offs_m, mask=offs_m < n, other=1.0)
        bad = (offs_m < n) & ((sums <= sum_lo) | (sums >= sum_hi) | (sums != sums))
        hi = tl.where(tl.max(bad.to(tl.int32), 0) > 0, hi, lo)
    x_tile, x_lo_tile, unscale = _stationary_tiles(
        XP, x_lo, offs_m, n, d, sxn, sxd, INV_X, INV_Y, BLOCK_D, D_CHUNKS, False, PRESPLIT
    )
    for r in range(lo, hi):
        c0, c1 = _interval(IV, r, split, per, m, SPARSE)
        for start in range(c0, c1, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            s, t, a, b, _ = _pair_stats(X, Y, XN, YN, XP, YP, offs_m, offs_n, n, c1, d, sxn, sxd,
                                        syn, syd, x_tile, x_tile, x_lo_tile, x_lo_tile, x_lo,
                                        y_lo, unscale, BLOCK_M, BLOCK_N, BLOCK_D, D_CHUNKS, DIFF,
                                        PRECISION, False, PRESPLIT)  # fmt: skip
            if SUM:
                w = tl.load(H + offs_n, mask=offs_n < c1, other=0.0)
                terms = tl.where(offs_n[None, :] < c1, COST(s, t, a, b) * w[None, :], 0.0)
                if DIFF:
                    acc_sum += terms
                else:
                    run_sum += tl.sum(terms, 1)
            else:
                h = tl.load(H + offs_n, mask=offs_n < c1, other=float("-inf"))
                if REPAIR:
                    h = h * LOG2E + tl.load(HP + offs_n, mask=offs_n < c1, other=0.0) * scale
                z = h[None, :] - COST(s, t, a, b) * scale
                z = tl.where(offs_n[None, :] < c1, z, float("-inf"))
                if DIFF:
                    acc_max, acc_sum = _running_update(z, acc_max, acc_sum)
                else:
                    new_max = tl.maximum(run_max, tl.max(z, 1))
                    base = tl.where(new_max == float("-inf"), 0.0, new_max)  # (−inf rows so far)
                    run_sum = run_sum * tl.exp2(run_max - base) + tl.sum(
                        tl.exp2(z - base[:, None]), 1
                    )
                    run_max = new_max
    if DIFF:
        if SUM:
            run_sum = tl.sum(acc_sum, 1)
        else:
            run_max, run_sum = _running_total(acc_max, acc_sum, 1)
    out = run_sum if SUM else run_max + tl.log2(run_sum)
    if REPAIR:  # (the window's value where nothing streamed)
        window = tl.log2(tl.load(S + offs_m, mask=offs_m < n, other=1.0))
        out = tl.where(hi > lo, out, window - tl.load(POT + offs_m, mask=offs_m < n) * scale)
    tl.store(LSE + split * n + offs_m, out, mask=offs_m < n)


@triton.jit
def _grad_kernel(
    X, Y, XN, YN, H, LSE, G, OUT, OUT_H, PTR, IV, n, m, d, eps, scale_e, per, sxn, sxd, syn,
    syd, XP, YP, INV_X, INV_Y, x_lo, y_lo,
    COST: tl.constexpr, GRAD: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIFF: tl.constexpr, PRECISION: tl.constexpr,
    SUM: tl.constexpr, SPARSE: tl.constexpr, PRESPLIT: tl.constexpr, RADIAL: tl.constexpr = False,
    LINEAR: tl.constexpr = False,
):  # fmt: skip
    """The gradient sums of one side.

    Rows (``COLUMNS`` false): a program owns BLOCK_M rows, writes ``x̄`` (n, d).
    Columns: it owns BLOCK_N columns, streams the rows, writes ``ȳ`` (m, d) and ``h̄``.
    Each split of the streamed side writes its partial sums at ``OUT[split]``. H and LSE
    in base 2, as the forward's; ``scale_e = log2 e / ε``. ``SUM``: the kernel sum's
    gradient: weights ``W_ij = ḡ_i w_j`` (H holds w) and ``w̄_j = Σ_i ḡ_i φ_ij`` for ``h̄``.
    ``SPARSE`` (rows only): the forward's column intervals. XP, YP, INV_X, INV_Y, x_lo,
    y_lo, PRESPLIT: the scores' operands, as the forward's. RADIAL: GRAD's φ_t, φ_a,
    φ_b are zero (:data:`~._pair_functions.RADIAL`), their terms skipped. LINEAR: RADIAL
    with a constant φ_s (:data:`~._pair_functions.LINEAR`, the half square): a row's
    ``Σ_j w_ij (x_i − y_j) = x_i Σ_j w_ij − Σ_j w_ij y_j`` takes one value product a tile
    even where s came from differences, instead of a reduction per feature (no weight
    grows at coincident points: nothing cancels but the two sums); with differences
    (d < BLOCK_D) a ones column at d gives ``Σ_j w_ij`` from the same product.
    """
    offs_d = tl.arange(0, BLOCK_D)
    split = tl.program_id(1)
    if COLUMNS:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        own = _load_tile(Y, offs_n, m, d, syn, syd, BLOCK_D, 1, False)
        h = tl.load(H + offs_n, mask=offs_n < m, other=0.0 if SUM else float("-inf"))
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        scale = tl.zeros((BLOCK_N,), dtype=tl.float32)
        w_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
        stream_size = n
        stream_block = BLOCK_M
    else:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        own = _load_tile(X, offs_m, n, d, sxn, sxd, BLOCK_D, 1, False)
        lse = tl.load(LSE + offs_m, mask=offs_m < n, other=0.0)
        g = tl.load(G + offs_m, mask=offs_m < n, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
        w_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        stream_size = m
        stream_block = BLOCK_N
    # the product form's stationary score tile, loaded once (the columns': transposed)
    if COLUMNS:
        st, st_lo, unscale = _stationary_tiles(YP, y_lo, offs_n, m, d, syn, syd, INV_X, INV_Y,
                                               BLOCK_D, 1, True, PRESPLIT)  # fmt: skip
    else:
        st, st_lo, unscale = _stationary_tiles(XP, x_lo, offs_m, n, d, sxn, sxd, INV_X, INV_Y,
                                               BLOCK_D, 1, False, PRESPLIT)  # fmt: skip
    lo, hi = _interval_span(PTR, SPARSE)
    for r in range(lo, hi):
        c0, c1 = _interval(IV, r, split, per, stream_size, SPARSE)
        m_end = m if COLUMNS else c1  # (the columns' bound: a sparse interval's end)
        for start in range(c0, c1, stream_block):
            if COLUMNS:
                offs_m = start + tl.arange(0, BLOCK_M)
                lse = tl.load(LSE + offs_m, mask=offs_m < n, other=0.0)
                g = tl.load(G + offs_m, mask=offs_m < n, other=0.0)
            else:
                offs_n = start + tl.arange(0, BLOCK_N)
                h = tl.load(H + offs_n, mask=offs_n < m_end, other=0.0 if SUM else float("-inf"))
            s, t, a, b, near = _pair_stats(X, Y, XN, YN, XP, YP, offs_m, offs_n, n, m_end, d,
                                           sxn, sxd, syn, syd, st, st, st_lo, st_lo, x_lo, y_lo,
                                           unscale, BLOCK_M, BLOCK_N, BLOCK_D, 1, DIFF,
                                           PRECISION, COLUMNS, PRESPLIT)  # fmt: skip
            live = (offs_m[:, None] < n) & (offs_n[None, :] < m_end)
            if SUM:
                w = tl.where(live, g[:, None] * h[None, :], 0.0)
                if COLUMNS:
                    w_sum += tl.sum(tl.where(live, g[:, None] * COST(s, t, a, b), 0.0), 0)
            else:
                z = h[None, :] - COST(s, t, a, b) * scale_e - lse[:, None]
                w = tl.where(live, g[:, None] * tl.exp2(z), 0.0)
                if COLUMNS:
                    w_sum -= eps * tl.sum(w, 0)
            c_s, c_t, c_a, c_b = GRAD(s, t, a, b)
            ws, wt = 2.0 * w * c_s, w * c_t
            if not RADIAL:  # (a radial cost's φ_t, φ_a, φ_b are zero: no work for them)
                if COLUMNS:
                    scale += tl.sum(2.0 * w * c_b, 0)
                else:
                    scale += tl.sum(2.0 * w * c_a, 1)
            # (close pairs: (x_i − y_j)/|x_i − y_j| from differences)
            if (DIFF or near > 0) and not LINEAR:
                acc = _exact_part(X, Y, offs_m, offs_n, offs_d, n, m_end, d, sxn, sxd, syn, syd,
                                  ws, wt, acc, COLUMNS, RADIAL)  # fmt: skip
            else:  # 2φ_s (x_i − y_j) + φ_t y_j = 2φ_s x_i + (φ_t − 2φ_s) y_j
                u = -ws if RADIAL else wt - ws
                if COLUMNS:
                    if not (LINEAR and DIFF):
                        scale += tl.sum(ws, 0)
                    xt = tl.load(
                        X + offs_m[:, None] * sxn + offs_d[None, :] * sxd,
                        mask=(offs_m[:, None] < n) & (offs_d[None, :] < d),
                        other=0.0,
                    )
                    if LINEAR and DIFF:  # (a ones column at d: the product sums -ws too)
                        xt = tl.where(offs_d[None, :] == d, 1.0, xt)
                    acc = tl.dot(tl.trans(u), xt, acc, input_precision=PRECISION)
                else:
                    if not (LINEAR and DIFF):
                        scale += tl.sum(ws, 1)
                    yt = tl.load(
                        Y + offs_n[:, None] * syn + offs_d[None, :] * syd,
                        mask=(offs_n[:, None] < m_end) & (offs_d[None, :] < d),
                        other=0.0,
                    )
                    if LINEAR and DIFF:
                        yt = tl.where(offs_d[None, :] == d, 1.0, yt)
                    acc = tl.dot(u, yt, acc, input_precision=PRECISION)
    if LINEAR and DIFF:  # (d < BLOCK_D: the weights' sums sat in column d, negated)
        scale = -tl.sum(tl.where(offs_d[None, :] == d, acc, 0.0), 1)
    acc += scale[:, None] * own
    if COLUMNS:
        tl.store(
            OUT + split * m * d + offs_n[:, None] * d + offs_d[None, :],
            acc,
            mask=(offs_n[:, None] < m) & (offs_d[None, :] < d),
        )
        tl.store(OUT_H + split * m + offs_n, w_sum, mask=offs_n < m)
    else:
        tl.store(
            OUT + split * n * d + offs_m[:, None] * d + offs_d[None, :],
            acc,
            mask=(offs_m[:, None] < n) & (offs_d[None, :] < d),
        )


def _width(size: int) -> int:
    return max(16, next_pow2(size))


def _layout(d: int, whole: bool, forward: bool = False):
    """(DIFF, BLOCK_D, D_CHUNKS, tiles) for feature size d.

    ``whole``: one feature chunk; ``forward``: the soft-minimum's or kernel sum's tiles,
    else the gradients'.
    """
    diff = d <= DIFFERENCES_UP_TO
    tiles = _configs.PAIRWISE_TILES
    if forward:
        tiles = _configs.PAIRWISE_DIFF_TILES if diff else _configs.PAIRWISE_FORWARD_TILES
    block_d = _width(d) if diff or whole else min(_width(d), D_CHUNK)
    if forward and not diff and block_d > 64:
        tiles = _configs.PAIRWISE_FORWARD_WIDE_TILES
    tiles = (16, 16, 1, 1) if triton_interpreted() else tiles
    return diff, block_d, 1 if diff or whole else cdiv(d, block_d), tiles


def _precision() -> str:
    return "ieee" if triton_interpreted() else "tf32x3"


def _launch_forward(x, y, vec, scale: float, cost: PairCost, sum_mode: bool, sparse=None,
                    repair=None):  # fmt: skip
    """The forward kernel's per-split results (splits, n), float32.

    ``sparse``: a :func:`~flashot.backends.kernel_sums.block_intervals` layout (one split).
    ``repair``: ``(sums (n,), pot (n,), pot_cols (m,), window)``: the step after window
    sums (the kernel's REPAIR; ``vec`` the columns' log-weights; one split).
    """
    fn, _ = triton_functions(cost)
    xs, ys, xn, yn = prepared(x, y, cost)
    n, m, d = xs.shape[0], ys.shape[0], xs.shape[1]
    diff, block_d, chunks, (bm, bn, warps, stages) = _layout(d, d <= GRAD_UP_TO, forward=True)
    bm = sparse[2] if sparse else bm  # (the layout's row blocks)
    one = sparse is not None or repair is not None
    splits, per = (1, m) if one else _configs.column_grid(cdiv(n, bm), m, bn, xs.device)
    parts = torch.empty(splits, n, device=xs.device, dtype=torch.float32)
    ptr, iv = sparse[:2] if sparse else (parts, parts)
    sums, pot, pot_cols, window = repair if repair is not None else (parts, parts, parts, 0.0)
    options = {} if triton_interpreted() else {"num_warps": warps, "num_stages": stages}
    score, presplit = score_operands(xs, ys, diff)
    args = (xs, ys, xn, yn, vec.contiguous(), parts, ptr, iv, n, m, d, scale, per,
            *xs.stride(), *ys.stride(), *score, sums, pot, pot_cols, 2.0**-window,
            2.0**window)  # fmt: skip
    with on_device(xs.device):
        fire(_softmin_kernel, (cdiv(n, bm), splits),
            *args, COST=fn, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, D_CHUNKS=chunks,
            DIFF=diff, PRECISION=_precision(), SUM=sum_mode, SPARSE=sparse is not None,
            PRESPLIT=presplit, REPAIR=repair is not None, **options,
        )  # fmt: skip
    return parts


def _merged_lse2(parts: torch.Tensor) -> torch.Tensor:
    """The base-2 LSE (n,) of per-split base-2 LSEs (splits, n): top + log2 Σ 2^(part − top)."""
    if len(parts) == 1:
        return parts[0]
    top = parts.amax(0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    return top + torch.log2(torch.exp2(parts - top).sum(0))


def fused_softmin(
    x: torch.Tensor, y: torch.Tensor, log_w: torch.Tensor, eps: float, cost: PairCost, sparse=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, lse2)``: the soft-minimum (n,) and ``lse2_i = −s_i log2(e)/ε`` (n,), float32.

    No autograd; ``lse2`` (base 2, as the kernels keep it: no conversion's rounding
    between the forward and the gradient's weights) is what :func:`fused_grads` takes.

    Args:
        x: (n, d) rows.  y: (m, d) columns.  log_w: (m,) log-weights h, not all −∞.
        eps: ε > 0.  cost: a :class:`PairCost` with a Triton function.
        sparse: None, or a :func:`~flashot.backends.kernel_sums.block_intervals` layout
            (rows and columns sorted by cluster): each row block streams its intervals.
    """
    h = log_w.detach().float() * _row.LOG2E
    parts = _launch_forward(x, y, h, _row.LOG2E / eps, cost, sum_mode=False, sparse=sparse)
    lse2 = _merged_lse2(parts)
    return (-eps / _row.LOG2E) * lse2, lse2


def fused_kernel_sum(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, cost: PairCost):
    """``(K w)_i = Σ_j φ_ij w_j`` (n,), float32, no autograd (φ: the cost's function).

    Args:
        x: (n, d) rows.  y: (m, d) columns.  w: (m,) weights (any sign).
        cost: a :class:`PairCost` with a Triton function: here the kernel k itself.
    """
    return _launch_forward(x, y, w.detach().float(), 1.0, cost, sum_mode=True).sum(0)


def fused_grads(x, y, vec, eps, cost: PairCost, lse, grad_out, rows: bool, cols: bool,
                sparse=None):  # fmt: skip
    """``(x̄, ȳ, v̄)`` for the cotangent ``grad_out`` (n,) of a soft-minimum or kernel sum.

    ``eps`` a float: the soft-minimum with log-weights ``vec`` and the forward's base-2
    ``lse``; ``eps`` None: the kernel sum with weights ``vec`` (``lse`` unused). Those not
    asked for (``rows``: x̄; ``cols``: ȳ and v̄) are None; float32. Needs the cost's
    ``triton_grad`` and d ≤ :data:`GRAD_UP_TO` (or differences). ``sparse``: the forward's
    layout (rows only).
    """
    if sparse is not None and cols:
        raise ValueError("a block-sparse soft-minimum streams row gradients only")
    fn, grad = triton_functions(cost)
    sum_mode = eps is None
    xs, ys, xn, yn = prepared(x, y, cost)
    n, m, d = xs.shape[0], ys.shape[0], xs.shape[1]
    diff, block_d, _, (bm, bn, warps, stages) = _layout(d, whole=True)
    bm = sparse[2] if sparse else bm  # (the layout's row blocks)
    h = vec.detach().float() * (1.0 if sum_mode else _row.LOG2E)
    g = grad_out.detach().float().contiguous()
    lse = g if sum_mode else lse.contiguous()
    eps = 1.0 if sum_mode else float(eps)
    options = {} if triton_interpreted() else {"num_warps": warps, "num_stages": stages}
    score, presplit = score_operands(xs, ys, diff)
    flags = dict(COST=fn, GRAD=grad, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, DIFF=diff,
                 PRECISION=_precision(), SUM=sum_mode, PRESPLIT=presplit,
                 RADIAL=grad in RADIAL, LINEAR=grad in LINEAR, **options)  # fmt: skip
    head = (xs, ys, xn, yn, h.contiguous(), lse, g)
    ptr, iv = sparse[:2] if sparse else (g, g)
    tail = (ptr, iv, n, m, d, eps, _row.LOG2E / eps)
    strides = (*xs.stride(), *ys.stride(), *score)
    gx = gy = gv = None
    with on_device(xs.device):
        if rows:
            splits, per = (1, m) if sparse else _configs.column_grid(cdiv(n, bm), m, bn, xs.device)
            gx = torch.empty(splits, n, d, device=xs.device, dtype=torch.float32)
            fire(_grad_kernel, (cdiv(n, bm), splits),
                *head, gx, gx, *tail, per, *strides, COLUMNS=False, SPARSE=sparse is not None,
                **flags,
            )  # fmt: skip
            gx = gx.sum(0)
        if cols:
            splits, per = _configs.column_grid(cdiv(m, bn), n, bm, xs.device)
            gy = torch.empty(splits, m, d, device=xs.device, dtype=torch.float32)
            gv = torch.empty(splits, m, device=xs.device, dtype=torch.float32)
            fire(_grad_kernel, (cdiv(m, bn), splits), *head, gy, gv, *tail, per, *strides,
                 COLUMNS=True, SPARSE=False, **flags)  # fmt: skip
            gy, gv = gy.sum(0), gv.sum(0)
    return gx, gy, gv
