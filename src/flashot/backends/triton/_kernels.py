"""Triton kernels: FlashAttention-style streaming of biased score tiles.

Scores are computed in base 2, ``t_ij = (⟨q_i, k_j⟩ + h_j) · log2(e)/ε``, so every
exponential is one ``exp2``. The kernels:

* ``_attend_kernel`` (row-stationary, online max): a program owns BLOCK_M rows and
  streams the column tiles of its column split, keeping the running max, sum and
  (``HAS_V``) the running ``Σ_j 2^{t_ij − max} v_j`` on chip. Exact for any inputs.
  The bias is either given (``h``) or formed on the fly from a potential,
  ``h = g − β + ε log b`` (``POTENTIAL_BIAS``), which saves the host three launches.
* ``_combine_kernel`` merges the partial (max, sum, acc) of column splits.
* ``_plan_sums_kernel`` (one exp per element for rows *and* columns): with
  ``E_ij = exp((⟨q_i, k_j⟩ + f_i − α_i + g_j − β_j)/ε)`` it accumulates
  ``R_i = Σ_j b_j E_ij`` and, with atomics, ``C_j = Σ_i a_i E_ij``. No max is tracked,
  so it is exact only while E neither overflows nor underflows, which holds near the
  Sinkhorn fixed point (there ``a_i b_j E_ij = P_ij``); callers verify.
* ``_update_kernel``: the averaged Jacobi update of both potentials from their plan
  sums (or LSEs), the marginal error, and the fast path's failure flag, in one launch.

Features are tiled over d in BLOCK_D chunks (``D_CHUNKS`` of them); with one chunk the
row tile is loaded once. Tails are masked; ``-inf`` biases mark zero weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _score_tile(
    Q, K, q_tile, offs_m, offs_n, n, m, d, stride_qn, stride_qd, stride_kn, stride_kd,
    BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, PRECISION: tl.constexpr,
):
    """``⟨q_i, k_j⟩`` for one (BLOCK_M, BLOCK_N) tile, in float32."""
    offs_d = tl.arange(0, BLOCK_D)
    if D_CHUNKS == 1:
        kt = tl.load(
            K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=(offs_n[None, :] < m) & (offs_d[:, None] < d),
            other=0.0,
        )
        s = tl.dot(q_tile, kt, input_precision=PRECISION)
    else:
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
def _load_rows(
    Q, offs_m, n, d, stride_qn, stride_qd, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr
):
    """The row tile when it fits in one chunk (hoisted out of the column loop), else a dummy."""
    offs_d = tl.arange(0, BLOCK_D)
    if D_CHUNKS == 1:
        q = tl.load(
            Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
            mask=(offs_m[:, None] < n) & (offs_d[None, :] < d),
            other=0.0,
        )
    else:
        q = tl.zeros((offs_m.shape[0], BLOCK_D), dtype=Q.dtype.element_ty)
    return q


@triton.jit
def _attend_kernel(
    Q, K, H, BETA, LOG_W, V, LSE, OUT, PART_MAX, PART_SUM, PART_ACC, n, m, d, p, scale, eps,
    cols_per_split, stride_qn, stride_qd, stride_kn, stride_kd, stride_vn, stride_vp, stride_on,
    stride_op, n_bucket, m_bucket, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, D_CHUNKS: tl.constexpr, HAS_V: tl.constexpr,
    SPLIT: tl.constexpr, POTENTIAL_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    V_PRECISION: tl.constexpr,
):
    """Row LSE ``ε ln Σ_j e^{(s_ij + h_j)/ε}`` and softmax average of V over one column split.

    Grid: (row blocks, column splits, value chunks of BLOCK_P). Without SPLIT the
    program finalizes (LSE, OUT); with SPLIT it writes (max, sum, acc) partials for
    ``_combine_kernel``. ``n_bucket``/``m_bucket`` only key the autotuner.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_p = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    col_lo = pid_s * cols_per_split
    col_hi = tl.minimum(m, col_lo + cols_per_split)
    q_tile = _load_rows(Q, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, D_CHUNKS)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for start in range(col_lo, col_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < col_hi
        s = _score_tile(
            Q, K, q_tile, offs_m, offs_n, n, col_hi, d, stride_qn, stride_qd, stride_kn, stride_kd,
            BLOCK_D, D_CHUNKS, PRECISION,
        )
        if POTENTIAL_BIAS:  # h = g − β + ε log b, in base-2 units
            g = tl.load(H + offs_n, mask=col_ok, other=0.0)
            beta = tl.load(BETA + offs_n, mask=col_ok, other=0.0)
            log_w = tl.load(LOG_W + offs_n, mask=col_ok, other=float("-inf"))
            h = (g - beta) * scale + log_w * LOG2E
        else:
            h = tl.load(H + offs_n, mask=col_ok, other=float("-inf")) * scale
        t = s * scale + h[None, :]
        new_max = tl.maximum(run_max, tl.max(t, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        decay = tl.exp2(run_max - shift)
        e = tl.exp2(t - shift[:, None])
        run_sum = run_sum * decay + tl.sum(e, 1)
        if HAS_V:
            v = tl.load(
                V + offs_n[:, None] * stride_vn + offs_p[None, :] * stride_vp,
                mask=col_ok[:, None] & (offs_p[None, :] < p),
                other=0.0,
            )
            acc = acc * decay[:, None] + tl.dot(e.to(v.dtype), v, input_precision=V_PRECISION)
        run_max = new_max
    row_ok = offs_m < n
    if SPLIT:
        idx = pid_s * n + offs_m
        if pid_p == 0:
            tl.store(PART_MAX + idx, run_max, mask=row_ok)
            tl.store(PART_SUM + idx, run_sum, mask=row_ok)
        if HAS_V:
            ptrs = PART_ACC + idx[:, None] * p + offs_p[None, :]
            tl.store(ptrs, acc, mask=row_ok[:, None] & (offs_p[None, :] < p))
    else:
        if pid_p == 0:
            tl.store(LSE + offs_m, eps * (run_max + tl.log2(run_sum)) / LOG2E, mask=row_ok)
        if HAS_V:
            out = acc / run_sum[:, None]
            ptrs = OUT + offs_m[:, None] * stride_on + offs_p[None, :] * stride_op
            tl.store(ptrs, out, mask=row_ok[:, None] & (offs_p[None, :] < p))


@triton.jit
def _combine_kernel(
    PART_MAX, PART_SUM, PART_ACC, LSE, OUT, n, p, splits, eps, stride_on, stride_op,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, HAS_V: tl.constexpr,
):
    """Merge column-split partials: ``M = max_s m_s``, ``L = Σ_s l_s 2^{m_s − M}``, same for acc."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_p = tl.arange(0, BLOCK_P)
    ok = offs < n
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for s in range(splits):
        top = tl.maximum(top, tl.load(PART_MAX + s * n + offs, mask=ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_P), dtype=tl.float32)
    for s in range(splits):
        w = tl.exp2(tl.load(PART_MAX + s * n + offs, mask=ok, other=float("-inf")) - top)
        total += w * tl.load(PART_SUM + s * n + offs, mask=ok, other=0.0)
        if HAS_V:
            part = tl.load(
                PART_ACC + (s * n + offs)[:, None] * p + offs_p[None, :],
                mask=ok[:, None] & (offs_p[None, :] < p),
                other=0.0,
            )
            acc += w[:, None] * part
    tl.store(LSE + offs, eps * (top + tl.log2(total)) / LOG2E, mask=ok)
    if HAS_V:
        ptrs = OUT + offs[:, None] * stride_on + offs_p[None, :] * stride_op
        tl.store(ptrs, acc / total[:, None], mask=ok[:, None] & (offs_p[None, :] < p))


@triton.jit
def _plan_sums_kernel(
    Q, K, F, ALPHA, G, BETA, LOG_A, LOG_B, R, C, n, m, d, scale, cols_per_split, stride_qn,
    stride_qd, stride_kn, stride_kd, n_bucket, m_bucket, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr, COLUMNS: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    """``R_i = Σ_j b_j E_ij`` and (COLUMNS) ``C_j += Σ_i a_i E_ij``, one exp2 per element.

    ``E_ij = 2^{(s_ij + f_i − α_i + g_j − β_j)·scale}``. R must be zeroed when SPLIT
    (atomics), C always. Grid: (row blocks, column splits).
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n
    col_lo = pid_s * cols_per_split
    col_hi = tl.minimum(m, col_lo + cols_per_split)
    q_tile = _load_rows(Q, offs_m, n, d, stride_qn, stride_qd, BLOCK_D, D_CHUNKS)
    f = tl.load(F + offs_m, mask=row_ok, other=0.0)
    alpha = tl.load(ALPHA + offs_m, mask=row_ok, other=0.0)
    u = tl.where(row_ok, (f - alpha) * scale, float("-inf"))
    a = tl.exp(tl.load(LOG_A + offs_m, mask=row_ok, other=float("-inf")))
    r = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(col_lo, col_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < col_hi
        s = _score_tile(
            Q, K, q_tile, offs_m, offs_n, n, col_hi, d, stride_qn, stride_qd, stride_kn, stride_kd,
            BLOCK_D, D_CHUNKS, PRECISION,
        )
        g = tl.load(G + offs_n, mask=col_ok, other=0.0)
        beta = tl.load(BETA + offs_n, mask=col_ok, other=0.0)
        v = tl.where(col_ok, (g - beta) * scale, float("-inf"))
        b = tl.exp(tl.load(LOG_B + offs_n, mask=col_ok, other=float("-inf")))
        e = tl.exp2(s * scale + u[:, None] + v[None, :])
        r += tl.sum(e * b[None, :], 1)
        if COLUMNS:
            tl.atomic_add(C + offs_n, tl.sum(e * a[:, None], 0), mask=col_ok)
    if SPLIT:
        tl.atomic_add(R + offs_m, r, mask=row_ok)
    else:
        tl.store(R + offs_m, r, mask=row_ok)


@triton.jit
def _update_side(
    pid, F, S, OFFSET, LOG_W, F_NEW, ERR, STATUS, size, eps, lam, inv_rho, BLOCK: tl.constexpr,
    RELAXED: tl.constexpr, CHECK: tl.constexpr, FROM_LSE: tl.constexpr,
):
    """One side of ``_update_kernel``."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    f = tl.load(F + offs, mask=ok, other=0.0)
    if FROM_LSE:  # S holds the row LSE: ln R = (f − α + lse)/ε, always safe
        ln_r = (
            f - tl.load(OFFSET + offs, mask=ok, other=0.0) + tl.load(S + offs, mask=ok, other=0.0)
        ) / eps
        r = tl.exp(ln_r)
    else:  # S holds the plan sums R of the fast path: flag 0, tiny or non-finite ones
        r = tl.load(S + offs, mask=ok, other=1.0)
        safe = (r > 8.67e-19) & (r < 3.0e38)
        tl.atomic_max(STATUS, tl.max(tl.where(safe, 0, 1).to(tl.int32), 0))
        ln_r = tl.log(r)
    f_new = 0.5 * (f + lam * (f - eps * ln_r))
    tl.store(F_NEW + offs, f_new, mask=ok)
    if CHECK:
        w = tl.exp(tl.load(LOG_W + offs, mask=ok, other=float("-inf")))
        target = w
        if RELAXED:
            target = w * tl.exp(-f * inv_rho)
        tl.atomic_add(ERR, tl.sum(tl.where(ok, tl.abs(w * r - target), 0.0), 0))


@triton.jit
def _update_kernel(
    F, R, ALPHA, LOG_A, F_NEW, G, C, BETA, LOG_B, G_NEW, ERR, STATUS, n, m, eps, lam_x, lam_y,
    inv_rho_x, inv_rho_y, BLOCK: tl.constexpr, RELAXED_X: tl.constexpr, RELAXED_Y: tl.constexpr,
    CHECK: tl.constexpr, FROM_LSE: tl.constexpr,
):
    """Averaged Jacobi update of f and g, ``f' = ½ (f + λ T(g))`` with ``T(g) = f − ε ln R``.

    ``R_i`` are the row sums ``Σ_j b_j e^{(f_i + g_j − C_ij)/ε}`` (from
    ``_plan_sums_kernel``) or, with FROM_LSE, are rebuilt from row LSEs. With CHECK, adds
    the L1 marginal error ``Σ |a R − target|`` (target a, or ``a e^{−f/ρ}`` when relaxed)
    to ERR. Programs ``[0, cdiv(n, BLOCK))`` update f, the rest g.
    """
    pid = tl.program_id(0)
    blocks_f = tl.cdiv(n, BLOCK)
    if pid < blocks_f:
        _update_side(
            pid, F, R, ALPHA, LOG_A, F_NEW, ERR, STATUS, n, eps, lam_x, inv_rho_x, BLOCK,
            RELAXED_X, CHECK, FROM_LSE,
        )
    else:
        _update_side(
            pid - blocks_f,
            G,
            C,
            BETA,
            LOG_B,
            G_NEW,
            ERR,
            STATUS,
            m,
            eps,
            lam_y,
            inv_rho_y,
            BLOCK,
            RELAXED_Y,
            CHECK,
            FROM_LSE,
        )
