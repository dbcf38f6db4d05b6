"""Peak of live large tensors during a call, counted at the dispatcher (CPU tests of memory).

Also the GPU memory probe's tracer (``benchmarks/gpu_otdd.py`` with ``TRACE_PEAK=1``):
with ``sites=True`` it records where each counted storage was made, and what was alive
at the peak.
"""

import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Tracks storages of at least ``threshold`` bytes created inside the block.

    ``peak``: the largest total of those alive at once (a storage counts while a tensor
    created on it lives: views made later do not extend it, so this is a lower bound on
    what a block keeps, and exact for the cloud-sized operands it is used on).
    ``sites=True``: ``at_peak`` lists ``(bytes, op and flashot call sites)`` of what was
    alive at the peak.
    """

    def __init__(self, threshold: int, sites: bool = False):
        super().__init__()
        self.threshold, self.live, self.current, self.peak = threshold, {}, 0, 0
        self.sites, self.where, self.at_peak = sites, {}, []

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Never count the storages of these (inputs made before the block)."""
        for t in tensors:
            self.live[t.untyped_storage().data_ptr()] = 0

    def _gone(self, ptr):
        if ptr in self.live:
            self.current -= self.live.pop(ptr)
            self.where.pop(ptr, None)

    def _site(self, func) -> str:
        frames = [
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}"
            for f in traceback.extract_stack()[:-2]
            if "flashot" in f.filename
        ]
        return f"{func.__name__} < " + " < ".join(reversed(frames[-5:]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if size >= self.threshold and ptr not in self.live:
                self.live[ptr] = size
                self.current += size
                if self.sites:
                    self.where[ptr] = self._site(func)
                if self.current > self.peak:
                    self.peak = self.current
                    if self.sites:
                        self.at_peak = [(self.live[p], w) for p, w in self.where.items()]
                weakref.finalize(t, self._gone, ptr)
        return out
