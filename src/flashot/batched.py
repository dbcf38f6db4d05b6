r"""Many problems in one solve: batched (B, n, d) clouds and ragged (packed) batches.

The B problems are packed end to end (:mod:`flashot.geometry.segments`) into one block-diagonal
problem, which the one Sinkhorn loop (:func:`flashot.solver.loop.solve`) iterates as a
whole: each step is one streaming pass per side over the diagonal blocks only (one
kernel launch for the batch on the Triton backend), and since the packed cost is
``+inf`` between problems, the packed iterates are the B problems' own iterates.

Per-problem ε. Problem ``s`` at ``ε_s`` is solved as the problem with cost
``C^{(s)} ε_0 / ε_s`` at the common ``ε_0 = max_s ε_s`` (the clouds' centered
coordinates scaled by ``√(ε_0/ε_s)`` before any rounding), which has the same plan and
potentials ``f^{(s)} ε_0 / ε_s``:

.. math::

    \mathrm{OT}_{\varepsilon}(C) = \tfrac{\varepsilon}{\varepsilon_0}\,
        \mathrm{OT}_{\varepsilon_0}\big(C\,\varepsilon_0/\varepsilon\big).

Stopping: the loop measures the sum of the problems' L1 marginal errors, so ``tol``
bounds every problem's error; each problem's ``converged`` is then judged on its own
error (and, with ``tol="auto"``, its own precision floor).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashot.autodiff.functions import relaxed_side
from flashot.autodiff.second_order import exact_second_order, packed_piece
from flashot.autodiff.unrolled import Trajectory
from flashot.backends import entry_point
from flashot.backends.dual import Potentials, phi_sum
from flashot.caller import warn_at_caller
from flashot.geometry.segments import Segments
from flashot.packing import PackedProblem, _eps_per_problem, pack_problems, pair_packing
from flashot.problem import check_init, read_finite, weights_tensor
from flashot.result import TransportPlan
from flashot.solver.loop import EpsilonScaling, temperatures
from flashot.solver.stopping import (
    ConvergenceWarning,
    FloorTolerance,
    precision_floor,
    resolve_stopping,
)

__all__ = [
    "BatchedPlan",
    "BatchedSinkhornResult",
    "PackedProblem",
    "pack_problems",
    "pair_packing",
    "sinkhorn_batched",
    "sinkhorn_varlen",
]


@dataclass(frozen=True)
class BatchedSinkhornResult:
    """The outcome of a batched or ragged solve (immutable).

    Attributes:
        f: potentials on the x clouds: (B, n) for batched input, packed (N,) for ragged.
        g: potentials on the y clouds: (B, m), or packed (M,).
        cost: (B,) entropic OT values (balanced: ``⟨a, f⟩ + ⟨b, g⟩`` per problem),
            differentiable twice w.r.t. the clouds and weights (envelope theorem, then
            :mod:`flashot.autodiff.second_order`, one dual solve for the whole batch).
        n_iter: (B,) int64 iterations run; the batch iterates together, so every entry
            is the batch's count.
        converged: (B,) bool, each problem's error within ``tol`` (None without tol).
        measured_error: (B,) float64 L1 marginal error of each problem's plan when the
            solve measured it (with a ``tol``), else None: :attr:`marginal_error` then
            measures it on first access (one pass over the plans).
        eps: (B,) float64, each problem's ε.
        plan: the lazy transport plans (:class:`BatchedPlan`).
        x_offsets: (B + 1,) int64 row offsets of the packing.
        y_offsets: (B + 1,) int64 column offsets.
    """

    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    n_iter: torch.Tensor
    converged: torch.Tensor | None
    measured_error: torch.Tensor | None
    eps: torch.Tensor
    plan: BatchedPlan
    x_offsets: torch.Tensor
    y_offsets: torch.Tensor

    @functools.cached_property
    def marginal_error(self) -> torch.Tensor:
        """(B,) float64 L1 marginal error of each problem's plan (measured if needed)."""
        if self.measured_error is not None:
            return self.measured_error
        p = self.plan.packed
        r, c, _ = p._sums()
        seg = p._form.segments
        assert seg is not None
        return _errors(seg, r, c, p._f, p._g, p._log_a, p._log_b, p._rho).cpu()

    def __repr__(self) -> str:
        """One line: the batch size, the values' range and how many converged."""
        b = len(self.cost)
        conv = "None" if self.converged is None else f"{int(self.converged.sum())}/{b}"
        return (f"BatchedSinkhornResult(B={b}, cost=[{float(self.cost.detach().min()):.6g}, "
                f"{float(self.cost.detach().max()):.6g}], n_iter={int(self.n_iter[0])}, "
                f"converged={conv})")  # fmt: skip


class BatchedPlan:
    """The B lazy plans of a batch: ``plan @ V`` applies every problem's plan at once.

    ``V`` is (B, m, p) or (B, m) for batched results and packed (M, p) or (M,) for
    ragged ones; the product has the rows' layout. ``packed`` is the
    :class:`~flashot.result.TransportPlan` of the block-diagonal packed problem (its
    ``dense()`` shows the blocks); when ε varies it is the rescaled problem at the
    common ε_0 (the same plans; its costs scaled by ε_0/ε_s). Products are
    differentiable like a single plan's.
    """

    def __init__(self, packed: TransportPlan, count: int, batch: int | None):
        self.packed, self._count, self._batch = packed, count, batch

    @property
    def T(self) -> BatchedPlan:
        """The transposed plans (``plan.T @ U`` with U on the x clouds)."""
        return BatchedPlan(self.packed.T, self._count, self._batch)

    def __repr__(self) -> str:
        return f"BatchedPlan(B={self._count}, packed shape={self.packed.shape})"

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"plan @ V needs a torch.Tensor, got {type(v).__name__}")
        if self._batch is None:
            return self.packed @ v
        if v.dim() not in (2, 3) or v.shape[0] != self._batch:
            raise ValueError(f"V must be (B, m, p) or (B, m) with B = {self._batch}, "
                             f"got {tuple(v.shape)}")  # fmt: skip
        out = self.packed @ v.reshape(v.shape[0] * v.shape[1], *v.shape[2:])
        return out.reshape(self._batch, -1, *v.shape[2:])


def _errors(seg: Segments, r, c, f, g, log_a, log_b, rho=(None, None)) -> torch.Tensor:
    """(B,) float64 L1 marginal errors of packed problems from the plan's marginals r, c.

    A relaxed side's target is ``a e^{−f/ρ}`` (:func:`flashot.backends.dual.marginal_error`).
    """
    ta = torch.exp(log_a if rho[0] is None else log_a - f / rho[0])
    tb = torch.exp(log_b if rho[1] is None else log_b - g / rho[1])
    return (seg.sum((r - ta).abs()) + seg.T.sum((c - tb).abs())).double()


def _relaxed_values(seg: Segments, f, g, a, b, r, eps: float, rho) -> torch.Tensor:
    """(B,) relaxed dual values, each ``ot._dual_value``'s for its problem.

    ``⟨a, φ(f)⟩ + ⟨b, φ(g)⟩ − ε (m(P) − m(a) m(b))`` per problem, with the derivatives
    of :func:`~flashot.autodiff.functions.relaxed_side` (the envelope ones); ``r`` the
    plan's row sums (its mass per problem).
    """
    m_a, m_b = seg.sum(a), seg.T.sum(b)
    grads = (relaxed_side(f, a, eps, rho[0], seg.sum) + relaxed_side(g, b, eps, rho[1], seg.T.sum)
             + eps * m_a * m_b)  # fmt: skip
    with torch.no_grad():
        excess = seg.sum(r) - m_a * m_b
        value = (phi_sum(f, a, rho[0], seg.sum) + phi_sum(g, b, rho[1], seg.T.sum)
                 - eps * excess)  # fmt: skip
    return value + (grads - grads.detach())


@entry_point
def sinkhorn_varlen(
    x, y, x_offsets, y_offsets, a=None, b=None, *, eps, cost: str = "sqeuclidean",
    max_iter: int = 1000, tol: float | str | None = "auto", check_every: int = 10,
    update: str = "auto", eps_schedule=None, backend="auto", precision: str = "auto",
    min_iter: int = 0, warn: bool = True, momentum: float | str | None = None,
    progress: bool = False, rho=None, relative_eps: bool = False, init=None,
    hvp_tol: float | None = None,
) -> BatchedSinkhornResult:  # fmt: skip
    r"""Balanced entropic OT for a ragged batch of problems in one solve.

    Problem ``s`` is between ``x[x_offsets[s]:x_offsets[s+1]]`` and
    ``y[y_offsets[s]:y_offsets[s+1]]`` (FlashAttention's ``cu_seqlens`` layout), with
    its own weights (normalized within the problem) and its own ε; see the module for
    how they share one loop.

    Args:
        x: (N, d) the source clouds, concatenated.  y: (M, d) the target clouds.
        x_offsets: (B + 1,) integers from 0 to N, strictly increasing.
        y_offsets: (B + 1,) integers from 0 to M.
        a: (N,) nonnegative packed source weights, None for uniform per problem.
        b: (M,) packed target weights, None for uniform.
        eps: ε > 0, one number or B of them (a sequence or a (B,) tensor).
        options: ``cost``, ``max_iter``, ``tol``, ``check_every``, ``update``,
            ``eps_schedule``, ``backend``, ``precision``, ``min_iter``, ``warn``,
            ``momentum``, ``progress`` as in :func:`flashot.sinkhorn` (an explicit
            temperature list needs one ε for the batch; ``tol`` bounds the sum of the
            problems' errors).
        rho: None (balanced), ρ or (ρ_x, ρ_y) as in :func:`flashot.sinkhorn`, for every
            problem (with one ε for the batch); relaxed weights keep their masses and
            ``cost`` is each problem's relaxed dual value.
        relative_eps: each problem's ε is ``eps`` (its value for that problem) times
            its own weighted mean cost, as in :func:`flashot.sinkhorn`; the result's
            ``eps`` holds the absolute values.
        init: a warm start (f (N,), g (M,)), packed, each problem's potentials at its
            own ε (e.g. a previous result's ``f``, ``g``).
        hvp_tol: the accuracy of second derivatives, as in :func:`flashot.sinkhorn` (one
            dual solve serves the batch).

    Returns:
        A :class:`BatchedSinkhornResult` with packed potentials (N,), (M,).
    """
    return _solve_packed(x, y, x_offsets, y_offsets, a, b, None, eps=eps, cost=cost,
                         max_iter=max_iter, tol=tol, check_every=check_every, update=update,
                         eps_schedule=eps_schedule, backend=backend, precision=precision,
                         min_iter=min_iter, warn=warn, momentum=momentum, progress=progress,
                         rho=rho, relative_eps=relative_eps, init=init,
                         hvp_tol=hvp_tol)  # fmt: skip


def _check_batch(x, y, a, b):
    """``(B, n, m, a (B·n,) or None, b (B·m,) or None)`` of batched clouds and weights."""
    for t, name in ((x, "x"), (y, "y")):
        if not (isinstance(t, torch.Tensor) and t.dim() == 3):
            raise ValueError(f"batched {name} must be a (B, n, d) tensor")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same batch size, got {x.shape[0]} and "
                         f"{y.shape[0]}")  # fmt: skip
    bsz, n, m = x.shape[0], x.shape[1], y.shape[1]
    if bsz == 0 or n == 0 or m == 0:
        raise ValueError(f"batched clouds must be non-empty, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")  # fmt: skip
    flat = []
    for w, size, name in ((a, n, "a"), (b, m, "b")):
        w = weights_tensor(w, x, name)
        if w is not None and (not isinstance(w, torch.Tensor) or w.shape != (bsz, size)):
            raise ValueError(f"with batched points, {name} must be a ({bsz}, {size}) tensor")
        flat.append(None if w is None else w.reshape(-1))
    return bsz, n, m, flat[0], flat[1]


def sinkhorn_batched(x, y, a=None, b=None, **options) -> BatchedSinkhornResult:
    """:func:`flashot.sinkhorn` for (B, n, d) and (B, m, d) clouds (weights (B, n), (B, m)).

    One solve for the batch (:func:`sinkhorn_varlen` with equal sizes); potentials come
    back as (B, n) and (B, m), and ``plan @ V`` takes (B, m, p).
    """
    bsz, n, m, wa, wb = _check_batch(x, y, a, b)
    flat = [wa, wb]
    rows = list(range(0, bsz * n + 1, n))
    cols = list(range(0, bsz * m + 1, m))
    return _solve_packed(x.reshape(bsz * n, -1), y.reshape(bsz * m, -1), rows, cols, flat[0],
                         flat[1], bsz, **options)  # fmt: skip


def sinkhorn_divergence_batched(x, y, a=None, b=None, *, eps, update: str = "auto",
                                **options) -> torch.Tensor:  # fmt: skip
    r"""(B,) debiased Sinkhorn divergences of (B, n, d) and (B, m, d) clouds, one solve.

    The 3B problems ``(x_i, y_i)``, ``(x_i, x_i)``, ``(y_i, y_i)`` are packed together and
    ``S_i = OT(x_i, y_i) − ½ OT(x_i, x_i) − ½ OT(y_i, y_i)``; ``update="auto"`` takes
    the symmetric steps, which keep the self problems' potentials symmetric (alternating
    ones take thousands of iterations there). Differentiable once in the clouds and
    weights. Options as :func:`flashot.sinkhorn_divergence` (``eps`` may hold B values).
    """
    bsz, _, _, wa, wb = _check_batch(x, y, a, b)
    packed_x, packed_y, rows, cols, weights_a, weights_b = pair_packing(x, y, wa, wb, True)
    eps_all = _eps_per_problem(eps, bsz).repeat(3)
    res = _solve_packed(packed_x, packed_y, rows, cols, weights_a, weights_b, None, eps=eps_all,
                        update="symmetric" if update == "auto" else update,
                        **options)  # fmt: skip
    c = res.cost.reshape(3, bsz)
    return c[0] - 0.5 * (c[1] + c[2])


def _solve_packed(x, y, x_offsets, y_offsets, a, b, batch, *, eps, cost="sqeuclidean",
                  max_iter=1000, tol="auto", check_every=10, update="auto", eps_schedule=None,
                  backend="auto", precision="auto", min_iter=0, warn=True, momentum=None,
                  progress=False, rho=None, relative_eps=False, init=None,
                  hvp_tol=None) -> BatchedSinkhornResult:  # fmt: skip
    """The solve behind :func:`sinkhorn_varlen` and :func:`sinkhorn_batched`."""
    if not isinstance(warn, bool):
        raise TypeError(f"warn must be True or False, got {warn!r}")
    pp = pack_problems(x, y, x_offsets, y_offsets, a, b, eps=eps, cost=cost, backend=backend,
                       precision=precision, rho=rho, relative_eps=relative_eps)  # fmt: skip
    seg, eps0, engine, eps_all = pp.segments, pp.eps0, pp.engine, pp.eps
    x, y, a, b = pp.x, pp.y, pp.a, pp.b
    explicit = eps_schedule is not None and not isinstance(eps_schedule, (str, EpsilonScaling))
    if explicit and not bool((eps_all == eps0).all()):
        raise ValueError("an explicit eps_schedule needs one eps for the whole batch")
    # GeomLoss' schedule from the largest (scaled) diameter
    temps = temperatures(eps_schedule, eps0, lambda: float(pp.diameters.max()))
    tol, update = resolve_stopping(tol, update, None, momentum)
    if init is not None:  # (B, n), (B, m) of a batch, or packed; each problem at its own ε
        if batch is not None and isinstance(init, Sequence) and len(init) == 2:
            init = tuple(t.reshape(-1) if isinstance(t, torch.Tensor) and t.dim() == 2 else t
                         for t in init)  # fmt: skip
        init = pp.from_own_eps(*check_init(init, pp.a, pp.b))
    f, g, out = pp.potentials(temps, max_iter=max_iter, tol=tol, check_every=check_every,
                              update=update, progress=progress, min_iter=min_iter,
                              momentum=momentum, init=init)  # fmt: skip
    log_a, log_b = torch.log(a.detach()), torch.log(b.detach())
    detached = pp.form.detach()
    fd, gd = f.detach(), g.detach()
    f_s, g_s = pp.to_own_eps(f, g)
    relaxed = pp.rho != (None, None)
    # one pass for the plan's marginals, when the value or a tol needs them (else the
    # errors are measured only when asked)
    if relaxed or tol is not None:
        pot = Potentials(detached, fd, gd, log_a, log_b, eps0)
        r, c = engine.marginals(pot)
    if relaxed:  # the dual value per problem, with envelope-exact derivatives
        value = _relaxed_values(seg, f, g, a, b, r, eps0, pp.rho)
    else:
        value = seg.sum(a * f_s) + seg.T.sum(b * g_s)
    if torch.is_grad_enabled() and value.requires_grad:  # differentiable twice
        trajectory = None
        if tol is None:  # (a fixed schedule: its returned gradient's derivative)
            omega = None if momentum is None else float(momentum)
            trajectory = Trajectory(tuple(float(t) for t in temps), max_iter, update, init,
                                    omega, check_every, iterates=out.iterates)  # fmt: skip
        value = exact_second_order(value, [packed_piece(pp, fd, gd, hvp_tol, trajectory)])
    errors = None if tol is None else _errors(seg, r, c, fd, gd, log_a, log_b, pp.rho)
    read = read_finite(fd, gd, errors)
    err_host = None if errors is None else torch.tensor(read, dtype=errors.dtype)
    converged = None
    if tol is not None:
        assert err_host is not None
        converged = err_host <= tol
        if isinstance(tol, FloorTolerance):
            floors = precision_floor(pot, per_problem=True)
            converged |= (err_host <= tol.SLACK * tol) & (err_host <= floors)
        missed = int((~converged).sum())
        if missed and warn:
            worst = int(torch.argmax(torch.where(converged, -1.0, err_host)))
            warn_at_caller(
                f"Sinkhorn did not reach tol={tol:g} in {missed} of {seg.count} problems "
                f"after {out.n_iter} iterations (worst: problem {worst}, marginal error "
                f"{float(err_host[worst]):.3e}, loop: {out.cause or 'met tol on the sum'}); "
                "increase max_iter, use an eps_schedule or a larger eps",
                ConvergenceWarning,
            )
    plan = TransportPlan(detached, fd, gd, log_a, log_b, eps0, engine, x, y, pp.rho, None)
    bshape = None if batch is None else (batch, -1)
    return BatchedSinkhornResult(
        f_s if bshape is None else f_s.reshape(bshape),
        g_s if bshape is None else g_s.reshape(bshape),
        value,
        torch.full((seg.count,), out.n_iter, dtype=torch.int64),
        converged,
        err_host,
        eps_all,
        BatchedPlan(plan, seg.count, batch),
        torch.tensor(seg.rows, dtype=torch.int64),
        torch.tensor(seg.cols, dtype=torch.int64),
    )
