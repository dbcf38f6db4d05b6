"""Peak of live large tensors during a call, counted at the dispatcher (CPU tests of memory)."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensors(TorchDispatchMode):
    """Tracks storages of at least ``threshold`` bytes created inside the block.

    ``peak``: the largest total of those alive at once (a storage counts while a tensor
    created on it lives: views made later do not extend it, so this is a lower bound on
    what a block keeps, and exact for the cloud-sized operands it is used on).
    """

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold, self.live, self.current, self.peak = threshold, {}, 0, 0

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Never count the storages of these (inputs made before the block)."""
        for t in tensors:
            self.live[t.untyped_storage().data_ptr()] = 0

    def _gone(self, ptr):
        if ptr in self.live:
            self.current -= self.live.pop(ptr)

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
                self.peak = max(self.peak, self.current)
                weakref.finalize(t, self._gone, ptr)
        return out
