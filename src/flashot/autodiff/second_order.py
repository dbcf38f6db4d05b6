r"""Double backward of OT values: exact second derivatives through ``create_graph=True``.

The first-order graph of a flashot value (the envelope theorem: one extrapolation
step differentiated, the other potential held fixed) gives exact gradients but not
exact derivatives of them. :func:`exact_second_order` wraps a value so that

- a plain backward passes through that graph unchanged (same numbers, same cost);
- a backward with ``create_graph=True`` returns instead the exact gradient in the
  attention form, ``∂_θ L(z(θ), θ)`` with implicit potentials
  (:func:`~flashot.autodiff.implicit.value_gradient`), an expression autograd can
  differentiate again: its derivative is the exact Hessian (any composition, e.g.
  points = model(θ), follows by the chain rule).

A value is a weighted sum of *pieces*, each an OT problem's dual value, plus for
GeomLoss' relaxed terms (:func:`~flashot.autodiff.functions.dual_term`) the mass
terms ``ε/2 (m(a) + m(b)) − ε m(a) m(b)`` by which they differ from it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flashot.autodiff.implicit import DualSpec, implicit_potentials, value_gradient

__all__ = ["Piece", "default_cg_tol", "dual_solve_options", "exact_second_order"]

#: (cg_tol or None for the dtype's default, cg_max_iter) of the dual solves
_OPTIONS = [(None, 10_000)]


def default_cg_tol(dtype: torch.dtype) -> float:
    """Relative residual of the dual solves: 1e-10 in float64, 1e-5 otherwise."""
    return 1e-10 if dtype == torch.float64 else 1e-5


@contextlib.contextmanager
def dual_solve_options(cg_tol: float | None = None, cg_max_iter: int = 10_000):
    """Within the block, values built take these CG options for their dual solves."""
    _OPTIONS.append((cg_tol, int(cg_max_iter)))
    try:
        yield
    finally:
        _OPTIONS.pop()


@dataclass(frozen=True)
class Piece:
    """One OT problem in a value: ``weight · (OT(θ) [+ GeomLoss' mass terms])``.

    Attributes:
        weight: its coefficient in the value.
        theta: (q, α, k, β, a, b) with their autograd history.
        f: (n,), g: (m,) its converged potentials (detached).
        spec: its :class:`~flashot.autodiff.implicit.DualSpec`.
        geomloss_mass: add ``ε/2 (m(a) + m(b)) − ε m(a) m(b)`` (relaxed GeomLoss terms).
    """

    weight: float
    theta: tuple
    f: torch.Tensor
    g: torch.Tensor
    spec: DualSpec
    geomloss_mass: bool = False


class _ExactSecondOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, pieces, *thetas):
        ctx.pieces = pieces
        ctx.save_for_backward(*thetas)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        thetas = ctx.saved_tensors
        if not torch.is_grad_enabled():  # first order: the envelope graph, unchanged
            return (grad, None) + (None,) * len(thetas)
        out = []
        for i, piece in enumerate(ctx.pieces):
            theta = thetas[6 * i : 6 * i + 6]
            z = implicit_potentials(theta, piece.f, piece.g, piece.spec)
            grads = list(value_gradient(theta, z, piece.spec))
            if piece.geomloss_mass:
                eps, a, b = piece.spec.eps, theta[4], theta[5]
                grads[4] = grads[4] + eps * (0.5 - b.sum())
                grads[5] = grads[5] + eps * (0.5 - a.sum())
            out += [(piece.weight * grad) * t for t in grads]
        return (None, None, *out)


def exact_second_order(value: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """``value`` with exact second derivatives (see module); unchanged without autograd."""
    if not (torch.is_grad_enabled() and value.requires_grad):
        return value
    thetas = [t for p in pieces for t in p.theta]
    return _ExactSecondOrder.apply(value, tuple(pieces), *thetas)


def spec_of(problem, f_dtype: torch.dtype, rho=None) -> DualSpec:
    """The :class:`DualSpec` of a :class:`~flashot.problem.Problem` (``rho`` overrides)."""
    rho = (problem.rho_x, problem.rho_y) if rho is None else rho
    tol, max_iter = _OPTIONS[-1]
    return DualSpec(problem.eps, rho, problem.engine, problem.form.cost_bound,
                    tol or default_cg_tol(f_dtype), max_iter)  # fmt: skip
