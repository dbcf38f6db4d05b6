"""Replaying repeated fixed-length solves as CUDA graphs.

A fixed-iteration Sinkhorn solve on a GPU is a fixed sequence of kernel launches
with no host round trip. At launch-bound sizes (n = m = 10 000 runs a whole pass in
tens of microseconds) the Python and driver work of ~5 launches per iteration costs
more than the GPU work, so a solve that repeats with the same shapes, temperatures
and options (a training loop, a benchmark) is captured once and replayed: the inputs
are copied into the graph's own buffers, one launch runs the whole sequence, and the
outputs are copied out.

A key is run eagerly the first time it is seen (that compiles and tunes kernels),
captured the second time, replayed from then on. Captures hold their buffers (the
inputs' size) and a private memory pool, so the cache is small and only backends
that ask for it, at sizes they choose, use it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from flashot.backends import on_device

__all__ = ["GRAPHS", "GraphCache", "capture_or_eager"]


class _Captured:
    """One captured call: its graph and its static input and output tensors."""

    def __init__(self, fn: Callable, inputs: Sequence[torch.Tensor]):
        self.inputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in inputs]
        self.device = inputs[0].device  # captured and replayed there, whichever is current
        self.graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph's default capture stream is created once, on the device then
        # current: captured on another GPU's stream, the launches would run eagerly and
        # leave an empty graph. A stream of the inputs' device avoids that.
        stream = torch.cuda.Stream(self.device)
        with on_device(self.device), torch.cuda.graph(self.graph, stream=stream):
            self.outputs = fn(*self.inputs)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple:
        for static, t in zip(self.inputs, inputs, strict=True):
            static.copy_(t)
        with on_device(self.device):
            self.graph.replay()
        # the next replay overwrites the static outputs: the caller gets copies
        return _copies(tuple(self.outputs))


def _copies(out):
    """``out`` with every tensor cloned: a tensor, None, or a tuple of such (nested)."""
    if isinstance(out, tuple):
        return tuple(_copies(t) for t in out)
    return None if out is None else out.clone()


def capture_or_eager(fn: Callable, inputs: Sequence[torch.Tensor]) -> Callable:
    """A :class:`GraphCache` capture; eager calls when ``fn`` cannot be captured (it syncs)."""
    try:
        return _Captured(fn, inputs)
    except RuntimeError:
        torch.cuda.synchronize()
        return lambda inputs: tuple(fn(*inputs))


class GraphCache:
    """Calls of ``fn(*inputs) -> tuple``, captured per key and replayed.

    The tuple's items are tensors, None, or tuples of them (nested); a replay returns
    copies of its tensors in the same structure.

    ``fn`` must run only asynchronous CUDA work (no host synchronization, no data-
    dependent Python control flow) and depend on nothing but its tensor inputs and
    what the key pins down.

    Args:
        capacity: captured graphs kept (least recently used ones are dropped).
        capture: ``capture(fn, inputs)`` returns a callable ``replay(inputs)``; the
            default captures a CUDA graph (tests pass a stand-in).
    """

    def __init__(self, capacity: int = 4, capture: Callable = _Captured):
        self.capacity, self._capture = capacity, capture
        self._seen: OrderedDict = OrderedDict()
        self._graphs: OrderedDict = OrderedDict()

    def __call__(self, key: Hashable, fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple:
        """``fn(*inputs)``: eager on a key's first call, then captured and replayed."""
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen:
                self._remember(self._seen, key, True, 64)
                return tuple(fn(*inputs))
            captured = self._capture(fn, inputs)
            self._remember(self._graphs, key, captured, self.capacity)
        self._graphs.move_to_end(key)
        return captured(inputs)

    def clear(self) -> None:
        """Drop every captured graph (and its memory)."""
        self._seen.clear()
        self._graphs.clear()

    @staticmethod
    def _remember(table: OrderedDict, key, value, capacity: int) -> None:
        table[key] = value
        while len(table) > capacity:
            table.popitem(last=False)


#: the process-wide cache used by the solver: a debiased divergence holds three loops
#: (the problem, two self problems), so eight keep two such calls of other shapes
#: alternating without capturing again
GRAPHS = GraphCache(capacity=8)
