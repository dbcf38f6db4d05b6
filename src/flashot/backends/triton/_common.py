"""Device functions the streaming kernels share: score tiles, softmax weights, values.

Scores are computed in base 2, ``t_ij = (⟨q_i, k_j⟩ + h_j) · log2(e)/ε``, so every
exponential is one ``exp2``. Features are tiled over d in BLOCK_D chunks (``D_CHUNKS``
of them); with one chunk the stationary tile is loaded once; ``-inf`` biases mark zero
weights. The ops (:mod:`._attend`, :mod:`._plan_sums`, :mod:`._update`, :mod:`._vjp`)
build their kernels from these.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashot.backends import temperature as _row
from flashot.backends.triton import _split

# fmt: off
LOG2E = tl.constexpr(_row.LOG2E)  # (the host's, :mod:`flashot.backends.temperature`)
#: a temperature row's columns and the bits of ``temp_at`` (:mod:`flashot.backends.temperature`)
EPS, SCALE, RATIO, LAM_X, LAM_Y = (tl.constexpr(c) for c in (_row.EPS, _row.SCALE, _row.RATIO,
                                                            _row.LAM_X, _row.LAM_Y))  # fmt: skip
READ_RATIO, READ_DAMPING = tl.constexpr(_row.READ_RATIO), tl.constexpr(_row.READ_DAMPING)
#: a value product's split: values and weights keep their low halves scaled by 2^11
VALUE_LO_BITS = tl.constexpr(_split.VALUE_LO_BITS)
#: scalar control pointers (gates, the error sum, repair bounds): views at any offset of
#: small state buffers. Specialized on their alignment, one set of constexprs compiled
#: again per offset (the GeomLoss call's first call on the H200: 3 plan-sums, 2 attend
#: and 2 update builds of one set, 0.3–0.65 s each)
CONTROL_POINTERS = {
    "_attend_kernel": ["LO", "TEMP"],
    "_combine_kernel": ["TEMP"],
    "_plan_sums_kernel": ["GATE_IN", "GATE_OUT", "TEMP"],
    "_update_kernel": ["ERR", "GATE", "LO", "TEMP"],
}
#: integer arguments that change between launches of one set of constexprs: Triton
#: compiles an int again when it is 1 or a multiple of 16 (a flag 0/1, a split count)
#: (the combine's row count too: a 2 µs merge, rebuilt for a count not a multiple of 16)
#: (``temp_at``: read the temperature from ``TEMP``, a device row,
#: :mod:`flashot.backends.temperature`)
RUNTIME_INTS = {"_attend_kernel": ["temp_at"], "_combine_kernel": ["n", "splits", "temp_at"],
                "_plan_sums_kernel": ["gate_span", "temp_at"], "_update_kernel": ["temp_at"]}


@triton.jit
def _rows_in(offs, size):
    """Row offsets clamped into ``[0, size)``: a tile's rows past the tail repeat the last.

    Loads at clamped rows need no row mask. The repeated rows' scores are finite and
    meet a ``-inf`` side term (zero weight) wherever a kernel reduces over them, and their
    own outputs are masked at the store. ``size`` ≥ 1. (The hoisted tiles of
    :func:`_load_tile` keep masks: measured faster at d = 3.)
    """
    return tl.minimum(offs, size - 1)


@triton.jit
def _load_tile(X, offs, size, d, stride_n, stride_d, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """A (len(offs), BLOCK_D) tile of X, or its transpose, hoisted out of a streaming loop.

    Only when d fits in one chunk; a dummy otherwise. Rows past ``size`` and features
    past d are zeros: masked, not clamped (:func:`_rows_in`), since the clamped loads cost
    the d = 3 fused pass 11 % on an H100 (v46: 9.6 → 10.7 ms for 11 launches at 50k; 1 %
    the other way at d = 64), though its loop counts fewer instructions.
    """
    offs_d = tl.arange(0, BLOCK_D)
    if D_CHUNKS == 1:
        if TRANSPOSED:
            t = tl.load(
                X + offs[None, :] * stride_n + offs_d[:, None] * stride_d,
                mask=(offs[None, :] < size) & (offs_d[:, None] < d),
                other=0.0,
            )
        else:
            t = tl.load(
                X + offs[:, None] * stride_n + offs_d[None, :] * stride_d,
                mask=(offs[:, None] < size) & (offs_d[None, :] < d),
                other=0.0,
            )
    else:
        if TRANSPOSED:
            t = tl.zeros((BLOCK_D, offs.shape[0]), dtype=X.dtype.element_ty)
        else:
            t = tl.zeros((offs.shape[0], BLOCK_D), dtype=X.dtype.element_ty)
    return t


@triton.jit
def _split_dot(a_hi, a_lo, b_hi, b_lo, LO_BITS: tl.constexpr = 0):
    """``a·b`` of parts split as ``x = hi + 2^-LO_BITS lo`` (:mod:`._split`): three MMAs.

    The low terms first (scaled back by ``2^-LO_BITS`` when it is not 0: values and
    weights), the high product added onto them in the same accumulator. That non-zero
    accumulator keeps a caller's later ``s += _split_dot(...)`` a rounded float32 add:
    Triton folds an add of a zero-accumulator dot into the MMA, whose accumulator
    truncates (see ``_split``).
    """
    c = tl.dot(a_hi, b_lo)
    c = tl.dot(a_lo, b_hi, c)
    if LO_BITS != 0:
        c = c * (2.0**-LO_BITS)
    return tl.dot(a_hi, b_hi, c)


@triton.jit
def _score_tile(
    Q, K, q_tile, kt_tile, offs_m, offs_n, n, m, d, stride_qn, stride_qd, stride_kn, stride_kd,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, HOIST_K: tl.constexpr, PRECISION: tl.constexpr,
    q_lo_tile, kt_lo_tile, q_lo, k_lo, PRESPLIT: tl.constexpr,
):
    """``⟨q_i, k_j⟩`` for one (BLOCK_M, BLOCK_N) tile, in float32.

    With one chunk the stationary side comes hoisted (``q_tile``, or ``kt_tile`` with
    HOIST_K) and the other side is loaded; with several chunks both are loaded per chunk.
    With PRESPLIT the operands are split once per solve into half-precision parts,
    ``2^e x = hi + lo`` (the low parts ``q_lo``/``k_lo`` elements after the high
    ones, hoisted as ``q_lo_tile``/``kt_lo_tile``): three half MMAs,
    ``⟨q, k⟩ = unscale · (hi·hi' + hi·lo' + lo·hi')``, about 22 bits like
    3xTF32 but with no split of the streamed tile in the loop. Per chunk the low terms
    come first and the high product adds onto them; chunks are summed in float32. The
    tile comes *without* ``unscale`` (:func:`_stationary_tiles`, a power of two, 1
    without PRESPLIT): callers fold it into the factor they multiply scores by, one
    multiply per score fewer.

    PRECISION ``"cached"`` / ``"cached_t"``: the scores are in memory (:mod:`._scores`):
    ``Q`` addresses the matrix, score (i, j) at ``i·stride_qn + j`` (row-major) or
    ``i + j·stride_qd`` (its transpose); nothing else is read. 64-bit offsets for the
    strided side only (a tile's pointers cost one 64-bit add a score). Masked tails
    read 0 (finite, as the clamped rows of :func:`_rows_in` are).
    """
    if PRECISION == "cached":  # (masked, not clamped: contiguous columns load as vectors)
        ok = (offs_m[:, None] < n) & (offs_n[None, :] < m)
        rows = offs_m.to(tl.int64) * stride_qn
        s = tl.load(Q + rows[:, None] + offs_n[None, :], mask=ok, other=0.0)
    elif PRECISION == "cached_t":
        ok = (offs_m[:, None] < n) & (offs_n[None, :] < m)
        cols = offs_n.to(tl.int64) * stride_qd
        s = tl.load(Q + cols[None, :] + offs_m[:, None], mask=ok, other=0.0)
    elif D_CHUNKS == 1:  # the streamed side loaded (and its low part), the other hoisted
        if HOIST_K:
            q, kt = _load_tile(Q, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, 1, False), kt_tile
            q_lo_tile = q
            if PRESPLIT:
                q_lo_tile = _load_tile(Q + q_lo, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, 1,
                                       False)  # fmt: skip
        else:
            q, kt = q_tile, _load_tile(K, offs_n, m, d, stride_kn, stride_kd, BLOCK_D, 1, True)
            kt_lo_tile = kt
            if PRESPLIT:
                kt_lo_tile = _load_tile(K + k_lo, offs_n, m, d, stride_kn, stride_kd, BLOCK_D, 1,
                                        True)  # fmt: skip
        if PRESPLIT:
            s = _split_dot(q, q_lo_tile, kt, kt_lo_tile)
        else:
            s = tl.dot(q, kt, input_precision=PRECISION)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        s = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
        rows, cols = _rows_in(offs_m, n), _rows_in(offs_n, m)
        for ch in range(D_CHUNKS):
            dd = ch * BLOCK_D + offs_d
            q_ptrs = Q + rows[:, None] * stride_qn + dd[None, :] * stride_qd
            k_ptrs = K + cols[None, :] * stride_kn + dd[:, None] * stride_kd
            q_ok, k_ok = dd[None, :] < d, dd[:, None] < d
            q = tl.load(q_ptrs, mask=q_ok, other=0.0)
            kt = tl.load(k_ptrs, mask=k_ok, other=0.0)
            if PRESPLIT:
                # split chunks add in rounded float32, not in the MMA's truncating
                # accumulator (H200: a 13-chunk sum there drifted by 6e-4 on scores of
                # 250, 3xTF32's 4e-5)
                ql = tl.load(q_ptrs + q_lo, mask=q_ok, other=0.0)
                s += _split_dot(q, ql, kt, tl.load(k_ptrs + k_lo, mask=k_ok, other=0.0))
            else:
                s = tl.dot(q, kt, s, input_precision=PRECISION)
    return s


@triton.jit
def _side_load(P, OFFSET, LOG_W, offs, ok, FULL: tl.constexpr):
    """One tile's side vectors as stored: ``(p, offset, log w)``.

    Off the tail the log weight is ``-inf``; without FULL only ``p`` is loaded (``-inf``
    off the tail) and returned three times.
    """
    if FULL:
        p = tl.load(P + offs, mask=ok, other=0.0)
        offset = tl.load(OFFSET + offs, mask=ok, other=0.0)
        return p, offset, tl.load(LOG_W + offs, mask=ok, other=float("-inf"))
    p = tl.load(P + offs, mask=ok, other=float("-inf"))
    return p, p, p


@triton.jit
def _side_ahead(P, OFFSET, LOG_W, offs, hi, ahead_p, ahead_o, ahead_w):
    """This tile's side vectors (loaded one tile earlier), then the next tile's.

    A whole tile then hides the loads' latency, which in the sm_90 SASS otherwise only
    the tile's MMA covered (measured on the H200, fused pass at n = 50k: bf16 1.29 →
    1.16 ms, tf32 1.46 → 1.34 ms; the exact pass did not gain, see benchmarks/HISTORY.md v7).
    """
    nxt = offs + offs.shape[0]
    p, o, w = _side_load(P, OFFSET, LOG_W, nxt, nxt < hi, True)
    return ahead_p, ahead_o, ahead_w, p, o, w


@triton.jit
def _stationary_tiles(X, x_lo, offs, size, d, stride_n, stride_d, Q_INV, K_INV,
                      BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, TRANSPOSED: tl.constexpr,
                      PRESPLIT: tl.constexpr):  # fmt: skip
    """``(tile, low tile, unscale)``: a program's stationary operand, hoisted (:func:`_load_tile`).

    With PRESPLIT also its low half part (at offset ``x_lo``) and the parts' product of
    inverse scales ``Q_INV·K_INV`` (see :func:`_score_tile`); otherwise the tile twice
    and 1.
    """
    tile = _load_tile(X, offs, size, d, stride_n, stride_d, BLOCK_D, D_CHUNKS, TRANSPOSED)
    lo_tile = tile
    unscale = 1.0
    if PRESPLIT:
        lo_tile = _load_tile(X + x_lo, offs, size, d, stride_n, stride_d, BLOCK_D, D_CHUNKS,
                             TRANSPOSED)  # fmt: skip
        unscale = tl.load(Q_INV) * tl.load(K_INV)
    return tile, lo_tile, unscale


@triton.jit
def _block_range(BLOCKS, pid, BLOCK: tl.constexpr, size, other, SEGMENTED: tl.constexpr):
    """``(lo, end, other_lo, other_hi)``: program ``pid``'s stationary items and the moving range.

    One problem: items ``[pid·BLOCK, size)`` against ``[0, other)``; a packed batch
    (SEGMENTED, :mod:`flashot.geometry.segments`): row ``pid`` of the table ``BLOCKS``.
    """
    lo, end, other_lo, other_hi = pid * BLOCK, size, 0, other
    if SEGMENTED:
        lo, end = tl.load(BLOCKS + 4 * pid), tl.load(BLOCKS + 4 * pid + 1)
        other_lo, other_hi = tl.load(BLOCKS + 4 * pid + 2), tl.load(BLOCKS + 4 * pid + 3)
    return lo, end, other_lo, other_hi


@triton.jit
def _from_row(TEMP, temp_at, value, COLUMN: tl.constexpr):
    """A scalar argument, or with ``temp_at`` ≠ 0 column COLUMN of the temperature row."""
    if temp_at != 0:
        value = tl.load(TEMP + COLUMN)
    return value


@triton.jit
def _online_weights(s, h, run_max, scale):
    """Online max of one column tile (``h`` in base 2): ``(max, e, decay)``.

    ``e = 2^{t − max}`` are the tile's weights against the new running max, ``decay``
    rescales what was accumulated against the old one.
    """
    t = s * scale + h[None, :]
    new_max = tl.maximum(run_max, tl.max(t, 1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, tl.exp2(t - shift[:, None]), tl.exp2(run_max - shift)


@triton.jit
def _running_update(x, acc_max, acc_sum):
    """Elementwise running (max, sum) tiles, base 2, after one more tile of exponents ``x``.

    One exp per element, ``2^{−|x − M|}``: the larger side's term is 1. For reductions
    finished once per program (:func:`_running_total`) instead of once per tile.
    """
    top = tl.maximum(x, acc_max)
    e = tl.exp2(tl.minimum(x, acc_max) - tl.where(top == float("-inf"), 0.0, top))
    return top, tl.where(x > acc_max, acc_sum * e + 1.0, acc_sum + e)


@triton.jit
def _running_total(acc_max, acc_sum, AXIS: tl.constexpr):
    """``(max, sum)`` along AXIS of running tiles: the base-2 LSE is ``max + log2 sum``."""
    top = tl.max(acc_max, AXIS)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return top, tl.sum(acc_sum * tl.exp2(acc_max - tl.expand_dims(safe, AXIS)), AXIS)


@triton.jit
def _attend_weights(s, h, run_max, run_sum, scale):
    """:func:`_online_weights` and the running sum: ``(max, sum, e, decay)``."""
    new_max, e, decay = _online_weights(s, h, run_max, scale)
    return new_max, run_sum * decay + tl.sum(e, 1), e, decay


@triton.jit
def _value_product(
    e, V, offs_n, hi, offs_p, p, stride_vn, stride_vp, v_lo, v_unscale,
    V_PRECISION: tl.constexpr, V_SPLIT: tl.constexpr,
):
    """``e @ V[offs_n, offs_p]`` for one tile's weights and one chunk of value columns.

    Rows ``offs_n`` past ``hi`` repeat the last (:func:`_rows_in`): their weights are 0.

    V_SPLIT: the values come split once per solve like the score operands (``V`` the
    high parts, ``v_lo`` elements to the low ones, ``v_unscale`` their ``2^-e``); the
    weights ``e ∈ [0, 1]`` are split here the same way, ``hi + 2^-11 lo`` (absolute error
    2^-36 per weight): three half MMAs with float32 accumulation, the accuracy of
    3xTF32 at half its tensor-core work and with no split of the values per tile.
    """
    v_ok = offs_p[None, :] < p
    v_ptrs = V + _rows_in(offs_n, hi)[:, None] * stride_vn + offs_p[None, :] * stride_vp
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    if V_SPLIT:
        # .to(v.dtype): a no-op on the GPU; float32 parts under the interpreter
        e_hi = e.to(tl.float16).to(v.dtype)
        e_lo = ((e - e_hi.to(tl.float32)) * (2.0**VALUE_LO_BITS)).to(tl.float16).to(v.dtype)
        v_lo_part = tl.load(v_ptrs + v_lo, mask=v_ok, other=0.0)
        pv = _split_dot(e_hi, e_lo, v, v_lo_part, VALUE_LO_BITS)
        return pv * v_unscale
    return tl.dot(e.to(v.dtype), v, input_precision=V_PRECISION)


@triton.jit
def _value_chunk(base, stride_n, stride_p, offs_m, row_ok, c, p, BLOCK_P: tl.constexpr):
    """``(pointers, mask)`` of value chunk ``c`` of rows ``offs_m`` in a (rows, p) buffer."""
    offs_c = c * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = row_ok[:, None] & (offs_c[None, :] < p)
    return base + offs_m[:, None] * stride_n + offs_c[None, :] * stride_p, ok, offs_c
# fmt: on
