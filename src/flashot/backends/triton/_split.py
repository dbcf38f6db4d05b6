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

__all__ = ["SplitOperand", "split_operand"]

#: the largest scaled entry is at most 2^HEADROOM (float16's largest finite is 65504)
HEADROOM = 14
#: lo is the remainder scaled by 2^LO_BITS (the kernels multiply lo products by 2^-11)
LO_BITS = 11
#: rows converted at a time (a float32 temporary of ROWS × d)
ROWS = 8192


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

    Float32 temporaries of :data:`ROWS` rows; no wait for the device.
    """
    parts = torch.empty((2, *t.shape), dtype=torch.float16, device=t.device)
    # max |t| with no temporary of t's size
    amax = torch.maximum(t.amax(), -t.amin()) if t.numel() else torch.zeros((), device=t.device)
    # e = HEADROOM − ⌈log2 max|t|⌉, so that 2^e max|t| ≤ 2^HEADROOM (e = 0 for zeros)
    e = torch.where(amax > 0, HEADROOM - torch.ceil(torch.log2(amax)), 0.0).clamp(-120.0, 120.0)
    scale = torch.exp2(e)
    for start in range(0, t.shape[0], ROWS):  # blocks of rows: float32 temporaries stay small
        scaled = t[start : start + ROWS] * scale
        parts[0, start : start + ROWS].copy_(scaled)
        scaled.sub_(parts[0, start : start + ROWS]).mul_(2.0**LO_BITS)
        parts[1, start : start + ROWS].copy_(scaled)
    if interpreted:
        parts = parts.float()
    return SplitOperand(parts, torch.exp2(-e).reshape(1).float())
