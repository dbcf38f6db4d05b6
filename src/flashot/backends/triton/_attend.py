r"""The row attend op: row LSEs and softmax averages of biased score tiles.

``attend`` streams the column tiles of one row block per program (row-stationary, online
max), each column split's partials merged by :mod:`._combine`:

.. math::

    \\mathrm{lse}_i = ε \\ln \\sum_j e^{(⟨q_i, k_j⟩ + h_j)/ε}, \\qquad
    \\mathrm{out}_i = \\sum_j \\frac{e^{(⟨q_i, k_j⟩ + h_j)/ε}}{e^{\\mathrm{lse}_i/ε}} v_j,

exact for any inputs. The bias is either given (``h``) or formed from a potential on the
fly (``h = g − β + ε log b``). With a repair bound the launch recomputes only the row
blocks whose fused plan sums (:mod:`._plan_sums`) fell outside their exact range.
Kernel → :class:`AttendLaunch` → :func:`attend`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device
from flashot.backends.temperature import LOG2E as HOST_LOG2E
from flashot.backends.triton import _configs, _launch
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._combine import _combine_kernel
from flashot.backends.triton._common import (
    CONTROL_POINTERS,
    EPS,
    LOG2E,
    RUNTIME_INTS,
    SCALE,
    _attend_weights,
    _block_range,
    _from_row,
    _score_tile,
    _side_load,
    _stationary_tiles,
    _value_chunk,
    _value_product,
)
from flashot.backends.triton._configs import cdiv, next_pow2
from flashot.backends.triton._scores import CACHED_DOT, CACHED_T_DOT

__all__ = ["COMBINE_TILE", "VALUE_PARTIALS", "AttendLaunch", "attend"]

#: floats of a value pass's per-split partial sums (64 MB): more splits than that fits
#: are not made (splits only balance the waves of programs: at most ~1.5× on one kernel)
VALUE_PARTIALS = 1 << 24
#: (rows, value columns) per program of the split merge: bounded, since its compile
#: time grows with the tile (Triton 3.6, sm_90: 0.7 s at 128 × 64, 72 s at 128 × 1024)
COMBINE_TILE = (64, 64)


# fmt: off
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
    row_lo, row_end, seg_lo, seg_hi = _block_range(BLOCKS, pid_m, BLOCK_M, n, m, SEGMENTED)
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
    q_tile, q_lo_tile, unscale = _stationary_tiles(Q, q_lo, offs_m, row_end, d, stride_qn,
                                                   stride_qd, Q_INV, K_INV, BLOCK_D, D_CHUNKS,
                                                   False, PRESPLIT)  # fmt: skip
    s_scale = scale * unscale  # (the split parts' scale, exact: a power of two)
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
            PRESPLIT,
        )
        if POTENTIAL_BIAS:  # noqa: SIM108 (a compile-time branch) h = g − β + ε log b, base 2
            h = (g - beta) * scale + log_w * LOG2E
        else:
            h = g * scale
        run_max, run_sum, e, decay = _attend_weights(s, h, run_max, run_sum, s_scale)
        if HAS_V:
            if P_LOOP == 1:
                pv = _value_product(e, V, offs_n, col_hi, offs_p, p, stride_vn, stride_vp, v_lo,
                                    v_unscale, V_PRECISION, V_SPLIT)  # fmt: skip
                acc = acc * decay[:, None] + pv
            else:
                tl.debug_barrier()  # the last tile's stores (other threads') land first
                for c in range(P_LOOP):
                    ptrs, ok_c, offs_c = _value_chunk(acc_base, acc_sn, acc_sp, offs_m, row_ok, c,
                                                      p, BLOCK_P)  # fmt: skip
                    prior = tl.load(ptrs, mask=ok_c & (start > col_lo), other=0.0)
                    pv = _value_product(e, V, offs_n, col_hi, offs_c, p, stride_vn, stride_vp,
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
# fmt: on


class AttendLaunch(_launch.Launch):
    """One :func:`attend` launch (see there); splits cut the columns."""

    kernel = _attend_kernel
    stationary_block = "BLOCK_M"

    def __init__(self, ops, q, k, eps, bias, v, repair, segments, keep_q=True):
        self.full = {"REPAIR": False}
        qs, ks, split_args, presplit, dot = ops.for_launch(q, k, segments, keep_q)
        self.q, self.k, self.eps, self.repair, self.segments = qs, ks, eps, repair, segments
        self.n, self.m, self.d = qs.shape[0], ks.shape[0], qs.shape[1]
        dev = self.device = qs.device
        self.potential = len(bias) == 3
        self.h, self.beta, self.log_w = bias if self.potential else (bias[0],) * 3
        self.has_v = v is not None
        self.p = v.shape[1] if self.has_v else 1
        vv = v.to(torch.float32) if self.has_v else self.h
        cached = dot in (CACHED_DOT, CACHED_T_DOT)
        # values split like the score operands then; on cached scores wherever the mode
        # splits (within the solve's scope, which a cached matrix implies)
        split_cached = cached and _configs.CACHED_SPLIT_VALUES and ops.splits()
        v_split = (presplit or split_cached) and self.has_v
        v_args = {"V_INV": self.h, "v_lo": 0}
        if v_split:
            vs = ops.operand(vv.contiguous(), value=True)
            vv, v_args = vs.parts[0], {"V_INV": vs.inv, "v_lo": vs.parts.stride(0)}
        self.v, self.v_args, self.split_args = vv, v_args, split_args
        self.lse = torch.empty(self.n, device=dev, dtype=torch.float32)
        self.out = (torch.empty(self.n, self.p, device=dev, dtype=torch.float32)
                    if self.has_v else self.lse)  # fmt: skip
        p_loop = _configs.value_loop(self.p, cached) if self.has_v else 1
        bd, chunks = _configs.block_d(self.d, qs.element_size())
        bp = _configs.block_p(self.p)
        self.p_chunks = cdiv(self.p, bp * p_loop) if self.has_v else 1  # (grid axis 2)
        self.nb, self.mb = _configs.buckets(self.n, self.m, segments)
        self.consts = dict(BLOCK_D=bd, BLOCK_P=bp, D_CHUNKS=chunks, HAS_V=self.has_v,
                           POTENTIAL_BIAS=self.potential, REPAIR=repair is not None,
                           PRECISION=ops.kernel_dot(dot), V_PRECISION=ops.dot(),
                           PRESPLIT=presplit, V_SPLIT=v_split,
                           SEGMENTED=segments is not None, P_LOOP=p_loop)  # fmt: skip
        # tuned apart: forming the bias in the kernel adds loads (16 % slower in tf32 at 50k)
        features = q.shape[1]  # (the tile key's: triples take a d = 3 TF32 launch's tiles)
        self.key = ("attend", features, self.p, self.nb, self.mb, self.has_v, dot, qs.dtype,
                    self.potential)  # fmt: skip
        self.autotuned = _TUNED
        # value partials hold splits·n·p floats: at most VALUE_PARTIALS of them, so that
        # wide values at large n take no split (a flow's 60k × 794 barycenters would
        # hold two more copies of the output); narrow ones (a CG's matvec) split freely
        self.most = max(1, VALUE_PARTIALS // (self.n * self.p)) if self.has_v else None

    def sizes(self, tiles):
        """Rows (a packed batch's: its table of row blocks) against columns."""
        if self.segments is None:
            return self.n, self.m, self.most
        block_m = tiles.kwargs["BLOCK_M"]
        units = len(self.segments.blocks(block_m, self.device)) * block_m
        return units, self.segments.widest_cols, self.most

    def plan(self, splits, per, tiles, probe=False):
        """Partials (for splits) allocated unless ``probe``."""
        n, p, dev, lse, seg = self.n, self.p, self.device, self.lse, self.segments
        split = splits > 1
        part_max = part_sum = part_acc = lse
        if split and not probe:
            part_max = torch.empty(splits, n, device=dev, dtype=torch.float32)
            part_sum = torch.empty_like(part_max)
            if self.has_v:
                part_acc = torch.empty(splits, n, p, device=dev, dtype=torch.float32)
        chunks = self.p_chunks

        def grid(meta):
            if seg is not None:
                return (len(seg.blocks(meta["BLOCK_M"], dev)), splits, chunks)
            return (cdiv(n, meta["BLOCK_M"]), splits, chunks)

        table = lse if seg is None else seg.blocks(tiles.kwargs["BLOCK_M"], dev)
        has_v, v, out, repair = self.has_v, self.v, self.out, self.repair
        args = dict(
            Q=self.q, K=self.k, H=self.h, BETA=self.beta, LOG_W=self.log_w, V=v, LSE=lse,
            OUT=out, PART_MAX=part_max, PART_SUM=part_sum, PART_ACC=part_acc, BLOCKS=table,
            S=self.h if repair is None else repair[0], n=n, m=self.m, d=self.d, p=p,
            scale=HOST_LOG2E / self.eps, eps=self.eps, **_launch.temp_args(self.eps, lse),
            LO=self.h if repair is None else repair[1],
            hi=0.0 if repair is None else repair[2], cols_per_split=per,
            stride_qn=self.q.stride(0), stride_qd=self.q.stride(1),
            stride_kn=self.k.stride(0), stride_kd=self.k.stride(1),
            stride_vn=v.stride(0) if has_v else 0, stride_vp=v.stride(1) if has_v else 0,
            stride_on=out.stride(0) if has_v else 0, stride_op=out.stride(1) if has_v else 0,
            n_bucket=self.nb, m_bucket=self.mb, **self.split_args, **self.v_args,
        )  # fmt: skip
        return _launch.Plan(grid, args, {**self.consts, "SPLIT": split})

    def combine(self, plan: _launch.Plan) -> None:
        """Merge the column splits' partials (one small launch), if the plan split."""
        if not plan.consts["SPLIT"]:
            return
        part_max = plan.args["PART_MAX"]
        n, p, has_v, out = self.n, self.p, self.has_v, self.out
        blk, bpc = COMBINE_TILE if has_v else (128, 1)
        bpc = min(bpc, next_pow2(p))
        with on_device(self.device):
            fire(_combine_kernel, (cdiv(n, blk), cdiv(p, bpc)),
                PART_MAX=part_max, PART_SUM=plan.args["PART_SUM"],
                PART_ACC=plan.args["PART_ACC"], LSE=self.lse, OUT=out, n=n, p=p,
                splits=part_max.shape[0], eps=self.eps, **_launch.temp_args(self.eps, self.lse),
                stride_on=out.stride(0) if has_v else 0, stride_op=out.stride(1) if has_v else 0,
                BLOCK=blk, BLOCK_P=bpc, HAS_V=has_v,
            )  # fmt: skip


_TUNED = _launch.tuned(_attend_kernel, _configs.attend_configs(),
                       ["d", "p", "n_bucket", "m_bucket", "HAS_V", "POTENTIAL_BIAS",
                        "PRECISION", "PRESPLIT"])  # fmt: skip


def attend(backend, q, k, eps, bias, v=None, repair=None, keep_q=True, segments=None):
    """``(lse (n,), out (n, p) or None)``: the row LSEs and softmax averages of ``v``.

    Args:
        backend: the :class:`~flashot.backends.triton.TritonBackend` (its operands and
            launch options).
        q: (n, d), k: (m, d) float32 score operands; ``eps``: ε (float or a device
            :class:`~flashot.backends.temperature.Temperature`).
        bias: ``(h,)`` with h (m,), or ``(g, β, log b)`` (formed in the kernel).
        v: optional (m, p) values.
        repair: ``(sums, lo, hi)``: compute only the row blocks holding a sum outside
            ``(lo[0], hi)`` (``lo`` a 1-element tensor; other rows' outputs are then
            meaningless).
        keep_q: cache q's converted copy (False for a one-off sample).
        segments: a packed batch (:mod:`flashot.geometry.segments`); the grid then runs
            over its table of row blocks, each streaming its own problem's columns, split
            as one problem's are (the widest problem's columns set the splits; a narrower
            problem's programs past its columns stream nothing).
    """
    op = AttendLaunch(backend.operands, q, k, eps, bias, v, repair, segments, keep_q)
    plan = _launch.dispatch(op, backend.autotune, backend.splits)
    op.combine(plan)
    return op.lse, (op.out if op.has_v else None)
