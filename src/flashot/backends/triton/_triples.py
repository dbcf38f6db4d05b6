r"""TF32 triples: the "fp32" mode's score operands for clouds of few features.

3xTF32 computes ``⟨x, y⟩`` as ``hi·hi' + hi·lo' + lo·hi'`` with ``hi = tf32(x)``,
``lo = tf32(x − hi)`` (about 22 bits; ``x = hi + lo + r``, ``|r| ≤ 2^-23 |x|``), in three
MMAs of K ≥ 16 each: at d ≤ :data:`TRIPLE_UP_TO` it pads d to 16 three times. Laid
out along the features instead,

.. math::

    q = [\mathrm{hi}, \mathrm{hi}, \mathrm{lo}, 0\ldots], \qquad
    k = [\mathrm{hi}', \mathrm{lo}', \mathrm{hi}', 0\ldots] \qquad (16 \text{ columns}),

one TF32 MMA of K = 16 gives the same three terms: TF32 reads these values exactly
(their low 13 bits are zero) and accumulates in float32.

``tf32(v)`` rounds to 11 significant bits, ties away from zero (the carry of bit 12
into the kept bits); NaN and ±inf stay themselves (the carry would turn a NaN's bits
into a finite number), and finite entries within 2^-11 of float32's largest become inf
(such clouds overflow their squared distances anyway).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._configs import cdiv

__all__ = ["TRIPLE_UP_TO", "TRIPLE_WIDTH", "triple_operand", "triple_pair"]

#: up to this many features "fp32" scores are one TF32 MMA of K = TRIPLE_WIDTH on
#: triples: 3xTF32 pads d to 16 for each of its three MMAs
TRIPLE_UP_TO = 5
TRIPLE_WIDTH = 16
#: rows a program of the triple kernel converts
BLOCK_N = 128


def triple_pair(t: torch.Tensor) -> torch.Tensor:
    """``(2, n, TRIPLE_WIDTH)`` float32: t's q-side triples, then its k-side triples.

    ``t``: (n, d) float32 with ``d ≤ TRIPLE_UP_TO``. One launch (a solve converts its
    clouds outside CUDA graphs too: one launch per cloud on the host, not one per op),
    both sides at once (a self problem reads a cloud as q and as k).
    """
    n, d = t.shape
    if t.dtype != torch.float32 or d > TRIPLE_UP_TO:
        raise ValueError(f"triples take float32 features of at most {TRIPLE_UP_TO} columns, "
                         f"got {t.dtype} of {d}")  # fmt: skip
    if n == 0 or d == 0:
        return t.new_zeros(2, n, TRIPLE_WIDTH)
    pair = torch.empty(2, n, TRIPLE_WIDTH, dtype=torch.float32, device=t.device)
    with on_device(t.device):  # Triton launches on the current device
        fire(_triple_kernel, (cdiv(n, BLOCK_N),), t, pair, n, d, t.stride(0), t.stride(1),
             WIDTH=TRIPLE_WIDTH, BLOCK_N=BLOCK_N)  # fmt: skip
    return pair


def triple_operand(t: torch.Tensor, role: str) -> torch.Tensor:
    """``(n, TRIPLE_WIDTH)``: t's triples for one side, ``role`` "q" or "k" (see the module)."""
    if role not in ("q", "k"):
        raise ValueError(f"role must be 'q' or 'k', got {role!r}")
    return triple_pair(t)[0 if role == "q" else 1]


@triton.jit
def _tf32(x):
    """TF32-rounded x, as float32 (see the module); non-finite entries kept."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < float("inf"), rounded, x)


@triton.jit
def _triple_kernel(T, PAIR, n, d, stride_tn, stride_td, WIDTH: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows ``[pid·BLOCK_N, …)`` of both sides' triples.

    Column c of a side holds part ``c // d`` (0, 1, 2; zero past 3d) of feature
    ``c % d``; q's lo is part 2, k's part 1.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, WIDTH)
    part, feat = cols // d, cols % d
    used = part < 3
    row_ok = rows[:, None] < n
    t = tl.load(T + rows[:, None] * stride_tn + feat[None, :] * stride_td,
                mask=row_ok & used[None, :], other=0.0)  # fmt: skip
    hi = _tf32(t)
    lo = _tf32(t - hi)
    q_side = tl.where((part == 2)[None, :], lo, hi)
    k_side = tl.where((part == 1)[None, :], lo, hi)
    zero = tl.zeros_like(hi)
    q_out = PAIR + rows[:, None] * WIDTH + cols[None, :]
    k_out = PAIR + (rows[:, None] + n) * WIDTH + cols[None, :]  # (int64: n·WIDTH may not fit)
    tl.store(q_out, tl.where(used[None, :], q_side, zero), mask=row_ok)
    tl.store(k_out, tl.where(used[None, :], k_side, zero), mask=row_ok)
