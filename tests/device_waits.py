"""Ops that make the host wait for the device, counted on the CPU (dispatcher and methods).

On a GPU an op whose output size or value the host needs (``nonzero``, ``unique``,
``repeat_interleave`` without ``output_size``, ``bincount``, boolean indexing, reading a
scalar or a list) blocks until the device has run everything queued before it: a host
loop of many small steps with such waits never overlaps the device's work. CPU tensors
take the same ops, so a CPU test counts them.
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: ops whose output the host must see before it goes on (aten names)
WAITING = frozenset({"aten::nonzero", "aten::_unique2", "aten::unique_dim",
                     "aten::unique_consecutive", "aten::masked_select", "aten::bincount",
                     "aten::_local_scalar_dense", "aten::item"})  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self, waits: list[str]):
        super().__init__()
        self.waits = waits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        kwargs = kwargs or {}
        waits = name in WAITING
        if name == "aten::repeat_interleave":
            waits = kwargs.get("output_size") is None
        elif name.startswith("aten::index") and len(args) > 1 and isinstance(args[1], list):
            waits = any(t is not None and t.dtype == torch.bool for t in args[1])
        if waits:
            self.waits.append(name)
        return func(*args, **kwargs)


class _Lists(TorchFunctionMode):
    """``Tensor.tolist`` (a copy to the host on a GPU; no aten op on a CPU tensor)."""

    def __init__(self, waits: list[str]):
        super().__init__()
        self.waits = waits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.waits.append("tolist")
        return func(*args, **(kwargs or {}))


class DeviceWaits:
    """``waits``: the names of the waiting ops run inside the block, in order."""

    def __enter__(self):
        self.waits: list[str] = []
        self._modes = [_Lists(self.waits), _Ops(self.waits)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
