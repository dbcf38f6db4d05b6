r"""flashot's losses as ``torch.library`` custom ops: whole calls inside a compiled graph.

Under ``torch.compile`` a loss that returns a tensor (:class:`~flashot.SamplesLoss`
values, :func:`~flashot.sinkhorn_divergence`, :func:`sinkhorn_cost`) is one opaque
node, ``flashot::loss``, with a fake (meta) implementation for tracing: the solve's
host logic (validation, tolerance checks, launch choices) runs when the node runs, never
in the trace, so ``fullgraph=True`` works and a training step compiles once.

The node returns the value and, when an input needs a gradient, the envelope gradients
w.r.t. the clouds and weights, computed in the same call by the eager code path (the
final differentiated step of a solve costs one streaming pass); its backward scales
them by the incoming gradient. Second derivatives through the node are refused:
differentiate the eager functions twice instead. :func:`flashot.sinkhorn` returns a
result object (plan, potentials), which no graph can hold: it keeps one graph break.
"""

import contextlib
import functools
import json
from collections.abc import Callable
from typing import ParamSpec, TypeVar, cast

import torch

from flashot.backends import constant_when_compiled
from flashot.problem import compute_dtype

__all__ = ["compiled_loss", "encodable", "node_when_compiling", "sinkhorn_cost"]

P = ParamSpec("P")
R = TypeVar("R")
_EMPTY = (0,)
#: what the node's options may hold (JSON): numbers, strings, booleans and None
_KINDS = ("samples_loss", "divergence", "sinkhorn")


def _evaluate(kind: str, x, y, a, b, options: dict) -> torch.Tensor:
    """The eager value of one call (a tensor: () or (B,))."""
    import flashot  # (flashot imports this module)

    if kind == "samples_loss":
        loss = flashot.SamplesLoss(**options)
        return loss._forward(x, y) if a is None and b is None else loss._forward(a, x, b, y)
    if kind == "divergence":
        return flashot.sinkhorn_divergence(x, y, a, b, **options)
    return flashot.sinkhorn(x, y, a, b, **options).cost


#: the autograd dispatch keys a custom op's implementation runs without
_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in
                       ("AutogradFunctionality", "AutogradOther", "ADInplaceOrView")
                       if hasattr(torch._C.DispatchKey, name))  # fmt: skip


@contextlib.contextmanager
def _autograd_inside():
    """Autograd back on inside the node's implementation.

    The dispatcher excludes it there (thread-locally); the eager loss then computes its
    envelope gradients as usual.
    """
    tls = torch._C
    excluded = [k for k in _AUTOGRAD_KEYS if tls._dispatch_tls_is_dispatch_key_excluded(k)]
    for k in excluded:
        tls._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        yield
    finally:
        for k in excluded:
            tls._dispatch_tls_set_dispatch_key_excluded(k, True)


@torch.library.custom_op("flashot::loss", mutates_args=())
def _loss_op(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None,
    kind: str, options: str, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(value, ∂x, ∂y, ∂a, ∂b)``: the value and the gradients of ``value.sum()``.

    Without ``with_grad`` (and for absent inputs) the gradients are empty tensors.
    """
    opts = json.loads(options)
    inputs = [x, y, a, b]
    with torch.enable_grad(), _autograd_inside():
        leaves = [None if t is None else t.detach().requires_grad_(with_grad) for t in inputs]
        value = _evaluate(kind, leaves[0], leaves[1], leaves[2], leaves[3], opts)
        grads: list = [None] * 4
        if with_grad:
            wanted = [t for t in leaves if t is not None]
            found = torch.autograd.grad(value.sum(), wanted, allow_unused=True)
            it = iter(found)
            grads = [None if t is None else next(it) for t in leaves]
    out = [value.detach().clone()]
    for g, t in zip(grads, inputs, strict=True):
        if g is None and t is not None and with_grad:
            g = torch.zeros_like(t)  # (an input the value does not depend on)
        out.append(x.new_empty(_EMPTY) if g is None else g.detach())
    return out[0], out[1], out[2], out[3], out[4]


@_loss_op.register_fake
def _loss_fake(x, y, a, b, kind, options, with_grad):
    value = x.new_empty(x.shape[:-2], dtype=compute_dtype(x.dtype))  # (the dtype rule)
    parts = [t if (with_grad and t is not None) else None for t in (x, y, a, b)]
    grads = [x.new_empty(_EMPTY) if t is None else torch.empty_like(t) for t in parts]
    return value, grads[0], grads[1], grads[2], grads[3]


def _setup(ctx, inputs, output):
    ctx.with_grad = inputs[6]
    ctx.save_for_backward(*output[1:])
    ctx.present = [t is not None for t in inputs[:4]]


def _backward(ctx, grad_value, *unused):
    if torch.is_grad_enabled():
        raise RuntimeError("second derivatives through flashot::loss (a compiled flashot "
                           "loss) are not supported: differentiate the eager call "
                           "twice")  # fmt: skip
    if not ctx.with_grad:
        raise RuntimeError("flashot::loss ran without gradients (no input required one)")
    out = []
    for g, present in zip(ctx.saved_tensors, ctx.present, strict=True):
        if not present:
            out.append(None)
            continue
        scale = grad_value.reshape(grad_value.shape + (1,) * (g.dim() - grad_value.dim()))
        out.append(scale * g)
    return out[0], out[1], out[2], out[3], None, None, None


_loss_op.register_autograd(_backward, setup_context=_setup)


def compiled_loss(kind: str, x, y, a=None, b=None, **options) -> torch.Tensor:
    """The value of a flashot loss through the ``flashot::loss`` node (see module).

    Args:
        kind: ``"samples_loss"`` (options: :class:`~flashot.SamplesLoss`'s keywords),
            ``"divergence"`` (:func:`~flashot.sinkhorn_divergence`'s) or ``"sinkhorn"``
            (:func:`~flashot.sinkhorn`'s; the value is ``result.cost``).
        x: (N, D) or (B, N, D) points.  y: (M, D) or (B, M, D).
        a, b: weights or None.
        options: JSON-serializable keyword options (a backend by name).

    Returns:
        The value, () or (B,), differentiable once in x, y, a, b.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    encoded = _encode(options)
    inputs = [t for t in (x, y, a, b) if t is not None]
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return _loss_op(x, y, a, b, kind, encoded, with_grad)[0]


@constant_when_compiled
def _encode(options: dict) -> str:
    """The options as the node's JSON string (a trace-time constant under torch.compile)."""
    try:
        return json.dumps(options, sort_keys=True)
    except TypeError as err:
        raise TypeError(f"compiled flashot losses take JSON options (a backend by name), "
                        f"got {options!r}") from err  # fmt: skip


def encodable(options: dict) -> bool:
    """Whether options can travel in the node (else the call stays an eager graph break)."""
    try:
        json.dumps(options)
    except TypeError:
        return False
    return True


def sinkhorn_cost(x, y, a=None, b=None, **options) -> torch.Tensor:
    """``flashot.sinkhorn(x, y, a, b, **options).cost`` as one graph node (fullgraph-safe).

    Options as :func:`flashot.sinkhorn` (JSON-serializable: a backend by name).
    """
    return compiled_loss("sinkhorn", x, y, a, b, **options)


def node_when_compiling(kind: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Route a loss function through the node while torch.compile traces it.

    Eagerly (and for options that are not JSON, e.g. a backend instance) the function
    runs as written.
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(x, y, a=None, b=None, **options):
            if torch.compiler.is_compiling() and _plain(options):
                return compiled_loss(kind, x, y, a, b, **options)
            return fn(x, y, a, b, **options)

        # (wraps copied torch.compiler.disable's markers: this wrapper is to be traced)
        for name in [k for k in wrapper.__dict__ if k.startswith("_torchdynamo")]:
            del wrapper.__dict__[name]
        return cast(Callable[P, R], wrapper)

    return decorate


@constant_when_compiled
def _plain(options: dict) -> bool:
    return encodable(options)
