"""Triton kernels: FlashAttention-style streaming of biased score tiles.

Scores are computed in base 2, ``t_ij = (⟨q_i, k_j⟩ + h_j) · log2(e)/ε``, so every
exponential is one ``exp2``. The kernels:

* ``_attend_kernel`` (row-stationary, online max): a program owns BLOCK_M rows and
  streams the column tiles of its column split, keeping the running max, sum and
  (``HAS_V``) the running ``Σ_j 2^{t_ij − max} v_j`` on chip. Exact for any inputs.
  The bias is either given (``h``) or formed on the fly from a potential,
  ``h = g − β + ε log b`` (``POTENTIAL_BIAS``), which saves the host three launches.
* ``_combine_kernel`` (:mod:`._combine`) merges the partial (max, sum, acc) of column
  splits.
* ``_plan_sums_kernel`` (one exp per element for rows *and* columns, column-stationary):
  with ``E_ij = exp((⟨q_i, k_j⟩ + f_i − α_i + g_j − β_j)/ε)`` it accumulates
  ``R_i = Σ_j b_j E_ij`` and ``C_j = Σ_i a_i E_ij``. No max is tracked, so a sum is
  exact only while it lies in a range where its terms neither overflow nor underflow,
  which holds near the Sinkhorn fixed point (there ``a_i b_j E_ij = P_ij``).
* the same ``_attend_kernel`` with REPAIR recomputes, exactly, only the row blocks
  holding a sum out of that range; the fast path never needs the host to verify.
* ``_update_kernel``: both potential updates (Jacobi step, extrapolation or log-sums)
  from the valid sums or the repaired LSEs, the marginal error, and the extreme
  residuals ``ln R`` that gate the next fused launch, in one launch.

Features are tiled over d in BLOCK_D chunks (``D_CHUNKS`` of them); with one chunk the
stationary tile is loaded once; ``-inf`` biases mark zero weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashot.backends import temperature as _row

LOG2E = tl.constexpr(_row.LOG2E)  # (the host's, :mod:`flashot.backends.temperature`)
#: a temperature row's columns and the bits of ``temp_at`` (:mod:`flashot.backends.temperature`)
EPS, SCALE, RATIO, LAM_X, LAM_Y = (tl.constexpr(c) for c in (_row.EPS, _row.SCALE, _row.RATIO,
                                                            _row.LAM_X, _row.LAM_Y))  # fmt: skip
READ_RATIO, READ_DAMPING = tl.constexpr(_row.READ_RATIO), tl.constexpr(_row.READ_DAMPING)
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
def _load_tile(X, offs, size, d, stride_n, stride_d, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """A (len(offs), BLOCK_D) tile of X, or its transpose, hoisted out of a streaming loop.

    Only when d fits in one chunk; a dummy otherwise.
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
def _split_dot(a_hi, a_lo, b_hi, b_lo):
    """``a·b`` of split parts ``x = hi + 2^-11 lo``: the low terms, then the high product.

    Three MMAs; the high product starts from the low terms. That non-zero accumulator
    keeps a caller's later ``s += _split_dot(...)`` a rounded float32 add: Triton folds
    an add of a zero-accumulator dot into the MMA, whose accumulator truncates (see
    ``_split``).
    """
    c = tl.dot(a_hi, b_lo)
    c = tl.dot(a_lo, b_hi, c)
    return tl.dot(a_hi, b_hi, c * 0.00048828125)  # 2^-11


@triton.jit
def _score_tile(
    Q, K, q_tile, kt_tile, offs_m, offs_n, n, m, d, stride_qn, stride_qd, stride_kn, stride_kd,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, HOIST_K: tl.constexpr, PRECISION: tl.constexpr,
    q_lo_tile, kt_lo_tile, q_lo, k_lo, unscale, PRESPLIT: tl.constexpr,
):
    """``⟨q_i, k_j⟩`` for one (BLOCK_M, BLOCK_N) tile, in float32.

    With one chunk the stationary side comes hoisted (``q_tile``, or ``kt_tile`` with
    HOIST_K) and the other side is loaded; with several chunks both are loaded per chunk.
    With PRESPLIT the operands are split once per solve into half-precision parts,
    ``2^e x = hi + 2^-11 lo`` (the low parts ``q_lo``/``k_lo`` elements after the high
    ones, hoisted as ``q_lo_tile``/``kt_lo_tile``): three half MMAs,
    ``⟨q, k⟩ = unscale · (hi·hi' + 2^-11 (hi·lo' + lo·hi'))``, about 22 bits like
    3xTF32 but with no split of the streamed tile in the loop. Per chunk the low terms
    come first and the high product adds onto them; chunks are summed in float32.
    """
    if PRESPLIT:
        if D_CHUNKS == 1:
            if HOIST_K:
                q = _load_tile(Q, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, 1, False)
                ql = _load_tile(Q + q_lo, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, 1, False)
                s = _split_dot(q, ql, kt_tile, kt_lo_tile)
            else:
                kt = _load_tile(K, offs_n, m, d, stride_kn, stride_kd, BLOCK_D, 1, True)
                ktl = _load_tile(K + k_lo, offs_n, m, d, stride_kn, stride_kd, BLOCK_D, 1, True)
                s = _split_dot(q_tile, q_lo_tile, kt, ktl)
        else:
            # chunks add in rounded float32, not in the MMA's truncating accumulator (H200:
            # a 13-chunk sum there drifted by 6e-4 on scores of 250, 3xTF32's 4e-5)
            offs_d = tl.arange(0, BLOCK_D)
            s = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
            for ch in range(D_CHUNKS):
                dd = ch * BLOCK_D + offs_d
                q_ptrs = Q + offs_m[:, None] * stride_qn + dd[None, :] * stride_qd
                q_ok = (offs_m[:, None] < n) & (dd[None, :] < d)
                k_ptrs = K + offs_n[None, :] * stride_kn + dd[:, None] * stride_kd
                k_ok = (offs_n[None, :] < m) & (dd[:, None] < d)
                q = tl.load(q_ptrs, mask=q_ok, other=0.0)
                kt = tl.load(k_ptrs, mask=k_ok, other=0.0)
                s += _split_dot(q, tl.load(q_ptrs + q_lo, mask=q_ok, other=0.0), kt,
                                tl.load(k_ptrs + k_lo, mask=k_ok, other=0.0))  # fmt: skip
        return s * unscale
    if D_CHUNKS == 1:
        if HOIST_K:
            q = _load_tile(Q, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, 1, False)
            s = tl.dot(q, kt_tile, input_precision=PRECISION)
        else:
            kt = _load_tile(K, offs_n, m, d, stride_kn, stride_kd, BLOCK_D, 1, True)
            s = tl.dot(q_tile, kt, input_precision=PRECISION)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        s = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
        for c in range(D_CHUNKS):
            dd = c * BLOCK_D + offs_d
            q = tl.load(
                Q + offs_m[:, None] * stride_qn + dd[None, :] * stride_qd,
                mask=(offs_m[:, None] < n) & (dd[None, :] < d),
                other=0.0,
            )
            kt = tl.load(
                K + offs_n[None, :] * stride_kn + dd[:, None] * stride_kd,
                mask=(offs_n[None, :] < m) & (dd[:, None] < d),
                other=0.0,
            )
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
def _attend_weights(s, h, run_max, run_sum, scale):
    """:func:`_online_weights` and the running sum: ``(max, sum, e, decay)``."""
    new_max, e, decay = _online_weights(s, h, run_max, scale)
    return new_max, run_sum * decay + tl.sum(e, 1), e, decay


@triton.jit
def _value_product(
    e, V, offs_n, col_ok, offs_p, p, stride_vn, stride_vp, v_lo, v_unscale,
    V_PRECISION: tl.constexpr, V_SPLIT: tl.constexpr,
):
    """``e @ V[offs_n, offs_p]`` for one tile's weights and one chunk of value columns.

    V_SPLIT: the values come split once per solve like the score operands (``V`` the
    high parts, ``v_lo`` elements to the low ones, ``v_unscale`` their ``2^-e``); the
    weights ``e ∈ [0, 1]`` are split here into half ``hi + 2^-11 lo`` (absolute error
    2^-36 per weight): three half MMAs with float32 accumulation, the accuracy of
    3xTF32 at half its tensor-core work and with no split of the values per tile.
    """
    v_ok = col_ok[:, None] & (offs_p[None, :] < p)
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_p[None, :] * stride_vp
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    if V_SPLIT:
        # .to(v.dtype): a no-op on the GPU; float32 parts under the interpreter
        e_hi = e.to(tl.float16).to(v.dtype)
        e_lo = ((e - e_hi.to(tl.float32)) * 2048.0).to(tl.float16).to(v.dtype)
        pv = _split_dot(e_hi, e_lo, v, tl.load(v_ptrs + v_lo, mask=v_ok, other=0.0))
        return pv * v_unscale
    return tl.dot(e.to(v.dtype), v, input_precision=V_PRECISION)


@triton.jit
def _value_chunk(base, stride_n, stride_p, offs_m, row_ok, c, p, BLOCK_P: tl.constexpr):
    """``(pointers, mask)`` of value chunk ``c`` of rows ``offs_m`` in a (rows, p) buffer."""
    offs_c = c * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = row_ok[:, None] & (offs_c[None, :] < p)
    return base + offs_m[:, None] * stride_n + offs_c[None, :] * stride_p, ok, offs_c


@triton.jit(
    do_not_specialize=RUNTIME_INTS["_attend_kernel"],
    do_not_specialize_on_alignment=CONTROL_POINTERS["_attend_kernel"],
)
def _attend_kernel(
    Q, K, H, BETA, LOG_W, V, LSE, OUT, PART_MAX, PART_SUM, PART_ACC, BLOCKS, S, n, m, d, p, scale,
    eps, TEMP, temp_at, LO,
    hi, cols_per_split, stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vp,
    stride_on, stride_op, n_bucket, m_bucket, Q_INV, K_INV, q_lo, k_lo, V_INV, v_lo,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, D_CHUNKS: tl.constexpr, HAS_V: tl.constexpr,
    SPLIT: tl.constexpr, POTENTIAL_BIAS: tl.constexpr, REPAIR: tl.constexpr,
    PRECISION: tl.constexpr, V_PRECISION: tl.constexpr, PRESPLIT: tl.constexpr,
    V_SPLIT: tl.constexpr, SEGMENTED: tl.constexpr, P_LOOP: tl.constexpr = 1,
):
    """Row LSE ``ε ln Σ_j e^{(s_ij + h_j)/ε}`` and softmax average of V over one column split.

    Grid: (row blocks, column splits, value chunks of BLOCK_P). Without SPLIT the
    program finalizes (LSE, OUT); with SPLIT it writes (max, sum, acc) partials for
    ``_combine_kernel``. With REPAIR, a row block whose plan sums ``S`` all lie in
    ``(LO[0], hi)`` (the fused pass was valid there) streams nothing and its outputs are
    meaningless. ``n_bucket``/``m_bucket`` only key the autotuner. PRESPLIT: see
    ``_score_tile`` (``Q_INV``, ``K_INV``: the parts' inverse scales ``2^-e``); V_SPLIT:
    see ``_value_product`` (``V_INV``, ``v_lo``: the values' scale and low parts' offset).
    P_LOOP > 1: one program takes all P_LOOP chunks of BLOCK_P value columns (grid axis
    2 is 1), each tile's weights computed once, and keeps the running products in OUT
    (or its split's PART_ACC) instead of registers: a chunk costs a load and a store of
    (BLOCK_M, BLOCK_P) floats per tile, where a program per chunk recomputes the scores.
    SEGMENTED (a packed batch, :mod:`flashot.geometry.segments`): program ``pid_m`` reads its rows
    ``[r0, r1)`` and its problem's columns ``[c0, c1)`` from the table ``BLOCKS``.
    ``temp_at`` ≠ 0: ε and ``scale`` are read from the row ``TEMP`` (``_from_row``).
    """
    eps, scale = _from_row(TEMP, temp_at, eps, EPS), _from_row(TEMP, temp_at, scale, SCALE)
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_p = tl.program_id(2)
    row_lo, row_end, seg_lo, seg_hi = pid_m * BLOCK_M, n, 0, m
    if SEGMENTED:
        row_lo, row_end = tl.load(BLOCKS + 4 * pid_m), tl.load(BLOCKS + 4 * pid_m + 1)
        seg_lo, seg_hi = tl.load(BLOCKS + 4 * pid_m + 2), tl.load(BLOCKS + 4 * pid_m + 3)
    offs_m = row_lo + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    row_ok = offs_m < row_end
    col_lo = seg_lo + pid_s * cols_per_split
    col_hi = tl.minimum(seg_hi, col_lo + cols_per_split)
    if REPAIR:  # an empty column range when every row of the block is valid
        sums = tl.load(S + offs_m, mask=row_ok, other=1.0)
        lo = tl.load(LO)  # on the device: it depends on the weights, and nobody waits
        bad = row_ok & ((sums <= lo) | (sums >= hi) | (sums != sums))
        col_hi = tl.where(tl.max(bad.to(tl.int32), 0) > 0, col_hi, col_lo)
    q_tile = _load_tile(Q, offs_m, row_end, d, stride_qn, stride_qd, BLOCK_D, D_CHUNKS, False)
    q_lo_tile = q_tile
    unscale = 1.0
    if PRESPLIT:
        q_lo_tile = _load_tile(Q + q_lo, offs_m, row_end, d, stride_qn, stride_qd, BLOCK_D,
                               D_CHUNKS, False)  # fmt: skip
        unscale = tl.load(Q_INV) * tl.load(K_INV)
    v_unscale = 1.0
    if V_SPLIT:
        v_unscale = tl.load(V_INV)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    acc_base, acc_sn, acc_sp = OUT, stride_on, stride_op  # (P_LOOP > 1: the running products)
    if SPLIT:
        acc_base, acc_sn, acc_sp = PART_ACC + pid_s * n * p, p, 1
    for start in range(col_lo, col_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < col_hi
        g, beta, log_w = _side_load(H, BETA, LOG_W, offs_n, col_ok, POTENTIAL_BIAS)
        s = _score_tile(
            Q, K, q_tile, q_tile, offs_m, offs_n, row_end, col_hi, d, stride_qn, stride_qd,
            stride_kn,
            stride_kd, BLOCK_D, D_CHUNKS, False, PRECISION, q_lo_tile, q_lo_tile, q_lo, k_lo,
            unscale, PRESPLIT,
        )
        if POTENTIAL_BIAS:  # noqa: SIM108 (a compile-time branch) h = g − β + ε log b, base 2
            h = (g - beta) * scale + log_w * LOG2E
        else:
            h = g * scale
        run_max, run_sum, e, decay = _attend_weights(s, h, run_max, run_sum, scale)
        if HAS_V:
            if P_LOOP == 1:
                pv = _value_product(e, V, offs_n, col_ok, offs_p, p, stride_vn, stride_vp, v_lo,
                                    v_unscale, V_PRECISION, V_SPLIT)  # fmt: skip
                acc = acc * decay[:, None] + pv
            else:
                tl.debug_barrier()  # the last tile's stores (other threads') land first
                for c in range(P_LOOP):
                    ptrs, ok_c, offs_c = _value_chunk(acc_base, acc_sn, acc_sp, offs_m, row_ok, c,
                                                      p, BLOCK_P)  # fmt: skip
                    prior = tl.load(ptrs, mask=ok_c & (start > col_lo), other=0.0)
                    pv = _value_product(e, V, offs_n, col_ok, offs_c, p, stride_vn, stride_vp,
                                        v_lo, v_unscale, V_PRECISION, V_SPLIT)  # fmt: skip
                    tl.store(ptrs, prior * decay[:, None] + pv, mask=ok_c)
    if HAS_V and P_LOOP > 1:  # zeros where no column was streamed; OUT divided by the sum
        tl.debug_barrier()
        for c in range(P_LOOP):
            ptrs, ok_c, _ = _value_chunk(acc_base, acc_sn, acc_sp, offs_m, row_ok, c, p, BLOCK_P)
            total = tl.load(ptrs, mask=ok_c & (col_hi > col_lo), other=0.0)
            if not SPLIT:
                total = total / run_sum[:, None]
            tl.store(ptrs, total, mask=ok_c)
    if SPLIT:
        idx = pid_s * n + offs_m
        if pid_p == 0:
            tl.store(PART_MAX + idx, run_max, mask=row_ok)
            tl.store(PART_SUM + idx, run_sum, mask=row_ok)
        if HAS_V and P_LOOP == 1:
            ptrs = PART_ACC + idx[:, None] * p + offs_p[None, :]
            tl.store(ptrs, acc, mask=row_ok[:, None] & (offs_p[None, :] < p))
    else:
        if pid_p == 0:
            tl.store(LSE + offs_m, eps * (run_max + tl.log2(run_sum)) / LOG2E, mask=row_ok)
        if HAS_V and P_LOOP == 1:
            out = acc / run_sum[:, None]
            ptrs = OUT + offs_m[:, None] * stride_on + offs_p[None, :] * stride_op
            tl.store(ptrs, out, mask=row_ok[:, None] & (offs_p[None, :] < p))


@triton.jit
def _side_terms(p, offset, log_w, ok, scale):
    """One side's exponent share ``(p − offset)·scale`` (``-inf`` off the tail) and weights."""
    return tl.where(ok, (p - offset) * scale, float("-inf")), tl.exp(log_w)


@triton.jit(
    do_not_specialize=RUNTIME_INTS["_plan_sums_kernel"],
    do_not_specialize_on_alignment=CONTROL_POINTERS["_plan_sums_kernel"],
)
def _plan_sums_kernel(
    Q, K, F, ALPHA, G, BETA, LOG_A, LOG_B, R, C, GATE_IN, GATE_OUT, MUL_A, MUL_B, R_DEN, C_DEN,
    BLOCKS, n, m, d, scale, shift, gate_limit, gate_span, TEMP, temp_at, rows_per_split,
    stride_qn, stride_qd,
    stride_kn, stride_kd, n_bucket, m_bucket, Q_INV, K_INV, q_lo, k_lo,
    ROW_LSE, COL_MAX, COL_SUM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, GATED: tl.constexpr, MULTIPLY: tl.constexpr,
    PRECISION: tl.constexpr, PRESPLIT: tl.constexpr, SEGMENTED: tl.constexpr,
    EXACT: tl.constexpr = False,
):
    """``R_i += Σ_j b_j E_ij`` and ``C_j += Σ_i a_i E_ij``, one exp2 per element.

    With MULTIPLY the weights are ``b_j·MUL_B_j`` and ``a_i·MUL_A_i`` (plan products), and
    the plain sums go to ``R_DEN`` and ``C_DEN`` (their ratios are weighted averages).

    ``E_ij = 2^{(s_ij + f_i − α_i + g_j − β_j)·scale + shift}``: ``shift`` (base 2) puts the
    window of exactly summable residuals where they are expected (see ``valid_range``).
    Column-stationary: a program keeps BLOCK_N columns on chip and streams the row tiles
    of its row split. Column sums accumulate elementwise in a (BLOCK_M, BLOCK_N) register
    tile and are reduced once at the end; row sums are reduced along the tile's cheap
    axis (within a thread and a quad of lanes). Both are added atomically: R and C must
    be zeroed.
    With GATED, nothing is streamed when the bound read from ``GATE_IN`` (the last
    step's largest ``ln R`` and ``−ln R``, rows and columns; with ``gate_span`` half
    their sum, else the larger) exceeds ``gate_limit``, and program (0, 0) zeroes
    ``GATE_OUT``, which the update kernel then fills. Grid: (column blocks, row splits).
    SEGMENTED (a packed batch): program ``pid_n`` reads its columns ``[c0, c1)`` and its
    problem's rows ``[r0, r1)`` from the table ``BLOCKS``.
    EXACT (not GATED, MULTIPLY nor SEGMENTED; R, C, shift unused): both LSEs with no
    window, as base-2 partials for ``_combine_kernel``. Each row tile's base-2 LSE over
    the program's columns goes to ``ROW_LSE[pid_n, i]`` (reduced along the cheap axis;
    one float, so the row partials take half the memory of a (max, sum) pair); the
    columns keep an elementwise running (max, sum)
    tile, one exp per update (``2^{−|x − M|}``: the larger side's term is 1), reduced
    once at the end into ``COL_MAX``/``COL_SUM[pid_s, j]``. Two exps per score and no
    reduction across warps in the loop.
    ``temp_at`` ≠ 0: ``scale`` is read from ``TEMP``; with READ_RATIO also the ratio of this
    temperature to the last, which scales ``gate_limit``.
    """
    scale = _from_row(TEMP, temp_at, scale, SCALE)
    if (temp_at & READ_RATIO) != 0:
        gate_limit = gate_limit * tl.load(TEMP + RATIO)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    col_lo, col_end, seg_lo, seg_hi = pid_n * BLOCK_N, m, 0, n
    if SEGMENTED:
        col_lo, col_end = tl.load(BLOCKS + 4 * pid_n), tl.load(BLOCKS + 4 * pid_n + 1)
        seg_lo, seg_hi = tl.load(BLOCKS + 4 * pid_n + 2), tl.load(BLOCKS + 4 * pid_n + 3)
    offs_n = col_lo + tl.arange(0, BLOCK_N)
    col_ok = offs_n < col_end
    row_lo = seg_lo + pid_s * rows_per_split
    row_hi = tl.minimum(seg_hi, row_lo + rows_per_split)
    if GATED:
        top, bottom = tl.load(GATE_IN), tl.load(GATE_IN + 1)
        bound = tl.where(gate_span != 0, 0.5 * (top + bottom), tl.maximum(top, bottom))
        row_hi = tl.where(bound <= gate_limit, row_hi, row_lo)
        if (pid_n == 0) & (pid_s == 0):
            tl.store(GATE_OUT, 0.0)
            tl.store(GATE_OUT + 1, 0.0)
    kt_tile = _load_tile(K, offs_n, col_end, d, stride_kn, stride_kd, BLOCK_D, D_CHUNKS, True)
    kt_lo_tile = kt_tile
    unscale = 1.0
    if PRESPLIT:
        kt_lo_tile = _load_tile(K + k_lo, offs_n, col_end, d, stride_kn, stride_kd, BLOCK_D,
                                D_CHUNKS, True)  # fmt: skip
        unscale = tl.load(Q_INV) * tl.load(K_INV)
    g, beta, log_b = _side_load(G, BETA, LOG_B, offs_n, col_ok, True)
    v, b = _side_terms(g, beta, log_b, col_ok, scale)
    b_den = b
    if MULTIPLY:
        b = b * tl.load(MUL_B + offs_n, mask=col_ok, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_den = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EXACT:  # acc holds the columns' running max (acc_den their sums); v its log2 weights
        acc = tl.full((BLOCK_M, BLOCK_N), float("-inf"), dtype=tl.float32)
        v = v + log_b * LOG2E
    first = row_lo + tl.arange(0, BLOCK_M)
    ah_p, ah_o, ah_w = _side_load(F, ALPHA, LOG_A, first, first < row_hi, True)
    for start in range(row_lo, row_hi, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < row_hi
        f, alpha, log_a, ah_p, ah_o, ah_w = _side_ahead(
            F, ALPHA, LOG_A, offs_m, row_hi, ah_p, ah_o, ah_w
        )
        s = _score_tile(
            Q, K, kt_tile, kt_tile, offs_m, offs_n, row_hi, col_end, d, stride_qn, stride_qd,
            stride_kn, stride_kd, BLOCK_D, D_CHUNKS, True, PRECISION, kt_lo_tile, kt_lo_tile,
            q_lo, k_lo, unscale, PRESPLIT,
        )
        u, a = _side_terms(f, alpha, log_a, row_ok, scale)
        if EXACT:
            x = s * scale + v[None, :]
            r_max = tl.max(x, 1)
            r_sum = tl.sum(tl.exp2(x - tl.where(r_max == float("-inf"), 0.0, r_max)[:, None]), 1)
            r_lse = r_max + tl.log2(r_sum)  # -inf when every term is (r_sum 0)
            tl.store(ROW_LSE + pid_n.to(tl.int64) * n + offs_m, r_lse, mask=row_ok)
            x = s * scale + (u + log_a * LOG2E)[:, None]
            top = tl.maximum(x, acc)
            e = tl.exp2(tl.minimum(x, acc) - tl.where(top == float("-inf"), 0.0, top))
            acc_den = tl.where(x > acc, acc_den * e + 1.0, acc_den + e)
            acc = top
        else:
            e = tl.exp2(s * scale + (u + shift)[:, None] + v[None, :])
            if MULTIPLY:
                tl.atomic_add(R_DEN + offs_m, tl.sum(e * b_den[None, :], 1), mask=row_ok,
                              sem="relaxed")  # fmt: skip
                acc_den += e * a[:, None]
                a = a * tl.load(MUL_A + offs_m, mask=row_ok, other=0.0)
            tl.atomic_add(R + offs_m, tl.sum(e * b[None, :], 1), mask=row_ok, sem="relaxed")
            acc += e * a[:, None]
    if EXACT:
        top = tl.max(acc, 0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(acc_den * tl.exp2(acc - top_safe[None, :]), 0)
        tl.store(COL_MAX + pid_s * m + offs_n, top, mask=col_ok)
        tl.store(COL_SUM + pid_s * m + offs_n, total, mask=col_ok)
    elif row_hi > row_lo:
        tl.atomic_add(C + offs_n, tl.sum(acc, 0), mask=col_ok, sem="relaxed")
        if MULTIPLY:
            tl.atomic_add(C_DEN + offs_n, tl.sum(acc_den, 0), mask=col_ok, sem="relaxed")


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
