r"""The fused reverse-mode plan product (:meth:`TritonBackend.plan_vjp`).

:mod:`flashot.backends.plan_vjp` defines the reductions of ``S = P ⊙ (D Vᵀ)``; with
``E_ij = P_ij / (a_i b_j)`` they split into two launches of one kernel, each streaming
score tiles once and never storing one:

* rows: ``Σ_j b_j E_ij ⟨d_i, v_j⟩`` (``per_a``) and ``Σ_j b_j E_ij ⟨d_i, v_j⟩ k_j``
  (``row_k / a_i``);
* columns, on the transposed form with (d, v) swapped: ``per_b`` and ``col_q / b_j``;

and ``Pᵀ D`` is one value pass (:func:`~flashot.backends.dual.plan_times` on the transposed
form). Each launch and pass runs only when one of its outputs is asked for, and the
product with the keys only for ``row_k`` / ``col_q``.

The scores read the operands the solver's passes read (:meth:`~._operands.Operands.
score_pair`: split half parts at 10k d = 64, triples at d ≤ 5), split once per call, not
3xTF32 per tile. One value column (``p = 1``, the replay's transforms) is an outer
product ``d_i v_j``: no MMA forms it, and in "fp32" (split score operands or triples:
:meth:`~._operands.Operands.splits_values`) the keys' product
reads ``v ⊙ k`` split once into half parts, the weights taken against a running row
maximum (at most 1, so half precision holds them) and split per tile as the attend
kernel's values are (:func:`~._common._value_product`). Wider values hold the features
in one chunk and stream the values in chunks of :data:`._configs.VJP_P_CHUNK`:
``d, p ≤ 128`` (the backend falls back to PyTorch tiles beyond, where cuBLAS products are
as fast as recomputed score chunks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.dual import Potentials, plan_times
from flashot.backends.plan_vjp import ALL, PlanVJP
from flashot.backends.temperature import LOG2E, device_scale
from flashot.backends.triton import _configs
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._common import (
    SCALE,
    _from_row,
    _load_tile,
    _online_weights,
    _score_tile,
    _stationary_tiles,
    _value_product,
)
from flashot.backends.triton._configs import cdiv, next_pow2
from flashot.backends.triton._launch import temp_args
from flashot.backends.triton._split import split_keys

__all__ = ["FUSED_UP_TO", "fused_plan_vjp"]

#: widest features and values the fused kernel takes
FUSED_UP_TO = 128
#: ``input_precision`` of the value products per tile (``⟨d_i, v_j⟩`` and ``T k``) when
#: not split; None: the backend's score precision (3xTF32 in fp32 mode). TF32 there
#: saved 21 % of a launch and took the HVP's error from 6e-5 to 7e-3 (H100, v41; NOTES.md)
VALUE_DOT: str | None = None


def _width(size: int) -> int:
    return max(16, next_pow2(size))


def _rows(backend, q, k, row_bias, col_bias, dr, vc, eps, with_k, extra=None, extra_side=0,
          cols=None):  # fmt: skip
    """``(Σ_j T_ij, Σ_j T_ij k_j or None, column sums or None)``.

    ``T_ij = 2^{…} (⟨dr_i, vc_j⟩ + extra)``.

    ``extra``: None, or a vector added on the rows' side (``extra_side`` 1) or the
    columns' (2); see the kernel. ``cols``: None, or the column sums' biases
    ``(COL_RB (n,), COL_CB (m,))`` (one value column, no extra; the kernel's COLS).
    """
    n, m, d, p = q.shape[0], k.shape[0], q.shape[1], dr.shape[1]
    dev = q.device
    out = torch.zeros(n * (d + 1 if with_k else 1), device=dev, dtype=torch.float32)  # atomics add
    out_w, out_k = out[:n], (out[n:].view(n, d) if with_k else out)
    outer = p == 1 and extra is None
    if cols is not None and not outer:
        raise ValueError("internal: column sums ride along one value column only")
    out_c = torch.zeros(m if cols is not None else 1, device=dev, dtype=torch.float32)
    col_rb, col_cb = cols if cols is not None else (row_bias, col_bias)
    qs, ks, split_args, presplit, dot = backend.operands.for_launch(q, k)
    kv_split = outer and with_k and backend.operands.splits_values(presplit, q.shape[1])
    kv, kv_inv, kv_lo = split_keys((vc * k).contiguous() if kv_split else k, kv_split, row_bias)
    kv_args = {"KV_INV": kv_inv, "kv_lo": kv_lo}
    if triton_interpreted():
        block_m, block_n, warps, stages = 16, 16, 1, 1
    else:
        block_m, block_n, warps, stages = vjp_tiles(p, qs.shape[1])
    blocks = cdiv(n, block_m)
    splits, per = _configs.column_grid(blocks, m, block_n, dev, backend.splits)
    options = {} if triton_interpreted() else {"num_warps": warps, "num_stages": stages}
    chunk = 16 if triton_interpreted() else vjp_chunk(p, qs.shape[1])
    block_p, p_chunks = (_width(p), 1) if p <= chunk else (chunk, cdiv(p, chunk))
    with on_device(dev):
        fire(_plan_vjp_kernel, (blocks, splits),
            Q=qs, K=ks, KV=kv, ROW_B=row_bias, COL_B=col_bias, DR=dr, VC=vc,
            EXTRA=row_bias if extra is None else extra, OUT_W=out_w, OUT_K=out_k,
            COL_RB=col_rb, COL_CB=col_cb, OUT_C=out_c, n=n, m=m,
            d=d, dq=qs.shape[1], p=p, scale=LOG2E / eps, **temp_args(eps, out_w),
            cols_per_split=per, stride_qn=qs.stride(0), stride_qd=qs.stride(1),
            stride_kn=ks.stride(0), stride_kd=ks.stride(1), stride_kvn=kv.stride(0),
            stride_kvd=kv.stride(1), stride_dn=dr.stride(0), stride_dp=dr.stride(1),
            stride_vn=vc.stride(0), stride_vp=vc.stride(1), **split_args, **kv_args,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_width(qs.shape[1]), BLOCK_K=_width(d),
            BLOCK_P=block_p, P_CHUNKS=p_chunks, SPLIT=splits > 1, WITH_K=with_k,
            PRECISION=backend.operands.kernel_dot(dot), V_PRECISION=_value_dot(backend),
            PRESPLIT=presplit, OUTER=outer, KV_SPLIT=kv_split,
            EXTRA_SIDE=0 if extra is None else extra_side, COLS=cols is not None, **options,
        )  # fmt: skip
        return out_w, (out_k if with_k else None), (out_c if cols is not None else None)


def vjp_tiles(p: int, dq: int) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages) on a GPU for p values and ``dq`` score features.

    Narrow values past 64 features take the tiles that fit sm_90's shared memory there
    (:data:`._configs.VJP_NARROW_WIDE_TILES`); up to 64 values and features, in one
    chunk, :data:`._configs.VJP_MID_TILES` where set.
    """
    if p > 16:
        return _mid_tiles(p, dq) or _configs.VJP_TILES
    return _configs.VJP_NARROW_WIDE_TILES if _width(dq) > 64 else _configs.VJP_NARROW_TILES


def vjp_chunk(p: int, dq: int) -> int:
    """The value columns a tile takes at a time (the rest stream in further chunks)."""
    return 64 if _mid_tiles(p, dq) else _configs.VJP_P_CHUNK


def _mid_tiles(p: int, dq: int) -> tuple | None:
    """:data:`._configs.VJP_MID_TILES` where they serve (17…64 values, ≤ 64 features)."""
    return _configs.VJP_MID_TILES if 16 < p <= 64 and _width(dq) <= 64 else None


def _value_dot(backend) -> str:
    return backend.operands.dot() if VALUE_DOT is None or triton_interpreted() else VALUE_DOT


def fused_plan_vjp(
    backend, form, f, g, a, b, eps: float, v, d, need: frozenset = ALL, d0=None
) -> PlanVJP:
    """:meth:`~flashot.backends.base.Backend.plan_vjp` in two fused launches and a value pass.

    Args:
        backend: the :class:`~flashot.backends.triton.TritonBackend`.
        form: attention form (detached), float32, feature size ≤ :data:`FUSED_UP_TO`.
        f: (n,), g: (m,) potentials.  a: (n,), b: (m,) weights.  eps: ε.
        v: (m, p) values.  d: (n, p) cotangent of ``P v``, p ≤ :data:`FUSED_UP_TO`.
        need: the outputs to form (the others may be None).
        d0: (n,) cotangent of the plan's row sums ``P 1``, or None.
    """
    f32 = torch.float32
    q, k = form.q.contiguous(), form.k.contiguous()
    v, d = v.to(f32).contiguous(), d.to(f32).contiguous()
    d0 = None if d0 is None else d0.to(f32).contiguous()
    scale = device_scale(eps)  # (a Temperature's row: read on the device, as the kernel does)
    f_bias, g_bias = (f - form.alpha) * scale, (g - form.beta) * scale
    per_a = row_k = per_b = col_q = pt_d = None
    # one value column, the columns' sums without their keys: they ride along the rows'
    # launch (_configs.VJP_FUSED_COLUMNS), which forms each score once for both sides
    fused = (_configs.VJP_FUSED_COLUMNS and "col" in need and "col_q" not in need
             and bool(need & {"row", "row_k"}) and v.shape[1] == 1 and d0 is None)  # fmt: skip
    with backend.operands.scope():  # the launches share q's and k's split parts
        # the columns' sums (fused or a launch of their own) read f's bias with log2 a
        if need & {"row", "row_k"}:
            cols = ((f_bias + torch.log2(a)).to(f32), g_bias.to(f32)) if fused else None
            per_a, row_k, per_b = _rows(backend, q, k, f_bias.to(f32),
                                        (g_bias + torch.log2(b)).to(f32), d, v, eps,
                                        "row_k" in need, d0, 1, cols)  # fmt: skip
            row_k = None if row_k is None else row_k.mul_(a[:, None])
        if need & {"col", "col_q"} and not fused:
            per_b, col_q, _ = _rows(backend, k, q, g_bias.to(f32),
                                    (f_bias + torch.log2(a)).to(f32), v, d, eps,
                                    "col_q" in need, d0, 2)  # fmt: skip
            col_q = None if col_q is None else col_q.mul_(b[:, None])
    if "pt_d" in need:
        pt_d = plan_times(backend, Potentials(form.T, g, f, torch.log(b), torch.log(a), eps), d)
    return PlanVJP(None if per_a is None else a * per_a, row_k,
                   None if per_b is None else b * per_b, col_q, pt_d, per_a, per_b)  # fmt: skip


@triton.jit(do_not_specialize=["temp_at"], do_not_specialize_on_alignment=["TEMP"])
def _plan_vjp_kernel(
    Q,
    K,
    KV,
    ROW_B,
    COL_B,
    DR,
    VC,
    EXTRA,
    OUT_W,
    OUT_K,
    COL_RB,
    COL_CB,
    OUT_C,
    n,
    m,
    d,
    dq,
    p,
    scale,
    TEMP,
    temp_at,
    cols_per_split,
    stride_qn,
    stride_qd,
    stride_kn,
    stride_kd,
    stride_kvn,
    stride_kvd,
    stride_dn,
    stride_dp,
    stride_vn,
    stride_vp,
    Q_INV,
    K_INV,
    q_lo,
    k_lo,
    KV_INV,
    kv_lo,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    P_CHUNKS: tl.constexpr,
    SPLIT: tl.constexpr,
    WITH_K: tl.constexpr,
    PRECISION: tl.constexpr,
    V_PRECISION: tl.constexpr,
    PRESPLIT: tl.constexpr,
    OUTER: tl.constexpr,
    KV_SPLIT: tl.constexpr,
    EXTRA_SIDE: tl.constexpr,
    COLS: tl.constexpr = False,
):
    """Row reductions of ``T_ij = E_ij ⟨dr_i, vc_j⟩`` (the backward of a plan product).

    ``E_ij = 2^{s_ij·scale + ROW_B_i + COL_B_j}`` (the column weights folded into
    ``COL_B``), ``s_ij = ⟨q_i, k_j⟩`` from the score operands Q, K (``dq`` features:
    float32, triples, or with PRESPLIT split parts, ``Q_INV``, ``K_INV``, ``q_lo``,
    ``k_lo`` as the attend kernel reads them): ``OUT_W_i += Σ_j T_ij`` and, with WITH_K,
    ``OUT_K_i += Σ_j T_ij k_j`` (k_j: row j of KV, d features), added atomically (zeroed
    outputs) over the column splits of grid axis 1 with SPLIT, else stored.

    EXTRA_SIDE 1 (2) adds ``EXTRA_i`` (``EXTRA_j``) to ``⟨dr_i, vc_j⟩``: a ones column
    of the values (the cotangent of the plan's row sums) without a widened copy. OUTER
    (p = 1, no EXTRA): ``T_ij = dr_i E_ij vc_j``, dr_i applied once at the end; with
    KV_SPLIT, KV holds ``vc ⊙ k`` split into half parts (``KV_INV``, ``kv_lo``) and the
    weights, taken against the row's running maximum of the exponent (so at most 1, as
    the attend kernel's), are split per tile. Otherwise the values stream in P_CHUNKS
    chunks of BLOCK_P (hoisted when one). ``temp_at`` ≠ 0: ``scale`` is read from the
    temperature row ``TEMP`` (:mod:`flashot.backends.temperature`).

    COLS (OUTER only): also the column sums ``OUT_C_j += vc_j Σ_i dr_i 2^{s_ij·scale +
    COL_RB_i + COL_CB_j}`` from the same score tiles, one more exp2 per score and
    BLOCK_N atomics per tile (zeroed output): with ``COL_RB = ROW_B + log2 a`` and
    ``COL_CB = COL_B − log2 b`` the transposed launch's ``per_b``, absolute as it is.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    scale = _from_row(TEMP, temp_at, scale, SCALE)  # (a captured replay's temperature)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < n
    col_lo = pid_s * cols_per_split
    col_hi = tl.minimum(m, col_lo + cols_per_split)
    q_tile, q_lo_tile, unscale = _stationary_tiles(
        Q, q_lo, offs_m, n, dq, stride_qn, stride_qd, Q_INV, K_INV, BLOCK_D, 1, False, PRESPLIT
    )
    s_scale = scale * unscale  # (the split parts' scale, exact: a power of two)
    kv_unscale = 1.0
    if KV_SPLIT:
        kv_unscale = tl.load(KV_INV)
    if OUTER:
        dr = tl.load(DR + offs_m * stride_dn, mask=row_ok, other=0.0)
        dr_tile = q_tile
    else:
        dr_tile = _load_tile(DR, offs_m, n, p, stride_dn, stride_dp, BLOCK_P, P_CHUNKS, False)
    rb = tl.load(ROW_B + offs_m, mask=row_ok, other=0.0)
    crb, dr_c = rb, rb  # (defined on every path: the loop reads them under COLS)
    if COLS:
        crb = tl.load(COL_RB + offs_m, mask=row_ok, other=float("-inf"))
        dr_c = tl.load(DR + offs_m * stride_dn, mask=row_ok, other=0.0)
    if EXTRA_SIDE == 1:
        row_extra = tl.load(EXTRA + offs_m, mask=row_ok, other=0.0)
    acc_w = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc_k = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # (KV_SPLIT)
    for start in range(col_lo, col_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < col_hi
        cb = tl.load(COL_B + offs_n, mask=col_ok, other=float("-inf"))
        s = _score_tile(Q, K, q_tile, q_tile, offs_m, offs_n, n, col_hi, dq, stride_qn,
                        stride_qd, stride_kn, stride_kd, BLOCK_D, 1, False, PRECISION,
                        q_lo_tile, q_lo_tile, q_lo, k_lo, PRESPLIT)  # fmt: skip
        if COLS:  # (OUTER) the columns' terms, absolute: no running maximum across programs
            ccb = tl.load(COL_CB + offs_n, mask=col_ok, other=float("-inf"))
            ce = tl.exp2(s * s_scale + crb[:, None] + ccb[None, :])
            vcol = tl.load(VC + offs_n * stride_vn, mask=col_ok, other=0.0)
            tl.atomic_add(OUT_C + offs_n, tl.sum(ce * dr_c[:, None], 0) * vcol, mask=col_ok,
                          sem="relaxed")  # fmt: skip
        if OUTER and KV_SPLIT:  # weights against the running maximum, 2^{ROW_B} at the end
            vc = tl.load(VC + offs_n * stride_vn, mask=col_ok, other=0.0)
            run_max, e, decay = _online_weights(s, cb, run_max, s_scale)
            acc_w = acc_w * decay + tl.sum(e * vc[None, :], 1)
            if WITH_K:
                pv = _value_product(e, KV, offs_n, col_hi, offs_k, d, stride_kvn, stride_kvd,
                                    kv_lo, 1.0, V_PRECISION, True)  # fmt: skip
                acc_k = acc_k * decay[:, None] + pv
        else:
            e = tl.exp2(s * s_scale + rb[:, None] + cb[None, :])
            if OUTER:  # ⟨dr_i, vc_j⟩ = dr_i vc_j, dr_i applied at the end
                u = tl.load(VC + offs_n * stride_vn, mask=col_ok, other=0.0)[None, :]
            else:
                u = _score_tile(DR, VC, dr_tile, dr_tile, offs_m, offs_n, n, col_hi, p,
                                stride_dn, stride_dp, stride_vn, stride_vp, BLOCK_P, P_CHUNKS,
                                False, V_PRECISION, dr_tile, dr_tile, 0, 0, False)  # fmt: skip
                if EXTRA_SIDE == 1:
                    u += row_extra[:, None]
                if EXTRA_SIDE == 2:
                    u += tl.load(EXTRA + offs_n, mask=col_ok, other=0.0)[None, :]
            t = e * u
            acc_w += tl.sum(t, 1)
            if WITH_K:
                kv = _load_tile(KV, offs_n, col_hi, d, stride_kvn, stride_kvd, BLOCK_K, 1, False)
                acc_k = tl.dot(t, kv, acc_k, input_precision=V_PRECISION)
    if OUTER:
        if KV_SPLIT:
            dr = dr * tl.exp2(tl.where(run_max == float("-inf"), 0.0, run_max) + rb)
        acc_w = acc_w * dr
        acc_k = acc_k * (dr * kv_unscale)[:, None]
    ptrs = OUT_K + offs_m[:, None] * d + offs_k[None, :]
    k_ok = row_ok[:, None] & (offs_k[None, :] < d)
    if SPLIT:
        if col_hi > col_lo:
            tl.atomic_add(OUT_W + offs_m, acc_w, mask=row_ok, sem="relaxed")
            if WITH_K:
                tl.atomic_add(ptrs, acc_k, mask=k_ok, sem="relaxed")
    else:
        tl.store(OUT_W + offs_m, acc_w, mask=row_ok)
        if WITH_K:
            tl.store(ptrs, acc_k, mask=k_ok)
