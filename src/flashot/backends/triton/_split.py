r"""Operands split once per solve for the accurate mode (the kernels' PRESPLIT).

3xTF32 (``tl.dot(..., input_precision="tf32x3")``) splits both operands into TF32
high and low parts inside the streaming loop, for every tile: 7–11 instructions per
score element on sm_90, about as many as the rest of the loop (benchmarks/HISTORY.md,
v7 item 6). Split once instead, into half precision with a power-of-two scale per
cloud,

.. math::

    2^e x = \mathrm{hi} + \mathrm{lo}, \qquad
    \langle x, y\rangle \approx 2^{-e_x - e_y}\big(\mathrm{hi}\cdot\mathrm{hi}'
        + \mathrm{hi}\cdot\mathrm{lo}' + \mathrm{lo}\cdot\mathrm{hi}'\big),

three float16 MMAs (twice the TF32 rate) with float32 accumulation. ``2^e`` brings the
largest entry to at most 2^14 (float16 reaches 65504); hi keeps 11 significant bits,
lo the next 11 (its rounding and the dropped lo·lo' term are 2^-22 of the scale): the
accuracy of 3xTF32. Products of float16 values are exact in float32.

Score operands keep lo at its own magnitude (:data:`SCORE_LO_BITS` = 0: ``2^e x = hi +
lo``), so the three products add in one accumulator with no multiply per score (one
instruction a score fewer in every split score tile: the fused pass's sm_90 loop 605 →
542 instructions a tile). The price:
a remainder under float16's normal range (entries below 2^-17 of the largest) is kept
to 2^-25 absolutely, 2^-39 of the largest entry, where the 2^11 scale kept it relative
down to 2^-28: invisible to a dot product, whose error is relative to the largest
entries. Values (:func:`split_keys`, the attend kernel's V) keep ``lo`` scaled by 2^11
(:data:`VALUE_LO_BITS`): a value product multiplies them by weights split the same way
(``_common._value_product``), and a value column far smaller than the largest keeps its
relative accuracy.

The MMA's own accumulator truncates (sm_90, float16 and TF32 alike): summing many
feature chunks in it drifted by 2^-18 of the score (v22: 6.6e-4 on MNIST scores of
250, where 3xTF32 is at 4e-5, and OTDD's float32 solves stalled at 1e-4). So each chunk's
high product starts from that chunk's low terms, and the chunks are added in rounded
float32, as Triton's own 3xTF32 does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._configs import cdiv

__all__ = ["SplitOperand", "split_keys", "split_operand"]

#: the largest scaled entry is at most 2^HEADROOM (float16's largest finite is 65504)
HEADROOM = 14
#: score operands' lo: the remainder itself (their products add with no rescale)
SCORE_LO_BITS = 0
#: values' lo: the remainder scaled by 2^11 (``_common._value_product`` scales it back)
VALUE_LO_BITS = 11
#: elements a program of the split kernel converts
BLOCK = 1024


class SplitOperand(NamedTuple):
    """A feature matrix (n, d) as the PRESPLIT kernels read it.

    Attributes:
        parts: (2, n, d) contiguous: ``hi`` and ``lo`` (float16; float32 holding float16
            values under the interpreter, whose numpy has no half matmul).
        inv: (1,) float32 ``2^-e`` on the device (no host round trip: CUDA graphs).
        lo_bits: ``2^e x = hi + 2^-lo_bits lo`` (:data:`SCORE_LO_BITS` or
            :data:`VALUE_LO_BITS`).
    """

    parts: torch.Tensor
    inv: torch.Tensor
    lo_bits: int = SCORE_LO_BITS

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]


def split_operand(t: torch.Tensor, interpreted: bool = False,
                  lo_bits: int = SCORE_LO_BITS) -> SplitOperand:  # fmt: skip
    """Split float32 features ``t`` (n, d) into scaled half parts (see the module).

    ``lo_bits``: :data:`SCORE_LO_BITS` for score operands, :data:`VALUE_LO_BITS` for values.

    Two launches (the extremes of ``t``, then :func:`_split_kernel`), no temporaries of
    t's size, no wait for the device: a solve split outside a CUDA graph (the final,
    differentiated step) pays two launches per operand on the host, not one per op.
    """
    t = t.contiguous()
    parts = torch.empty((2, *t.shape), dtype=torch.float16, device=t.device)
    inv = torch.ones(1, dtype=torch.float32, device=t.device)
    if t.numel():
        low, high = torch.aminmax(t)
        with on_device(t.device):  # Triton launches on the current device
            fire(_split_kernel, (cdiv(t.numel(), BLOCK),),
                t, low, high, parts, inv, t.numel(), HEADROOM=HEADROOM, LO_BITS=lo_bits,
                BLOCK=BLOCK,
            )  # fmt: skip
    if interpreted:
        parts = parts.float()
    return SplitOperand(parts, inv, lo_bits)


def split_keys(t: torch.Tensor, split: bool, unused: torch.Tensor) -> tuple:
    """``(keys, inverse scale, offset of the low parts)`` as a value product reads keys.

    ``split``: ``t`` (m, d) split into half parts as values (:data:`VALUE_LO_BITS`; the
    high ones, their ``2^-e``, the elements from a high part to its low one); otherwise
    ``t`` itself, ``unused`` and 0.
    """
    if not split:
        return t, unused, 0
    whole = split_operand(t, triton_interpreted(), VALUE_LO_BITS)
    return whole.parts[0], whole.inv, whole.parts.stride(0)


@triton.jit
def _split_kernel(T, LOW, HIGH, PARTS, INV, numel, HEADROOM: tl.constexpr, LO_BITS: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """``hi``, ``lo`` of BLOCK elements, and (program 0) ``2^-e``.

    ``e = HEADROOM − ⌈log2 max|t|⌉`` from the exponent bits of max|t| (exact, unlike a
    rounded log2 just above a power of two), 0 for zeros, clamped to ±120 so that
    ``2^e`` and ``2^-e`` are built exactly from their exponent fields.
    """
    top = tl.maximum(tl.load(HIGH), -tl.load(LOW))
    bits = top.to(tl.int32, bitcast=True)
    ceil_log2 = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(tl.where(top > 0, HEADROOM - ceil_log2, 0), -120), 120)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inside = offs < numel
    x = tl.load(T + offs, mask=inside, other=0.0) * scale
    hi = x.to(tl.float16)
    lo = ((x - hi.to(tl.float32)) * (2.0**LO_BITS)).to(tl.float16)
    tl.store(PARTS + offs, hi, mask=inside)
    tl.store(PARTS + numel + offs, lo, mask=inside)
    if start == 0:
        tl.store(INV, ((127 - e) << 23).to(tl.float32, bitcast=True))
