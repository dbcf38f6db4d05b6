r"""Hessian-vector products of the converged entropic OT value, streamed.

For ``V(x, y) = OT_ε(a, x; b, y)`` (:func:`flashot.sinkhorn`'s ``cost``),

.. math::

    \nabla^2 V\, v = \frac{d}{dt} \nabla V(x + t v)\Big|_{t=0},

including how the potentials move with the points: ``∇V`` is written as the exact
gradient of the dual in the attention form, ``J_θᵀ ∂_θ L(z(θ), θ)``, with the
potentials ``z(θ)`` from :mod:`flashot.autodiff.implicit`
(:mod:`flashot.autodiff.second_order`); one reverse pass through it gives the
product: :func:`hvp` is a double backward of ``sinkhorn(...).cost``. The cost: a
solve, a few streaming passes, and a conjugate gradient solve of the dual system (two
plan products per iteration). Memory stays O((n + m) d); nothing of size n × m or (nd)² is formed.
"""

from __future__ import annotations

import contextlib

import torch

from flashot.autodiff.functional import refuse_transforms
from flashot.autodiff.implicit import add_optional, deferred_dual_solves
from flashot.autodiff.second_order import check_hvp_tol, dual_solve_options
from flashot.backends import entry_point
from flashot.ot import sinkhorn
from flashot.problem import cloud_tensor, weights_tensor

__all__ = ["HessianOperator", "hvp"]

WRT = ("x", "y", "xy")


def _ordinary(t):
    """An inference tensor's ordinary copy (anything else as it is)."""
    return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t


@entry_point
@refuse_transforms
def hvp(
    x: torch.Tensor,
    y: torch.Tensor,
    v,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    wrt: str = "x",
    eps: float,
    hvp_tol: float | None = None,
    cg_tol: float | None = None,
    cg_max_iter: int = 10_000,
    **sinkhorn_options,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    r"""Hessian-vector product of the converged OT value ``sinkhorn(x, y, a, b).cost``.

    Args:
        x: (n, d) source points.  y: (m, d) target points.
        v: the direction: shaped like x (``wrt="x"``), like y (``"y"``), a pair
            ``(v_x, v_y)`` (``"xy"``, the joint Hessian); or a batch ``(k, *shape)``
            of k directions (for ``"xy"``, a pair of batches): one Sinkhorn solve and
            first-order graph for all, a double backward per direction whose dual
            solves wait, then one CG with k columns (each of its passes streams the k
            right-hand sides at once: the dominant cost at tight ``cg_tol``).
        a: (n,) source weights or None.  b: (m,) target weights or None.
        wrt: ``"x"``, ``"y"`` or ``"xy"``.
        eps: ε.
        hvp_tol: the relative error asked of the product (default 1e-3 in float32,
            1e-8 in float64): the dual system is solved to the relative residual
            ``hvp_tol / 10``; see :func:`flashot.sinkhorn`. Diagnostics:
            :func:`flashot.record_dual_solves`; a solve that stops above its residual
            warns (:class:`~flashot.numerics.linalg.CGWarning`), naming the cause.
        cg_tol: the dual solve's relative residual itself, instead of ``hvp_tol``.
        cg_max_iter: CG iterations at most.
        **sinkhorn_options: passed to :func:`flashot.sinkhorn` (cost, rho, tol,
            max_iter, update, eps_schedule, backend, precision, ...). The Hessian is
            exact at the solve's potentials: use a tight ``tol``.

    Returns:
        ``H v`` shaped like ``v`` (a pair for ``"xy"``), detached; a tensor also for
        numpy inputs (taken as CPU tensors).
    """
    x, y, a, b = _clouds(x, y, a, b, wrt)
    dirs, batched = _directions(v, wrt, x, y)  # (checked before anything is solved)
    op = HessianOperator(x, y, a, b, wrt=wrt, eps=eps, hvp_tol=hvp_tol, cg_tol=cg_tol,
                         cg_max_iter=cg_max_iter, **sinkhorn_options)  # fmt: skip
    return op._apply(dirs, batched, keep_graph=False)


def _clouds(x, y, a, b, wrt):
    if wrt not in WRT:
        raise ValueError(f"wrt must be one of {WRT}, got {wrt!r}")
    x, y = cloud_tensor(x), cloud_tensor(y)  # numpy in, tensors out
    a = weights_tensor(a, x, "a") if isinstance(x, torch.Tensor) else a
    b = weights_tensor(b, y, "b") if isinstance(y, torch.Tensor) else b
    for t, name in ((x, "x"), (y, "y")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return x, y, a, b


def _directions(v, wrt, x, y) -> tuple[list[torch.Tensor], bool]:
    """The directions as a list (one per differentiated cloud) and whether a batch."""
    v = tuple(cloud_tensor(d) for d in v) if wrt == "xy" else cloud_tensor(v)
    targets = {"x": [x], "y": [y], "xy": [x, y]}[wrt]
    dirs = list(v) if wrt == "xy" else [v]
    if wrt == "xy" and len(dirs) != 2:
        raise ValueError("for wrt='xy', v must be a pair (v_x, v_y)")
    batched = None
    for t, d, name in zip(targets, dirs, ("v_x", "v_y") if wrt == "xy" else ("v",), strict=True):
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(d).__name__}")
        if d.shape not in (t.shape, d.shape[:1] + t.shape) or d.dim() not in (2, 3):
            raise ValueError(f"{name} must have shape {tuple(t.shape)} or (k, *{tuple(t.shape)}), "
                             f"got {tuple(d.shape)}")  # fmt: skip
        is_batch = d.dim() == 3
        if batched is not None and batched != is_batch:
            raise ValueError("v_x and v_y must both be single directions or both batches")
        batched = is_batch
        if not torch.isfinite(d).all():
            raise ValueError(f"{name} has non-finite entries")
    return [_ordinary(d) for d in dirs], bool(batched)


class HessianOperator:
    """The Hessian of the converged OT value at one solve, as a linear operator.

    ``H = HessianOperator(x, y, eps=0.1)`` solves once and keeps the first-order graph;
    each ``H(v)`` (or ``H @ v``) is then one double backward: the dual solve of
    :func:`hvp` without a new Sinkhorn solve. For iterative eigensolvers and Newton
    inner loops (:func:`flashot.numerics.linalg.lanczos`, :func:`flashot.numerics.linalg.cg` take
    :meth:`matvec`). Small problems on a CPU solve the dual system directly and keep
    its factor (:mod:`flashot.autodiff.dense_dual`), so later products cost
    milliseconds. Arguments as :func:`hvp`; ``v`` as there (a batch ``(k, *shape)``
    too).

    Attributes:
        shape: ``(N, N)``, N the entries of the differentiated cloud(s).
    """

    def __init__(self, x, y, a=None, b=None, *, wrt: str = "x", eps: float,
                 hvp_tol: float | None = None, cg_tol: float | None = None,
                 cg_max_iter: int = 10_000, **sinkhorn_options):  # fmt: skip
        x, y, a, b = _clouds(x, y, a, b, wrt)
        if cg_tol is not None and not (isinstance(cg_tol, (int, float)) and cg_tol > 0):
            raise ValueError(f"cg_tol must be a positive float, got {cg_tol!r}")
        hvp_tol = check_hvp_tol(hvp_tol)
        if hvp_tol is not None and cg_tol is not None:
            raise ValueError("give hvp_tol (the product's accuracy) or cg_tol (the dual "
                             "solve's residual), not both")  # fmt: skip
        if isinstance(cg_max_iter, bool) or not isinstance(cg_max_iter, int) or cg_max_iter < 1:
            raise ValueError(f"cg_max_iter must be a positive integer, got {cg_max_iter!r}")
        self.wrt, self._x, self._y = wrt, x, y
        self._solve_options = (cg_tol, cg_max_iter)
        # (an HVP is a double backward: under torch.inference_mode it runs outside it, on
        # ordinary copies of inference tensors, which autograd cannot record)
        with torch.inference_mode(False), torch.enable_grad():
            x, y, a, b = (_ordinary(t) for t in (x, y, a, b))
            xs = x.detach().requires_grad_(wrt in ("x", "xy"))
            ys = y.detach().requires_grad_(wrt in ("y", "xy"))
            self._inputs = [t for t in (xs, ys) if t.requires_grad]
            with dual_solve_options(*self._solve_options):
                cost = sinkhorn(xs, ys, a, b, eps=eps, hvp_tol=hvp_tol, **sinkhorn_options).cost
                self._first = torch.autograd.grad(cost, self._inputs, create_graph=True)
        size = sum(t.numel() for t in self._inputs)
        self.shape = (size, size)

    def __call__(self, v):
        """``H v``, shaped like ``v`` (see :func:`hvp`)."""
        dirs, batched = _directions(v, self.wrt, self._x, self._y)
        return self._apply(dirs, batched, keep_graph=True)

    __matmul__ = __call__

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` on flat vectors: (N,) → (N,), or a batch (N, k) → (N, k)."""
        if not isinstance(v, torch.Tensor) or v.shape[0] != self.shape[0] or v.dim() > 2:
            raise ValueError(f"v must have shape ({self.shape[0]},) or ({self.shape[0]}, k)")
        cols = v.reshape(self.shape[0], -1).T  # (k, N)
        parts = torch.split(cols, [t.numel() for t in self._inputs], dim=1)
        dirs = [p.reshape(-1, *t.shape) for p, t in zip(parts, self._inputs, strict=True)]
        out = self._apply(dirs, True, keep_graph=True)
        out = out if isinstance(out, tuple) else (out,)
        flat = torch.cat([o.reshape(o.shape[0], -1) for o in out], dim=1).T
        return flat.reshape(v.shape).to(v.dtype)

    def _apply(self, dirs, batched: bool, keep_graph: bool):
        inputs, first = self._inputs, self._first
        with (torch.inference_mode(False), torch.enable_grad(),
              dual_solve_options(*self._solve_options)):  # fmt: skip
            count = dirs[0].shape[0] if batched else 1
            # the directions' dual solves wait, then run as the columns of one CG
            with deferred_dual_solves() if count > 1 else contextlib.nullcontext() as deferred:
                outs = []
                for i in range(count):
                    if deferred is not None:
                        deferred.direction = i
                    di = [(d[i] if batched else d).to(t.dtype)
                          for d, t in zip(dirs, first, strict=True)]  # fmt: skip
                    # (finish needs the graph; the operator keeps it for later products)
                    keep = keep_graph or deferred is not None or i + 1 < count
                    hv = torch.autograd.grad(first, inputs, grad_outputs=di, allow_unused=True,
                                             retain_graph=keep)  # fmt: skip
                    outs.append(list(hv))
            if deferred is not None:
                for i, owed in enumerate(deferred.finish(inputs, count)):
                    outs[i] = [add_optional(h, o) for h, o in zip(outs[i], owed, strict=True)]
            outs = [[torch.zeros_like(t) if h is None else h.detach()
                     for h, t in zip(o, inputs, strict=True)] for o in outs]  # fmt: skip
        stacked = [torch.stack([o[j] for o in outs]) if batched else outs[0][j]
                   for j in range(len(inputs))]  # fmt: skip
        return tuple(stacked) if self.wrt == "xy" else stacked[0]
