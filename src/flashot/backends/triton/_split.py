r"""Operands split once per solve for the accurate mode (the kernels' PRESPLIT).

3xTF32 (``tl.dot(..., input_precision="tf32x3")``) splits both operands into TF32
high and low parts inside the streaming loop, for every tile: 7–11 instructions per
score element on sm_90, about as many as the rest of the loop (benchmarks/HISTORY.md,
v7 item 6). Split once instead, into half precision with a power-of-two scale per
cloud,

.. math::

    2^e x = \mathrm{hi} + 2^{-11}\,\mathrm{lo}, \qquad
    \langle x, y\rangle \approx 2^{-e_x - e_y}\big(\mathrm{hi}\cdot\mathrm{hi}'
        + 2^{-11}(\mathrm{hi}\cdot\mathrm{lo}' + \mathrm{lo}\cdot\mathrm{hi}')\big),

three float16 MMAs (twice the TF32 rate) with float32 accumulation. ``2^e`` brings the
largest entry to at most 2^14 (float16 reaches 65504); hi keeps 11 significant bits,
lo the next 11 (its rounding and the dropped lo·lo' term are 2^-22 of the scale): the
accuracy of 3xTF32. Products of float16 values are exact in float32. Entries below
2^-24 of the largest lose relative accuracy, which the dot product's absolute error,
relative to the largest entries, does not see.

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
from flashot.backends.triton._configs import cdiv

__all__ = ["SplitOperand", "split_keys", "split_operand"]

#: the largest scaled entry is at most 2^HEADROOM (float16's largest finite is 65504)
HEADROOM = 14
#: lo is the remainder scaled by 2^LO_BITS (the kernels multiply lo products by 2^-11)
LO_BITS = 11
#: elements a program of the split kernel converts
BLOCK = 1024


class SplitOperand(NamedTuple):
    """A feature matrix (n, d) as the PRESPLIT kernels read it.

    Attributes:
        parts: (2, n, d) contiguous: ``hi`` and ``lo`` (float16; float32 holding float16
            values under the interpreter, whose numpy has no half matmul).
        inv: (1,) float32 ``2^-e`` on the device (no host round trip: CUDA graphs).
    """

    parts: torch.Tensor
    inv: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]


def split_operand(t: torch.Tensor, interpreted: bool = False) -> SplitOperand:
    """Split float32 features ``t`` (n, d) into scaled half parts (see the module).

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
            _split_kernel[(cdiv(t.numel(), BLOCK),)](
                t, low, high, parts, inv, t.numel(), HEADROOM=HEADROOM, LO_BITS=LO_BITS,
                BLOCK=BLOCK,
            )  # fmt: skip
    if interpreted:
        parts = parts.float()
    return SplitOperand(parts, inv)


def split_keys(t: torch.Tensor, split: bool, unused: torch.Tensor) -> tuple:
    """``(keys, inverse scale, offset of the low parts)`` as a value product reads keys.

    ``split``: ``t`` (m, d) split into half parts (the high ones, their ``2^-e``, the
    elements from a high part to its low one); otherwise ``t`` itself, ``unused`` and 0.
    """
    if not split:
        return t, unused, 0
    whole = split_operand(t, triton_interpreted())
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
