r"""The plan sums op: row and column sums of the plan's kernel, one exponential per score.

With ``E_ij = exp((⟨q_i, k_j⟩ + f_i − α_i + g_j − β_j)/ε)``:

.. math::

    R_i = 2^s \sum_j b_j E_{ij}, \qquad C_j = 2^s \sum_i a_i E_{ij}

(``a_i b_j E_ij`` is the plan ``P_ij``; ``s`` a shift). No max is tracked, so a sum is
exact only while it lies in a range where its terms neither overflow nor underflow,
which holds near the Sinkhorn fixed point; the fused step (:mod:`._step`) repairs the
others with :mod:`._attend`. The same kernel with EXACT serves the one-pass step
(:mod:`._one_pass`). Kernel → :class:`SumsLaunch` → :func:`plan_sums`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.temperature import LOG2E as HOST_LOG2E
from flashot.backends.triton import _configs, _launch
from flashot.backends.triton._common import (
    CONTROL_POINTERS,
    LOG2E,
    RATIO,
    READ_RATIO,
    RUNTIME_INTS,
    SCALE,
    _block_range,
    _from_row,
    _running_total,
    _running_update,
    _score_tile,
    _side_ahead,
    _side_load,
    _stationary_tiles,
)
from flashot.backends.triton._configs import cdiv

__all__ = ["SumsLaunch", "plan_sums"]


# fmt: off
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
    col_lo, col_end, seg_lo, seg_hi = _block_range(BLOCKS, pid_n, BLOCK_N, m, n, SEGMENTED)
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
    kt_tile, kt_lo_tile, unscale = _stationary_tiles(K, k_lo, offs_n, col_end, d, stride_kn,
                                                     stride_kd, Q_INV, K_INV, BLOCK_D,
                                                     D_CHUNKS, True, PRESPLIT)  # fmt: skip
    s_scale = scale * unscale  # (the split parts' scale, exact: a power of two)
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
            q_lo, k_lo, PRESPLIT,
        )
        u, a = _side_terms(f, alpha, log_a, row_ok, scale)
        if EXACT:
            x = s * s_scale + v[None, :]
            r_max = tl.max(x, 1)
            r_sum = tl.sum(tl.exp2(x - tl.where(r_max == float("-inf"), 0.0, r_max)[:, None]), 1)
            r_lse = r_max + tl.log2(r_sum)  # -inf when every term is (r_sum 0)
            tl.store(ROW_LSE + pid_n.to(tl.int64) * n + offs_m, r_lse, mask=row_ok)
            acc, acc_den = _running_update(s * s_scale + (u + log_a * LOG2E)[:, None], acc,
                                           acc_den)  # fmt: skip
        else:
            e = tl.exp2(s * s_scale + (u + shift)[:, None] + v[None, :])
            if MULTIPLY:
                tl.atomic_add(R_DEN + offs_m, tl.sum(e * b_den[None, :], 1), mask=row_ok,
                              sem="relaxed")  # fmt: skip
                acc_den += e * a[:, None]
                a = a * tl.load(MUL_A + offs_m, mask=row_ok, other=0.0)
            tl.atomic_add(R + offs_m, tl.sum(e * b[None, :], 1), mask=row_ok, sem="relaxed")
            acc += e * a[:, None]
    if EXACT:
        top, total = _running_total(acc, acc_den, 0)
        tl.store(COL_MAX + pid_s * m + offs_n, top, mask=col_ok)
        tl.store(COL_SUM + pid_s * m + offs_n, total, mask=col_ok)
    elif row_hi > row_lo:
        tl.atomic_add(C + offs_n, tl.sum(acc, 0), mask=col_ok, sem="relaxed")
        if MULTIPLY:
            tl.atomic_add(C_DEN + offs_n, tl.sum(acc_den, 0), mask=col_ok, sem="relaxed")
# fmt: on


class SumsLaunch(_launch.Launch):
    """One launch of ``_plan_sums_kernel`` (column-stationary; splits cut the rows).

    ``backend``: the Triton backend; ``pot``: the
    :class:`~flashot.backends.dual.Potentials`. The fused sums' options are
    :func:`plan_sums`'s; :mod:`._one_pass` subclasses it for the EXACT mode.
    """

    kernel = _plan_sums_kernel
    stationary_block = "BLOCK_N"

    def __init__(self, backend, pot, gate=None, limit=0.0, span=False, shift=0.0, mul=None,
                 ratio=False):  # fmt: skip
        ops = backend.operands
        form = pot.form
        self.pot, self.segments = pot, form.segments
        seg = self.segments
        self.q, self.k, self.split_args, presplit, dot = ops.for_launch(form.q, form.k, seg)
        self.n, self.m, self.d = self.q.shape[0], self.k.shape[0], self.q.shape[1]
        self.device = self.q.device
        self.nb, self.mb = _configs.buckets(self.n, self.m, seg)
        self.key = ("plan_sums", form.q.shape[1], self.nb, self.mb, dot, self.q.dtype)
        bd, chunks = _configs.block_d(self.d, self.q.element_size())
        self.consts = dict(BLOCK_D=bd, D_CHUNKS=chunks, GATED=gate is not None,
                           MULTIPLY=mul is not None, PRECISION=ops.kernel_dot(dot),
                           PRESPLIT=presplit, SEGMENTED=seg is not None)  # fmt: skip
        self.gate, self.limit, self.span, self.shift, self.mul = gate, limit, span, shift, mul
        self.ratio = ratio
        self.sums = self.allocate()
        self.autotuned, self.full = _TUNED, {"GATED": False}

    def allocate(self) -> torch.Tensor:
        """The zeroed sums R, C (and R_DEN, C_DEN with MULTIPLY), in one buffer."""
        size = (2 if self.mul is not None else 1) * (self.n + self.m)
        return torch.zeros(size, device=self.device, dtype=torch.float32)

    def sizes(self, tiles):
        """Columns (a packed batch's: its table of column blocks) against rows."""
        seg = self.segments
        if seg is None:
            return self.m, self.n, None
        block_n = tiles.kwargs["BLOCK_N"]
        return len(seg.T.blocks(block_n, self.device)) * block_n, seg.T.widest_cols, None

    def outputs(self, splits, tiles, probe) -> dict:
        """The kernel's output arguments: R, C (zeroed) and, with MULTIPLY, R_DEN, C_DEN."""
        n, m, sums = self.n, self.m, self.sums
        r, c = sums[:n], sums[n : n + m]
        r_den, c_den = (sums[n + m : 2 * n + m], sums[2 * n + m :]) if self.mul else (sums, sums)
        gate_in, gate_out = self.gate if self.gate is not None else (sums, sums)
        mul_a, mul_b = self.mul or (sums, sums)
        return dict(
            R=r,
            C=c,
            GATE_IN=gate_in,
            GATE_OUT=gate_out,
            MUL_A=mul_a,
            MUL_B=mul_b,
            R_DEN=r_den,
            C_DEN=c_den,
            ROW_LSE=sums,
            COL_MAX=sums,
            COL_SUM=sums,
        )

    def plan(self, splits, per, tiles, probe=False):
        form, f, g, log_a, log_b, eps = self.pot.parts()
        dev, seg, m = self.device, self.segments, self.m
        seg_t = None if seg is None else seg.T  # the column blocks' table

        def grid(meta):
            if seg_t is not None:
                return (len(seg_t.blocks(meta["BLOCK_N"], dev)), splits)
            return (cdiv(m, meta["BLOCK_N"]), splits)

        out = self.outputs(splits, tiles, probe)
        table = self.sums if seg_t is None else seg_t.blocks(tiles.kwargs["BLOCK_N"], dev)
        args = dict(
            Q=self.q, K=self.k, F=f, ALPHA=form.alpha, G=g, BETA=form.beta, LOG_A=log_a,
            LOG_B=log_b, **out, BLOCKS=table, n=self.n, m=m, d=self.d,
            scale=HOST_LOG2E / eps, shift=self.shift, gate_limit=self.limit,
            gate_span=int(self.span), **_launch.temp_args(eps, self.sums, self.ratio),
            rows_per_split=per, stride_qn=self.q.stride(0), stride_qd=self.q.stride(1),
            stride_kn=self.k.stride(0), stride_kd=self.k.stride(1), n_bucket=self.nb,
            m_bucket=self.mb, **self.split_args,
        )  # fmt: skip
        return _launch.Plan(grid, args, self.consts)

    def reset(self):
        """After tuning launches: they accumulated, ungated."""
        self.sums.zero_()
        if self.gate is not None:
            self.gate[1].zero_()


_TUNED = _launch.tuned(_plan_sums_kernel, _configs.plan_sums_configs(),
                       ["d", "n_bucket", "m_bucket", "PRECISION", "PRESPLIT"])  # fmt: skip


def plan_sums(backend, pot, gate=None, limit=0.0, span=False, shift=0.0, mul=None,
              ratio=False):  # fmt: skip
    """See :meth:`flashot.backends.triton.TritonBackend.plan_sums` (``backend``: that backend)."""
    op = SumsLaunch(backend, pot, gate, limit, span, shift, mul, ratio)
    _launch.dispatch(op, backend.autotune, backend.splits)
    n, m, sums = op.n, op.m, op.sums
    r, c = sums[:n], sums[n : n + m]
    return (r, c) if mul is None else (r, c, sums[n + m : 2 * n + m], sums[2 * n + m :])
