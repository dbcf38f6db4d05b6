"""Device-side state of a fused Triton solve: the residual gate between its steps.

Split from :mod:`flashot.backends.triton` (its :meth:`TritonBackend.fast_state`).
"""

from __future__ import annotations

import torch

__all__ = ["Gate"]


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
