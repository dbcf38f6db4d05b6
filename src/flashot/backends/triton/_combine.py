"""The merge of column-split partials (max, sum, values) into row LSEs and averages.

The attend launches (:mod:`._attend`) with column splits and the exact one
pass (:mod:`._one_pass`) write partials; one small launch merges them here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashot.backends.triton._common import (
    CONTROL_POINTERS,
    EPS,
    LOG2E,
    RUNTIME_INTS,
    _from_row,
)

__all__ = ["_combine_kernel"]


@triton.jit(
    do_not_specialize=RUNTIME_INTS["_combine_kernel"],
    do_not_specialize_on_alignment=CONTROL_POINTERS["_combine_kernel"],
)
def _combine_kernel(
    PART_MAX,
    PART_SUM,
    PART_ACC,
    LSE,
    OUT,
    n,
    p,
    splits,
    eps,
    TEMP,
    temp_at,
    stride_on,
    stride_op,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_V: tl.constexpr,
    UNIT_SUMS: tl.constexpr = False,
):
    """Merge column-split partials: ``M = max_s m_s``, ``L = Σ_s l_s 2^{m_s − M}``, same for acc.

    Grid: (row blocks of BLOCK, value chunks of BLOCK_P); every chunk's program merges
    the (cheap) row statistics again and the first writes LSE. A bounded chunk keeps the
    program small: one (128, 1024) tile for p = 784 took Triton 3.6 72 s to compile.
    UNIT_SUMS: the partials are base-2 LSEs (every ``l_s`` is 1; PART_SUM unused).
    ``temp_at`` ≠ 0: ε is read from ``TEMP``.
    """
    eps = _from_row(TEMP, temp_at, eps, EPS)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = offs < n
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for s in range(splits):
        top = tl.maximum(top, tl.load(PART_MAX + s * n + offs, mask=ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_P), dtype=tl.float32)
    for s in range(splits):
        w = tl.exp2(tl.load(PART_MAX + s * n + offs, mask=ok, other=float("-inf")) - top)
        if UNIT_SUMS:
            total += w
        else:
            total += w * tl.load(PART_SUM + s * n + offs, mask=ok, other=0.0)
        if HAS_V:
            part = tl.load(
                PART_ACC + (s * n + offs)[:, None] * p + offs_p[None, :],
                mask=ok[:, None] & (offs_p[None, :] < p),
                other=0.0,
            )
            acc += w[:, None] * part
    tl.store(LSE + offs, eps * (top + tl.log2(total)) / LOG2E, mask=ok & (tl.program_id(1) == 0))
    if HAS_V:
        ptrs = OUT + offs[:, None] * stride_on + offs_p[None, :] * stride_op
        tl.store(ptrs, acc / total[:, None], mask=ok[:, None] & (offs_p[None, :] < p))
