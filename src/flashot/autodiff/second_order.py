r"""Double backward of OT values: second derivatives through ``create_graph=True``.

The first-order graph of a flashot value (the envelope theorem: one extrapolation
step differentiated, the other potential held fixed) gives the gradient but not its
derivative. :func:`exact_second_order` wraps a value so that

- a plain backward passes through that graph unchanged (same numbers, same cost);
- a backward with ``create_graph=True`` returns the same numbers (the first-order graph's,
  evaluated without a graph of its own) plus, per piece, a term of value zero whose
  derivative is that of the gradient: ``G + (G_θ − G_θ.detach())`` with ``G_θ`` an
  expression autograd can differentiate again (any composition, e.g. points = model(θ),
  follows by the chain rule). So the gradient never depends on ``create_graph``.

``G_θ`` is, for a solve run to a tolerance, the exact gradient of the converged value in
the attention form, ``∂_θ L(z(θ), θ)`` with implicit potentials
(:func:`~flashot.autodiff.implicit.value_gradient`): its derivative is the Hessian of the
converged problem. For a fixed-iteration solve (``tol=None``, GeomLoss' schedules,
:class:`flashot.SamplesLoss`), whose potentials are not converged, it is the envelope
gradient with the iterations replayed (:mod:`flashot.autodiff.unrolled`): its derivative
is that of the gradient the solve returns.

A value is a weighted sum of *pieces*, each an OT problem's dual value, plus for
GeomLoss' relaxed terms (:func:`~flashot.autodiff.functions.dual_term`) the mass
terms ``ε/2 (m(a) + m(b)) − ε m(a) m(b)`` by which they differ from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashot.autodiff.implicit import (
    MARGINAL_PER_ERROR,
    RESIDUAL_PER_ERROR,
    DualSpec,
    implicit_potentials,
    other_masses,
    refine_potentials,
    value_gradient,
)
from flashot.autodiff.replay import mirrors, unrolled_potentials
from flashot.autodiff.unrolled import Trajectory, envelope_gradient
from flashot.backends import entry_point

__all__ = [
    "DEFAULT_HVP_TOL",
    "Piece",
    "check_hvp_tol",
    "dual_solve_options",
    "exact_second_order",
    "hvp_tol_for",
    "packed_piece",
]

#: the relative error of HVPs a value's second derivatives aim at, by dtype (``hvp_tol``)
DEFAULT_HVP_TOL = {torch.float64: 1e-8}
#: ... for every other dtype (float32 and the half precisions, which compute in float32)
DEFAULT_HVP_TOL_32 = 1e-3

#: (cg_tol or None for the accuracy option's, cg_max_iter) of the dual solves: internal
#: overrides (benchmarks, :func:`flashot.hvp`'s expert ``cg_tol``)
_OPTIONS: list[tuple[float | None, int]] = [(None, 10_000)]


def hvp_tol_for(dtype: torch.dtype, hvp_tol: float | None = None) -> float:
    """``hvp_tol``, or its default for ``dtype``: 1e-8 in float64, 1e-3 otherwise."""
    return hvp_tol if hvp_tol is not None else DEFAULT_HVP_TOL.get(dtype, DEFAULT_HVP_TOL_32)


def check_hvp_tol(hvp_tol) -> float | None:
    """``hvp_tol`` validated: None or a float in (0, 1)."""
    if hvp_tol is None:
        return None
    if isinstance(hvp_tol, bool) or not isinstance(hvp_tol, (int, float)) or not 0 < hvp_tol < 1:
        raise ValueError(f"hvp_tol must be None or a float in (0, 1), got {hvp_tol!r}")
    return float(hvp_tol)


@contextlib.contextmanager
def dual_solve_options(cg_tol: float | None = None, cg_max_iter: int = 10_000):
    """Within the block, values built take these CG options for their dual solves.

    ``cg_tol`` (the solves' relative residual) overrides the values' ``hvp_tol``.
    """
    _OPTIONS.append((cg_tol, int(cg_max_iter)))
    try:
        yield
    finally:
        _OPTIONS.pop()


@dataclass(frozen=True)
class Piece:
    """One OT problem in a value: ``weight · (OT(θ) [+ GeomLoss' mass terms])``.

    Attributes:
        weight: its coefficient in the value; for a packed batch (``spec.segments``) a
            (B,) tensor, one per problem, and the value is (B,).
        sources: the tensors θ comes from, with their autograd history: θ = (q, α, k, β,
            a, b) itself, or the arguments of ``build``.
        f: (n,), g: (m,) its converged potentials (detached).
        spec: its :class:`~flashot.autodiff.implicit.DualSpec`.
        geomloss_mass: add ``ε/2 (m(a) + m(b)) − ε m(a) m(b)`` (relaxed GeomLoss terms).
        build: ``sources ↦ θ``, run only when a second derivative is asked for (so a
            first-order call does not pay for forms it never uses); None: θ = sources.
        trajectory: how a fixed-iteration solve ran (its second derivatives are those of
            its returned gradient, :mod:`~flashot.autodiff.unrolled`); None for a solve
            to a tolerance (the converged problem's, by implicit differentiation).
        mirror: a self problem OT(a, a): ``build`` makes θ's columns (k, β, b) the same
            functions of the sources as its rows (q, α, a), for a symmetric cost; its
            trajectory replays as a mirror (:mod:`~flashot.autodiff.replay`).

    A piece's sources are leaves of its value's first-order graph as far as the other
    pieces go: none is computed from another piece's source.
    """

    weight: float | torch.Tensor
    sources: tuple
    f: torch.Tensor
    g: torch.Tensor
    spec: DualSpec
    geomloss_mass: bool = False
    build: Callable | None = None
    trajectory: Trajectory | None = None
    mirror: bool = False

    @property
    def kind(self) -> str:
        """How the value writes this problem (:func:`~flashot.autodiff.unrolled.dual_partials`)."""
        if self.spec.rho == (None, None):
            return "plain"
        return "geomloss" if self.geomloss_mass else "dual"


def _piece_gradient(piece: Piece, sources, grad) -> list:
    """``grad · weight · ∂(piece)/∂sources``, an expression autograd can differentiate again."""
    if not any(s.requires_grad for s in sources):  # (a fixed cloud's self problem)
        return [None] * len(sources)
    theta = piece.build(*sources) if piece.build is not None else sources
    if piece.trajectory is not None:
        # one list of operand conversions for the replay, its backward and the envelope
        spec = dataclasses.replace(piece.spec, operands=[])
        mirror = piece.mirror and mirrors(piece.trajectory, spec, theta)
        z = unrolled_potentials(theta, piece.trajectory, spec, mirror)
        grads = list(envelope_gradient(theta, z, piece.trajectory, spec, piece.kind, mirror))
    else:
        # (the converged problem's Hessian: potentials as converged as the accuracy asks)
        target = piece.spec.cg_tol / RESIDUAL_PER_ERROR * MARGINAL_PER_ERROR
        f, g, _ = refine_potentials(theta, piece.f, piece.g, piece.spec, target)
        z = implicit_potentials(theta, f, g, piece.spec, check_gauge=False)
        grads = list(value_gradient(theta, z, piece.spec))
        if piece.geomloss_mass:
            eps, a, b, seg = piece.spec.eps, theta[4], theta[5], piece.spec.segments
            grads[4] = grads[4] + eps * (0.5 - other_masses(b, seg, a))
            grads[5] = grads[5] + eps * (0.5 - other_masses(a, None if seg is None else seg.T, b))
    grads = _scaled(grads, piece.weight * grad, piece.spec.segments)
    if piece.build is None:
        return grads
    merged: dict[int, tuple] = {}  # θ may hold a source twice (a self problem's weights)
    for t, gt in zip(theta, grads, strict=True):
        if t.requires_grad and gt is not None:  # (a mirror's columns: in its rows' slots)
            old = merged.get(id(t))
            merged[id(t)] = (t, gt if old is None else old[1] + gt)
    # a source given twice (x and y of a self problem) gets its gradient once
    wanted = list({id(s): s for s in sources if s.requires_grad}.values())
    outs = [t for t, _ in merged.values()]
    if not (wanted and outs):
        return [None] * len(sources)
    found = torch.autograd.grad(outs, wanted, grad_outputs=[gt for _, gt in merged.values()],
                                create_graph=True, allow_unused=True)  # fmt: skip
    by_id = {id(s): gs for s, gs in zip(wanted, found, strict=True)}
    return [by_id.pop(id(s), None) for s in sources]


def _scaled(grads: list, scale, segments) -> list:
    """``scale · t`` for θ's gradients; a packed value's (B,) scale per row and column."""
    if segments is None or scale.dim() == 0:
        return [None if t is None else scale * t for t in grads]
    rows, cols = segments.row_ids(scale.device), segments.T.row_ids(scale.device)
    ids = (rows, rows, cols, cols, rows, cols)  # q, α, k, β, a, b
    out = []
    for t, i in zip(grads, ids, strict=True):
        s = scale[i]
        out.append(None if t is None else s.reshape(s.shape + (1,) * (t.dim() - 1)) * t)
    return out


class _ExactSecondOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, pieces, *sources):
        ctx.pieces, ctx.value = pieces, value  # (the value with its first-order graph)
        ctx.save_for_backward(*sources)
        return value.detach().clone()

    @staticmethod
    @entry_point
    def backward(ctx, grad):
        sources = ctx.saved_tensors
        if not torch.is_grad_enabled():  # first order: the envelope graph, unchanged
            return (grad, None) + (None,) * len(sources)
        # the numbers of a plain backward (no graph: the first-order graph's nodes are
        # differentiable once), then per piece a zero carrying the second derivatives
        wanted = list({id(s): s for s in sources if s.requires_grad}.values())
        first = torch.autograd.grad(ctx.value, wanted, grad, retain_graph=True,
                                    allow_unused=True) if wanted else ()  # fmt: skip
        plain = {id(s): g for s, g in zip(wanted, first, strict=True)}
        out, start = [], 0
        for piece in ctx.pieces:
            count = len(piece.sources)
            out += _piece_gradient(piece, sources[start : start + count], grad)
            start += count
        return (None, None, *(_with_curvature(plain.pop(id(s), None), g)
                              for s, g in zip(sources, out, strict=True)))  # fmt: skip


def _with_curvature(value, carrier):
    """``value + (carrier − carrier.detach())``: value's numbers, carrier's derivatives."""
    if carrier is None:
        return value
    zero = carrier - carrier.detach()
    return zero if value is None else value + zero


def exact_second_order(value: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """``value`` with exact second derivatives (see module); unchanged without autograd."""
    if not (torch.is_grad_enabled() and value.requires_grad):
        return value
    sources = [t for p in pieces for t in p.sources]
    return _ExactSecondOrder.apply(value, tuple(pieces), *sources)


def packed_piece(pp, f, g, hvp_tol=None, trajectory=None, geomloss=False) -> Piece:
    """The second-order piece of a packed batch (:class:`~flashot.packing.PackedProblem`).

    Its (B,) value weighs problem s by ``ε_s/ε_0`` (each solved at the common ε_0).
    """
    pf = pp.form
    tol, max_iter = _OPTIONS[-1]
    if tol is None:
        tol = hvp_tol_for(pf.q.dtype, hvp_tol) * RESIDUAL_PER_ERROR
    spec = DualSpec(pp.eps0, tuple(pp.rho), pp.engine, pf.cost_bound, tol, max_iter, pf.segments)
    weight = (pp.eps / pp.eps0).to(device=f.device, dtype=f.dtype)

    def theta(x, y, a, b):  # the packed form's own tensors (α is computed from q: sources
        return pf.q, pf.alpha, pf.k, pf.beta, a, b  # must be the clouds, not q and α)

    return Piece(weight, (pp.x, pp.y, pp.a, pp.b), f.detach(), g.detach(), spec,
                 geomloss and pp.rho != (None, None), theta, trajectory)  # fmt: skip


def spec_of(problem, f_dtype: torch.dtype, hvp_tol: float | None = None) -> DualSpec:
    """The :class:`DualSpec` of a :class:`~flashot.problem.Problem`.

    Its dual solves reach the relative residual ``hvp_tol · RESIDUAL_PER_ERROR``
    (:func:`hvp_tol_for`'s default for ``f_dtype`` when None) unless
    :func:`dual_solve_options` sets one.
    """
    tol, max_iter = _OPTIONS[-1]
    if tol is None:
        tol = hvp_tol_for(f_dtype, hvp_tol) * RESIDUAL_PER_ERROR
    return DualSpec(problem.eps, (problem.rho_x, problem.rho_y), problem.engine,
                    problem.form.cost_bound, tol, max_iter)  # fmt: skip
