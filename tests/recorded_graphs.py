"""A CPU stand-in for CUDA graph capture that replays what was recorded, not the Python.

:class:`RecordedGraph` runs ``fn`` once under a dispatch mode that records every aten
op (its arguments, Python scalars included, and its outputs), then replays that op
list on the static inputs: like a CUDA graph, a replay repeats the captured launches
with the captured scalars, so a temperature, a branch or a loop count that a key failed
to pin shows up as a wrong result, which a stand-in that re-runs ``fn`` would hide.

Host reads (``.item()``, ``bool(t)``) are recorded with their values, and a replay
whose read differs raises: a CUDA capture refuses them outright, but the torch backend
that these tests run reads one (whether a bias holds ``-inf``), which the Triton
backend does not; its value must then not change between replays.
"""

import typing

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class _Record(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class RecordedGraph:
    """``capture(fn, inputs)`` for :class:`flashot.solver.graphs.GraphCache` (see module)."""

    log: typing.ClassVar[list] = []

    def __init__(self, fn, inputs):
        self.inputs = [t.clone() for t in inputs]
        self.ops: list = []
        with _Record(self.ops):
            self.outputs = tuple(fn(*self.inputs))
        RecordedGraph.log.append("capture")

    def __call__(self, inputs):
        for static, t in zip(self.inputs, inputs, strict=True):
            static.copy_(t)
        now = {id(t): t for t in self.inputs}  # recorded tensor → its tensor in this replay

        def here(a):
            return now.get(id(a), a) if isinstance(a, torch.Tensor) else a

        for func, args, kwargs, out in self.ops:
            result = func(*tree_map(here, args), **tree_map(here, kwargs))
            if func in _HOST_READS and result != out:
                raise RuntimeError(f"a host read changed at replay ({func}: {out} → {result})")
            for old, new in zip(tree_flatten(out)[0], tree_flatten(result)[0], strict=True):
                if isinstance(old, torch.Tensor):
                    now[id(old)] = new
        RecordedGraph.log.append("replay")
        return tree_map(
            lambda t: here(t).clone() if isinstance(t, torch.Tensor) else t, self.outputs
        )
