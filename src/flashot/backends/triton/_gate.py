"""Device-side state of a fused Triton solve: the residual gate between its steps.

Split from :mod:`flashot.backends.triton` (its :meth:`TritonBackend.fast_state`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["Gate", "sum_ranges"]

#: exact range of a plan sum per unit of size·max(1, weight), and its upper end
#: (:meth:`~flashot.backends.triton.TritonBackend.valid_range`)
_LO_PER_TERM, _HI = 2.0**-100, 2.0**120


class Gate:
    """Device-side residual gate of a solve.

    Two slots of (largest ln R, largest −ln R), one read by a step and one written by it
    for the next, so that a fused launch never reads the slot being filled.
    """

    def __init__(self, device):
        self.slots = torch.full((4,), float("inf"), device=device, dtype=torch.float32)
        self.parity = 0
        self.steps = 0  # steps taken
        self.eps = None  # the ε of the last step
        self.ranges = None  # the sums' exact ranges (they depend on the weights only)

    def swap(self):
        p, self.parity = self.parity, 1 - self.parity
        return self.slots[2 * p : 2 * p + 2], self.slots[2 - 2 * p : 4 - 2 * p]


def sum_ranges(log_a, log_b, state: Gate | None = None) -> tuple[torch.Tensor, float]:
    """``(lo, hi)``: the exact range of row sums (``lo[0]``) and column sums (``lo[1]``).

    :meth:`~flashot.backends.triton.TritonBackend.valid_range` for the weights ``log_b``
    (rows) and ``log_a`` (columns); ``lo`` is computed on the device (no host round
    trip), once per solve (kept in ``state``).
    """
    if state is not None and state.ranges is not None:
        return state.ranges
    # log(size · max(1, w)), with no host tensor (this may run inside a CUDA graph)
    logs = [lw.max().float().clamp_min(0.0) + math.log(len(lw)) for lw in (log_b, log_a)]
    ranges = (torch.stack(logs).exp() * _LO_PER_TERM, _HI)
    if state is not None:
        state.ranges = ranges
    return ranges
