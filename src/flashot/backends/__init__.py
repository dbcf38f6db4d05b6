"""Backend registry and automatic choice.

``backend="auto"`` picks the Triton kernels for CUDA tensors when Triton is
importable, and the streaming PyTorch backend otherwise. A :class:`Backend`
instance may also be passed wherever a backend name is accepted.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import torch

from flashot.backends.base import PRECISIONS, Backend
from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.torch_backend import TorchBackend

__all__ = [
    "PRECISIONS",
    "Backend",
    "available_backends",
    "constant_when_compiled",
    "eager_only",
    "entry_point",
    "on_device",
    "resolve_backend",
]

P = ParamSpec("P")
R = TypeVar("R")

BACKENDS = ("auto", "torch", "triton")


def entry_point(fn: Callable[P, R]) -> Callable[P, R]:
    """A public entry point or custom backward: autocast off, run outside torch.compile.

    flashot computes in the precision asked for (``precision=``, float64 inputs); an
    enclosing ``torch.autocast`` would silently round its matmuls (score tiles, plan
    products) to bf16/fp16 instead. Under ``torch.compile`` the call runs eagerly
    (``torch.compiler.disable``): its work is already fused kernels, and its host logic
    (tolerance checks, launch choices, thread pools) would otherwise break the graph
    many times over or fail to trace. A compiled step therefore breaks its graph once
    at each such call and never recompiles for flashot's sake; ``fullgraph=True``
    is not supported around one. Losses that return tensors avoid the break as
    ``flashot::loss`` nodes (:mod:`flashot.ops`).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on = [t for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)]
        if not on:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device_type in on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return fn(*args, **kwargs)

    name = getattr(fn, "__qualname__", "an entry point")
    reason = (f"flashot ({name}) runs eagerly, outside the compiled graph (its host logic "
              "cannot be traced), so fullgraph=True cannot hold it: for a loss use "
              "flashot.ops.sinkhorn_cost, sinkhorn_divergence or SamplesLoss, one graph "
              "node each, or compile without fullgraph (one graph break)")  # fmt: skip
    return cast(Callable[P, R], eager_only(wrapper, reason))


_set_eval_frame: Callable[..., Any] | None
try:  # (part of torch._C: no import of torch._dynamo, whose Python side takes seconds)
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # pragma: no cover (a torch without it: the public decorator)
    _set_eval_frame = None


def eager_only(fn: Callable[P, R], reason: str) -> Callable[P, R]:
    """``torch.compiler.disable(fn, reason=reason)``, without importing ``torch._dynamo``.

    The public decorator imports TorchDynamo's Python side (1 s on a CPU, several on a
    GPU machine) at import time, for every entry point. This wrapper does what it does:
    TorchDynamo sees the ``_torchdynamo_disable`` marks and breaks the graph at the call
    (or names ``reason`` under ``fullgraph=True``), and the call runs with the frame
    evaluation hook off, so nothing inside it is traced. Where torch lacks the hook's
    switch, the public decorator is applied.
    """
    if _set_eval_frame is None:  # pragma: no cover
        if "reason" in inspect.signature(torch.compiler.disable).parameters:
            return torch.compiler.disable(fn, reason=reason)
        return torch.compiler.disable(fn)
    switch = _set_eval_frame

    @functools.wraps(fn)
    def eager(*args, **kwargs):
        prior = switch(None)
        try:
            return fn(*args, **kwargs)
        finally:
            switch(prior)

    marks = {"_torchdynamo_disable": True, "_torchdynamo_disable_msg": reason,
             "_torchdynamo_orig_callable": fn, "_torchdynamo_disable_recursive": True,
             "_torchdynamo_wrapper_id": id(eager)}  # fmt: skip
    for key, value in marks.items():
        setattr(eager, key, value)
    return cast(Callable[P, R], eager)


def constant_when_compiled(fn: Callable[P, R]) -> Callable[P, R]:
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo``.

    That decorator only marks ``fn``; see :func:`eager_only` for why the import matters.
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def triton_available() -> bool:
    """Whether the Triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the backends that can run on ``device`` (default: any device here)."""
    names = ["torch"]
    if triton_available():
        dev = torch.device(device) if device is not None else None
        on_gpu = torch.cuda.is_available() if dev is None else dev.type == "cuda"
        if on_gpu or triton_interpreted():
            names.append("triton")
    return names


def _nondeterministic(what: str) -> None:
    """Refuse the Triton kernels under ``torch.use_deterministic_algorithms(True)``.

    As PyTorch's own ops without a deterministic implementation do (a warning in
    warn-only mode): they sum columns with atomics, whose order varies from run to run.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (f"flashot's Triton kernels ({what}) sum with atomic adds, whose order varies "
               "between runs, and have no deterministic implementation, but "
               "torch.use_deterministic_algorithms(True) is set: use backend='torch' (or "
               "'auto', which then takes it), which runs PyTorch's own ops")  # fmt: skip
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=3)
        return
    raise RuntimeError(message)


def resolve_backend(
    backend: str | Backend,
    device: torch.device,
    precision: str = "auto",
    dtype: torch.dtype = torch.float32,
    scores: str = "auto",
) -> Backend:
    """Turn a ``backend=`` argument into a backend instance for tensors on ``device``.

    Args:
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or a :class:`Backend` instance.
        device: where the data lives.
        precision: one of :data:`PRECISIONS`.
        dtype: the compute dtype (the Triton kernels compute in float32; float64
            problems run on the torch backend).
        scores: the Triton backend's ``scores`` option where one is made here
            (``"stream"`` keeps a solve's memory O((n + m) d)); an instance keeps its own.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(backend, Backend):
        if precision != "auto" and precision != backend.precision:
            raise ValueError(
                f"precision={precision!r} conflicts with the backend instance's "
                f"precision={backend.precision!r}"
            )
        if backend.name == "triton":
            _nondeterministic(repr(backend))
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or a Backend, got {backend!r}")
    if backend == "auto":  # the interpreter is for tests: auto stays on torch for CPU tensors
        on_gpu = device.type == "cuda" and "triton" in available_backends(device)
        # torch.use_deterministic_algorithms(True): PyTorch's own ops, which follow it
        exact = torch.are_deterministic_algorithms_enabled()
        backend = "triton" if on_gpu and dtype != torch.float64 and not exact else "torch"
    if backend == "triton":
        _nondeterministic("backend='triton'")
    if backend == "triton":
        if "triton" not in available_backends(device):
            raise ValueError(
                "backend='triton' needs the triton package and CUDA tensors "
                f"(or TRITON_INTERPRET=1 for CPU tensors); got tensors on {device}"
            )
        if dtype == torch.float64:
            raise ValueError(
                "backend='triton' computes in float32 (float16/bfloat16/float32 inputs); "
                "use backend='torch' for float64"
            )
        from flashot.backends.triton import TritonBackend

        return TritonBackend(precision, scores=scores)
    return TorchBackend(precision)
