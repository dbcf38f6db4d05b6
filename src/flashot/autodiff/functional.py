r"""``torch.func.grad``, ``vjp`` and ``jacrev`` of flashot's scalar losses.

flashot's solvers stream through Triton kernels and autograd Functions written for
``torch.autograd``; under a ``torch.func`` transform their inputs are wrapped tensors
that the kernels cannot read. One level of reverse mode is supported by running the
whole call inside one :class:`torch.autograd.Function` (``setup_context`` style, which
``torch.func`` unwraps): its forward computes the value ``L`` and, with
``torch.autograd`` on the plain tensors, the gradients ``∂L/∂t`` of the inputs that the
transform tracks; its backward returns ``ḡ · ∂L/∂t``. The gradients are those of
``torch.autograd.grad`` on the same call (the envelope gradients, or the exact ones
where the call uses them).

Not supported, with a clear error: nested transforms (``hessian``, ``jacrev(grad(·))``,
``jacfwd``: the saved gradients are constants to an outer level, which would silently see
zero second derivatives; use ``torch.autograd.grad(create_graph=True)`` or
:func:`flashot.hvp`), ``jvp``, ``vmap`` (use batched clouds, ``(B, n, d)``, with
:class:`flashot.SamplesLoss`), and non-scalar values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["TRANSFORM_HELP", "functional_transforms", "refuse_transforms"]

P = ParamSpec("P")
R = TypeVar("R")

TRANSFORM_HELP = (
    "flashot supports one level of torch.func.grad / vjp / jacrev over its scalar losses "
    "(sinkhorn(...).cost, sinkhorn_divergence, SamplesLoss); {what} is not supported: for "
    "second derivatives use torch.autograd.grad(create_graph=True) or flashot.hvp, for a "
    "batch use (B, n, d) clouds with flashot.SamplesLoss"
)


def _transform_stack() -> list:
    stack = torch._C._functorch.get_interpreter_stack()
    return list(stack) if stack else []


def functional_transforms(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap an entry point returning a 0-dim loss or a result with a ``cost`` field.

    Without a ``torch.func`` transform the call is unchanged. Under exactly one
    ``grad``/``vjp``/``jacrev`` level it runs through :class:`_WholeCall` (see the
    module); under anything else it raises a ``RuntimeError`` naming the transform.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        stack = _transform_stack()
        if not stack:
            return fn(*args, **kwargs)
        grad = torch._C._functorch.TransformType.Grad
        if len(stack) > 1 or stack[0].key() != grad:
            names = " inside ".join(str(i.key()).split(".")[-1] for i in reversed(stack))
            raise RuntimeError(TRANSFORM_HELP.format(what=f"torch.func {names}"))
        leaves: list = []
        template = _flatten((args, kwargs), leaves)
        tracked = tuple(
            bool(t.is_floating_point() and torch._C._functorch.is_gradtrackingtensor(t))
            for t in leaves
        )
        holder = _Box()  # not a pytree container: functorch would pass a copy
        value, *_ = _WholeCall.apply(fn, template, tracked, holder, *leaves)
        result = holder.result
        if isinstance(result, torch.Tensor):
            return value
        return dataclasses.replace(result, cost=value)

    return wrapper


def refuse_transforms(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap an entry point with no ``torch.func`` path: a clear error under any transform."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _transform_stack():
            raise RuntimeError(TRANSFORM_HELP.format(what=f"torch.func over {fn.__name__}"))
        return fn(*args, **kwargs)

    return wrapper


def _flatten(obj, leaves: list):
    """``obj`` with each tensor replaced by its index in ``leaves`` (tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _Leaf(len(leaves) - 1)
    if isinstance(obj, tuple | list):
        return type(obj)(_flatten(o, leaves) for o in obj)
    if isinstance(obj, dict):
        return {k: _flatten(v, leaves) for k, v in obj.items()}
    return obj


def _rebuild(obj, leaves):
    if isinstance(obj, _Leaf):
        return leaves[obj.index]
    if isinstance(obj, tuple | list):
        return type(obj)(_rebuild(o, leaves) for o in obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, leaves) for k, v in obj.items()}
    return obj


@dataclasses.dataclass(frozen=True)
class _Leaf:
    index: int


class _Box:
    """The whole call's result, handed out of the Function's forward."""

    result: object = None


class _WholeCall(torch.autograd.Function):
    """``(L, ∂L/∂t for each tracked t)`` of one whole call, on plain tensors."""

    @staticmethod
    def forward(fn, template, tracked, holder, *leaves):
        inputs = [t.detach().requires_grad_() if w else t.detach() for t, w in
                  zip(leaves, tracked, strict=True)]  # fmt: skip
        with torch.enable_grad():
            args, kwargs = _rebuild(template, inputs)
            result = fn(*args, **kwargs)
            value = result if isinstance(result, torch.Tensor) else result.cost
            if value.dim() != 0:
                raise RuntimeError(TRANSFORM_HELP.format(what=f"a value of shape "
                                                              f"{tuple(value.shape)}"))  # fmt: skip
            wanted = [t for t, w in zip(inputs, tracked, strict=True) if w]
            grads = [None] * len(wanted)
            if wanted and value.requires_grad:
                grads = list(torch.autograd.grad(value, wanted, allow_unused=True))
        holder.result = result
        grads = [
            torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads, strict=True)
        ]
        return (value.detach(), *grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.tracked = inputs[2]
        ctx.save_for_backward(*output[1:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, grad_value, *_):
        grads = iter(ctx.saved_tensors)
        per_leaf = [grad_value * next(grads) if w else None for w in ctx.tracked]
        return (None, None, None, None, *per_leaf)
