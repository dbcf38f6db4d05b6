r"""The reverse of one symmetric Sinkhorn step's two transforms, in one launch.

A replayed schedule (:mod:`flashot.autodiff.replay`) differentiates, per symmetric step
at potentials (f, g), the rows' transform ``T_x(g)`` and the columns' ``T_y(f)``. Their
plans share the scores ``s_ij = ⟨q_i, k_j⟩``:

.. math::

    Π^x_{ij} = b_j\, e^{(r^x_i + g_j − β_j + s_{ij})/ε}, \qquad
    Π^y_{ji} = a_i\, e^{(r^y_j + f_i − α_i + s_{ij})/ε},

with ``r^x``, ``r^y`` the passes' own negated LSEs (so ``Π^x`` has unit row sums and
``Π^y`` unit sums over i). With cotangents ``u`` (n,) of the rows' transform and ``u'``
(m,) of the columns', the reverse products the sweep needs when k takes no gradient are

* ``u_i Σ_j Π^x_ij k_j`` (n, d) and ``Σ_i Π^x_ij u_i`` (m,): the rows' transform;
* ``Σ_j Π^y_ji u'_j k_j`` (n, d) and ``Σ_j Π^y_ji u'_j`` (n,): the columns' transform,

which two reverse products (:mod:`._vjp`) form in three launches, each with its score
tile and exponentials. Here one launch over row blocks forms them from one score tile:
``Π^x`` absolute (each term at most about 1, so its keys' product splits the weights into
half parts as the attend kernel does, and the same terms feed the column sums by
atomics), ``Π^y / a_i`` against the row's running maximum (it is not bounded by 1),
``2^{max} a_i`` applied at the end. One score tile, two exp2 per score, two value
products, against three, three and two.

Where k takes a gradient too, its terms ``u'_j Σ_i Π^y_ji q_i`` and ``Σ_i Π^x_ij u_i q_i``
are column reductions here: the same launch on the transposed form (sides swapped) forms
them as its rows, two launches against four. A self problem's transform (one cloud, so
``s_ij = s_ji``) takes side 1 as its own transposed rows: ``Σ_i Π_ij u_i q_i`` is side 1's
third output with values q, and the column atomics are not needed
(:meth:`~flashot.backends.triton.TritonBackend.mirror_vjp`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device, triton_interpreted
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

__all__ = ["sym_vjp_tiles", "symmetric_vjp"]


def sym_vjp_tiles(width: int) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages) on a GPU for ``width`` features (score or value).

    Up to 16 (triples) :data:`._configs.SYM_VJP_NARROW_TILES`; past 64 the smaller tiles
    that fit sm_90's shared memory (:data:`._configs.SYM_VJP_WIDE_TILES`); past 256 none
    does (two value accumulators of the full width): a ValueError.
    """
    padded = max(16, next_pow2(width))
    if padded <= 16:
        return _configs.SYM_VJP_NARROW_TILES
    if padded <= 64:
        return _configs.SYM_VJP_TILES
    if padded not in _configs.SYM_VJP_WIDE_TILES:
        raise ValueError(f"symmetric_vjp: {width} features; the one-launch reverse holds at "
                         "most 256 (two value accumulators of that width a tile)")  # fmt: skip
    return _configs.SYM_VJP_WIDE_TILES[padded]


def symmetric_vjp(backend, form, f, g, r_f, r_g, log_a, log_b, u_f, u_g, eps, values=None,
                  column_sums: bool = True):  # fmt: skip
    """``(u ⊙ Π^x k (n, d), Π^xᵀ u (m,), Π^yᵀ(u' ⊙ v) (n, d), Π^yᵀ u' (n,))`` (see module).

    Args:
        backend: the :class:`~flashot.backends.triton.TritonBackend`.
        form: the attention form (q (n, d'), k (m, d'), α, β), float32, d' ≤ 64.
        f: (n,), g: (m,) the step's potentials.  r_f: (n,), r_g: (m,) its passes'
            negated LSEs (rows', columns').  log_a: (n,), log_b: (m,) log weights.
        u_f: (n,) cotangent u of the rows' transform, u_g: (m,) u' of the columns'.
        eps: ε (a float or a :class:`~flashot.backends.temperature.Temperature`).
        values: (m, d) the columns' values ``v`` of the third output (None: k).
        column_sums: form the second output (else it is returned as zeros, and one
            cross-warp reduction and BLOCK_N atomics a tile are saved).
    """
    f32 = torch.float32
    q, k = form.q.contiguous(), form.k.contiguous()
    n, m, d = q.shape[0], k.shape[0], k.shape[1]
    dev = q.device
    scale = device_scale(eps)
    rb0 = (r_f * scale).to(f32)
    cb0 = ((g - form.beta) * scale + LOG2E * log_b).to(f32)
    rb1 = ((f - form.alpha) * scale + LOG2E * log_a).to(f32)
    cb1 = (r_g * scale).to(f32)
    u0, u1 = u_f.to(f32).contiguous(), u_g.to(f32).contiguous()
    out = torch.zeros(n * (2 * d + 1) + m, device=dev, dtype=f32)  # (atomics add)
    out_k0, out_k1 = out[: n * d].view(n, d), out[n * d : 2 * n * d].view(n, d)
    out_w1, out_c0 = out[2 * n * d : 2 * n * d + n], out[2 * n * d + n :]
    qs, ks, split_args, presplit, dot = backend.operands.for_launch(q, k)
    v_split = backend.operands.splits_values(presplit, q.shape[1])
    values = k if values is None else values.to(f32)
    kv0, kv0_inv, kv0_lo = split_keys(k, v_split, rb0)
    kv1, kv1_inv, kv1_lo = split_keys((u1[:, None] * values).contiguous(), v_split, rb0)
    kv_args = {"KV0_INV": kv0_inv, "KV1_INV": kv1_inv, "kv0_lo": kv0_lo, "kv1_lo": kv1_lo}
    if triton_interpreted():
        block_m, block_n, warps, stages = 16, 16, 1, 1
    else:
        block_m, block_n, warps, stages = sym_vjp_tiles(max(qs.shape[1], d))
    blocks = cdiv(n, block_m)
    splits, per = _configs.column_grid(blocks, m, block_n, dev, backend.splits)
    options = {} if triton_interpreted() else {"num_warps": warps, "num_stages": stages}
    with on_device(dev):
        fire(_sym_vjp_kernel, (blocks, splits),
            Q=qs, K=ks, KV0=kv0, KV1=kv1, RB0=rb0, CB0=cb0, U0=u0, RB1=rb1, CB1=cb1, U1=u1,
            OUT_K0=out_k0, OUT_C0=out_c0, OUT_W1=out_w1, OUT_K1=out_k1, n=n, m=m, d=d,
            dq=qs.shape[1], scale=LOG2E / eps, **temp_args(eps, rb0), cols_per_split=per,
            stride_qn=qs.stride(0), stride_qd=qs.stride(1), stride_kn=ks.stride(0),
            stride_kd=ks.stride(1), stride_kvn=kv0.stride(0), stride_kvd=kv0.stride(1),
            **split_args, **kv_args, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=max(16, next_pow2(qs.shape[1])), BLOCK_K=max(16, next_pow2(d)),
            SPLIT=splits > 1, PRECISION=backend.operands.kernel_dot(dot),
            V_PRECISION=backend.operands.dot(), PRESPLIT=presplit, V_SPLIT=v_split,
            COLS0=column_sums, **options,
        )  # fmt: skip
    return out_k0, out_c0, out_k1, out_w1


@triton.jit(do_not_specialize=["temp_at"], do_not_specialize_on_alignment=["TEMP"])
def _sym_vjp_kernel(
    Q, K, KV0, KV1, RB0, CB0, U0, RB1, CB1, U1, OUT_K0, OUT_C0, OUT_W1, OUT_K1,
    n, m, d, dq, scale, TEMP, temp_at, cols_per_split,
    stride_qn, stride_qd, stride_kn, stride_kd, stride_kvn, stride_kvd,
    Q_INV, K_INV, q_lo, k_lo, KV0_INV, KV1_INV, kv0_lo, kv1_lo,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    V_PRECISION: tl.constexpr, PRESPLIT: tl.constexpr, V_SPLIT: tl.constexpr,
    COLS0: tl.constexpr,
):  # fmt: skip
    """Both transforms' reverse products over one row block and one column split.

    ``e0 = 2^{s·scale + RB0_i + CB0_j}`` (Π^x), ``e1 = 2^{s·scale + CB1_j − max_i}``
    (Π^y / (a_i 2^{max_i − RB1_i})): ``OUT_K0 += U0 ⊙ e0 KV0`` (KV0 = k),
    ``OUT_C0 += e0ᵀ U0`` (atomics per tile, with COLS0), ``OUT_W1 += 2^{max + RB1} e1 U1``
    and ``OUT_K1 += 2^{max + RB1} e1 KV1`` (KV1 = U1 ⊙ v), added atomically over the column
    splits with SPLIT (zeroed outputs). With PRESPLIT the scores read split parts; with
    V_SPLIT KV0, KV1 come split into half parts (``KV*_INV``, ``kv*_lo``), the weights
    split per tile. ``temp_at`` ≠ 0: ``scale`` from the temperature row ``TEMP``.
    """
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    scale = _from_row(TEMP, temp_at, scale, SCALE)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < n
    col_lo = pid_s * cols_per_split
    col_hi = tl.minimum(m, col_lo + cols_per_split)
    q_tile, q_lo_tile, unscale = _stationary_tiles(
        Q, q_lo, offs_m, n, dq, stride_qn, stride_qd, Q_INV, K_INV, BLOCK_D, 1, False, PRESPLIT
    )
    s_scale = scale * unscale
    kv0_unscale, kv1_unscale = 1.0, 1.0
    if V_SPLIT:
        kv0_unscale, kv1_unscale = tl.load(KV0_INV), tl.load(KV1_INV)
    rb0 = tl.load(RB0 + offs_m, mask=row_ok, other=float("-inf"))
    u0 = tl.load(U0 + offs_m, mask=row_ok, other=0.0)
    acc_k0 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_k1 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc_w1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for start in range(col_lo, col_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < col_hi
        s = _score_tile(Q, K, q_tile, q_tile, offs_m, offs_n, n, col_hi, dq, stride_qn,
                        stride_qd, stride_kn, stride_kd, BLOCK_D, 1, False, PRECISION,
                        q_lo_tile, q_lo_tile, q_lo, k_lo, PRESPLIT)  # fmt: skip
        cb0 = tl.load(CB0 + offs_n, mask=col_ok, other=float("-inf"))
        e0 = tl.exp2(s * s_scale + rb0[:, None] + cb0[None, :])
        if COLS0:
            tl.atomic_add(OUT_C0 + offs_n, tl.sum(e0 * u0[:, None], 0), mask=col_ok, sem="relaxed")
        cb1 = tl.load(CB1 + offs_n, mask=col_ok, other=float("-inf"))
        run_max, e1, decay = _online_weights(s, cb1, run_max, s_scale)
        u1 = tl.load(U1 + offs_n, mask=col_ok, other=0.0)
        acc_w1 = acc_w1 * decay + tl.sum(e1 * u1[None, :], 1)
        if V_SPLIT:
            acc_k0 += _value_product(e0, KV0, offs_n, col_hi, offs_k, d, stride_kvn, stride_kvd,
                                     kv0_lo, 1.0, V_PRECISION, True)  # fmt: skip
            pv = _value_product(e1, KV1, offs_n, col_hi, offs_k, d, stride_kvn, stride_kvd,
                                kv1_lo, 1.0, V_PRECISION, True)  # fmt: skip
        else:
            k0 = _load_tile(KV0, offs_n, col_hi, d, stride_kvn, stride_kvd, BLOCK_K, 1, False)
            acc_k0 = tl.dot(e0, k0, acc_k0, input_precision=V_PRECISION)
            k1 = _load_tile(KV1, offs_n, col_hi, d, stride_kvn, stride_kvd, BLOCK_K, 1, False)
            pv = tl.dot(e1, k1, input_precision=V_PRECISION)
        acc_k1 = acc_k1 * decay[:, None] + pv
    rb1 = tl.load(RB1 + offs_m, mask=row_ok, other=float("-inf"))
    w1 = tl.exp2(tl.where(run_max == float("-inf"), 0.0, run_max) + rb1)
    acc_k0 = acc_k0 * (u0 * kv0_unscale)[:, None]
    acc_k1 = acc_k1 * (w1 * kv1_unscale)[:, None]
    acc_w1 = acc_w1 * w1
    ptrs = offs_m[:, None] * d + offs_k[None, :]
    k_ok = row_ok[:, None] & (offs_k[None, :] < d)
    if SPLIT:
        if col_hi > col_lo:
            tl.atomic_add(OUT_K0 + ptrs, acc_k0, mask=k_ok, sem="relaxed")
            tl.atomic_add(OUT_K1 + ptrs, acc_k1, mask=k_ok, sem="relaxed")
            tl.atomic_add(OUT_W1 + offs_m, acc_w1, mask=row_ok, sem="relaxed")
    else:
        tl.store(OUT_K0 + ptrs, acc_k0, mask=k_ok)
        tl.store(OUT_K1 + ptrs, acc_k1, mask=k_ok)
        tl.store(OUT_W1 + offs_m, acc_w1, mask=row_ok)
