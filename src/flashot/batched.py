r"""Many problems in one solve: batched (B, n, d) clouds and ragged (packed) batches.

The B problems are packed end to end (:mod:`flashot.segments`) into one block-diagonal
problem, which the one Sinkhorn loop (:func:`flashot.solver.solve`) iterates as a
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
import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashot.autodiff.functions import extrapolate, relaxed_side
from flashot.backends import entry_point, resolve_backend
from flashot.backends.base import Backend
from flashot.backends.near import NEAR_FROM
from flashot.caller import warn_at_caller
from flashot.costs import AttentionForm, Cost, _centered, get_cost
from flashot.dual import phi_sum
from flashot.problem import (
    DeviceChecks,
    check_cloud,
    check_eps_range,
    check_positive,
    check_weights,
    compute_dtype,
    parse_rho,
    weights_tensor,
)
from flashot.result import TransportPlan
from flashot.segments import Segments
from flashot.solver import (
    EpsilonScaling,
    FloorTolerance,
    precision_floor,
    resolve_stopping,
    solve,
    temperatures,
)

__all__ = [
    "BatchedPlan",
    "BatchedSinkhornResult",
    "PackedProblem",
    "pack_problems",
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
            differentiable once w.r.t. the clouds and weights (envelope theorem).
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


def _offsets(off, total: int, name: str) -> tuple[int, ...]:
    """Host offsets from a 1-D integer tensor or sequence, checked against ``total``."""
    if isinstance(off, torch.Tensor):
        if off.dim() != 1 or off.dtype.is_floating_point or off.dtype == torch.bool:
            raise TypeError(f"{name} must be a 1-D integer tensor, got {off.dtype} "
                            f"of shape {tuple(off.shape)}")  # fmt: skip
        off = off.tolist()
    if not isinstance(off, Sequence) or not all(
        isinstance(o, numbers.Integral) and not isinstance(o, bool) for o in off
    ):
        raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of integers")
    off = tuple(int(o) for o in off)
    if len(off) < 2 or off[0] != 0 or off[-1] != total:
        raise ValueError(f"{name} must run from 0 to the packed size {total} "
                         f"(B + 1 entries), got {list(off)[:8]}…")  # fmt: skip
    if any(b <= a for a, b in itertools.pairwise(off)):
        raise ValueError(f"{name} must increase strictly: every problem needs a point")
    return off


def _eps_per_problem(eps, count: int) -> torch.Tensor:
    """(B,) float64 host tensor of positive finite ε from a number or B numbers."""
    if isinstance(eps, torch.Tensor) and eps.numel() > 1:
        eps = eps.detach().cpu().double().reshape(-1).tolist()
    if isinstance(eps, Sequence) and not isinstance(eps, str):
        if len(eps) != count:
            raise ValueError(f"eps must be a number or hold one value per problem ({count}), "
                             f"got {len(eps)}")  # fmt: skip
        return torch.tensor([check_positive(e, "eps") for e in eps], dtype=torch.float64)
    return torch.full((count,), check_positive(eps, "eps"), dtype=torch.float64)


def _weights(w, n: int, like, seg: Segments, name: str, checks: DeviceChecks,
             normalize: bool = True) -> torch.Tensor:  # fmt: skip
    """(n,) packed weights, normalized within each problem (if told); uniform when None."""
    if w is None:
        sizes = torch.tensor([b - a for a, b in zip(seg.rows, seg.rows[1:], strict=False)],
                             dtype=torch.float64)  # fmt: skip
        w = (1.0 / sizes).to(like.device)[seg.row_ids(like.device)]
        return w.to(compute_dtype(like.dtype))
    w = check_weights(w, n, like, name, checks)  # (one problem's checks, on the packing)
    mass = seg.sum(w.detach())
    checks.add((mass > 0).all(),
               ValueError(f"{name} sums to zero within a problem; every problem needs mass"))
    w = w.to(compute_dtype(like.dtype))
    return w / seg.sum(w)[seg.row_ids(w.device)] if normalize else w


def _boxes(u: torch.Tensor, seg: Segments) -> torch.Tensor:
    """(2, B, d) per-problem coordinate minima and maxima of a packed cloud."""
    ids = seg.row_ids(u.device)[:, None].expand_as(u)
    shape = (seg.count, u.shape[1])
    lo = u.new_zeros(shape).scatter_reduce_(0, ids, u, "amin", include_self=False)
    hi = u.new_zeros(shape).scatter_reduce_(0, ids, u, "amax", include_self=False)
    return torch.stack([lo, hi])


def _packed_form(cost: Cost, x, y, seg: Segments, dtype, rounding, shrink: torch.Tensor):
    """The packed attention form, each problem centered on its own mean.

    Problem s's centered coordinates are scaled by ``shrink_s = √(ε_0/ε_s)`` (its cost by
    ``shrink_s²``).

    Returns ``(form, bounds (B,) float64 host, diameters (B,) float64 host)``.
    """
    u, v = cost.embed(x.to(dtype)), cost.embed(y.to(dtype))
    rid, cid = seg.row_ids(u.device), seg.T.row_ids(u.device)
    with torch.no_grad():
        total = seg.sum(u.detach()) + seg.T.sum(v.detach())
        sizes = torch.tensor([seg.rows[s + 1] - seg.rows[s] + seg.cols[s + 1] - seg.cols[s]
                              for s in range(seg.count)], dtype=dtype, device=u.device)  # fmt: skip
        center = total / sizes[:, None]
        scaled = bool((shrink != 1).any())
        r = shrink.to(device=u.device, dtype=dtype)
        box_u, box_v = _boxes(u.detach(), seg), _boxes(v.detach(), seg.T)
        top = torch.maximum(box_u[1], box_v[1]).double()
        span = top - torch.minimum(box_u[0], box_v[0]).double()
        diam = torch.linalg.vector_norm(span, dim=1) * shrink.to(span.device)
        bound = cost.scale * diam**2
        if cost.normalize:  # points on the unit sphere: |u − v|² ≤ 4
            bound = torch.full_like(diam, 4.0 * cost.scale) * shrink.to(span.device) ** 2
    if scaled:  # (u − c) r = u r − c r: the scale is applied before the rounding
        u, v = u * r[rid, None], v * r[cid, None]
        center = center * r[:, None]
    two_s = 2.0 * cost.scale
    q, alpha = _centered(u, center[rid], rounding, two_s, cost.scale)
    k, beta = _centered(v, center[cid], rounding, 1.0, cost.scale)
    bounds = tuple(float(t) for t in bound.cpu())
    seg = Segments(seg.rows, seg.cols, bounds)
    form = AttentionForm(q, k, alpha, beta, cost_bound=max(bounds), segments=seg)
    return form, bounds, diam.cpu()


def _errors(seg: Segments, r, c, f, g, log_a, log_b, rho=(None, None)) -> torch.Tensor:
    """(B,) float64 L1 marginal errors of packed problems from the plan's marginals r, c.

    A relaxed side's target is ``a e^{−f/ρ}`` (:func:`flashot.dual.marginal_error`).
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

    Returns:
        A :class:`BatchedSinkhornResult` with packed potentials (N,), (M,).
    """
    return _solve_packed(x, y, x_offsets, y_offsets, a, b, None, eps=eps, cost=cost,
                         max_iter=max_iter, tol=tol, check_every=check_every, update=update,
                         eps_schedule=eps_schedule, backend=backend, precision=precision,
                         min_iter=min_iter, warn=warn, momentum=momentum, progress=progress,
                         rho=rho, relative_eps=relative_eps, init=init)  # fmt: skip


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


@dataclass(frozen=True)
class PackedProblem:
    """Validated packed problems (see :func:`pack_problems`).

    Attributes:
        x: (N, d), y: (M, d) the packed clouds as given.
        a: (N,), b: (M,) weights (normalized within each problem unless told not to).
        form: the packed attention form at the common ε_0 (differentiable in x, y).
        eps: (B,) float64 each problem's ε.  eps0: the common ε_0 = max ε.
        engine: the backend.  diameters: (B,) scaled bounding-box diagonals (host).
    """

    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    form: AttentionForm
    eps: torch.Tensor
    eps0: float
    engine: Backend
    diameters: torch.Tensor
    rho: tuple[float | None, float | None] = (None, None)

    def damping(self, eps: float) -> tuple[float, float]:
        """Unbalanced damping ``λ = ρ / (ρ + ε)`` of each side (1 when balanced)."""
        lam = [1.0 if r is None else r / (r + eps) for r in self.rho]
        return lam[0], lam[1]

    @property
    def segments(self) -> Segments:
        """The packing."""
        assert self.form.segments is not None
        return self.form.segments

    def to_own_eps(self, f: torch.Tensor, g: torch.Tensor):
        """Potentials at ε_0 (N,), (M,) → each problem's own, ``f ε_s/ε_0`` (differentiable)."""
        seg = self.segments
        scale = (self.eps / self.eps0).to(device=f.device, dtype=f.dtype)
        return f * scale[seg.row_ids(f.device)], g * scale[seg.T.row_ids(f.device)]

    def from_own_eps(self, f: torch.Tensor, g: torch.Tensor):
        """Each problem's own potentials (N,), (M,) → at ε_0: ``f ε_0/ε_s`` (a warm start)."""
        seg = self.segments
        scale = (self.eps0 / self.eps).to(device=f.device, dtype=f.dtype)
        return f * scale[seg.row_ids(f.device)], g * scale[seg.T.row_ids(f.device)]

    def potentials(self, temps, **solve_options):
        """Solve, then the differentiable final step: ``(f, g, SolverOutput)`` at ε_0.

        ``solve_options``: those of :func:`flashot.solver.solve` (``max_iter``, ``tol``, …).
        """
        log_a, log_b = torch.log(self.a.detach()), torch.log(self.b.detach())
        detached, engine = self.form.detach(), self.engine
        out = solve(detached, log_a, log_b, temps, self.damping, self.rho, engine,
                    **solve_options)  # fmt: skip
        update = solve_options.get("update", "symmetric")
        with engine.operand_scope():
            f, g = extrapolate(self.form, out.f, out.g, log_a, log_b, self.eps0,
                               self.damping(self.eps0), engine, update)  # fmt: skip
        return f, g, out


def _mean_costs(form: AttentionForm, a: torch.Tensor, b: torch.Tensor,
                seg: Segments) -> torch.Tensor:  # fmt: skip
    """(B,) float64 host: each problem's weighted mean cost, in closed form.

    ``⟨â, α⟩ + ⟨b̂, β⟩ − ⟨qᵀâ, kᵀb̂⟩`` per problem, weights normalized within it
    (:func:`flashot.problem.mean_cost` for one problem).
    """
    wa, wb = a.detach().double(), b.detach().double()
    rid, cid = seg.row_ids(wa.device), seg.T.row_ids(wb.device)
    wa, wb = wa / seg.sum(wa)[rid], wb / seg.T.sum(wb)[cid]
    offsets = seg.sum(wa * form.alpha.detach().double())
    offsets = offsets + seg.T.sum(wb * form.beta.detach().double())
    qa = seg.sum(wa[:, None] * form.q.detach().double())
    kb = seg.T.sum(wb[:, None] * form.k.detach().double())
    return (offsets - (qa * kb).sum(1)).cpu()


def pack_problems(x, y, x_offsets, y_offsets, a=None, b=None, *, eps, cost="sqeuclidean",
                  backend="auto", precision="auto", normalize: bool = True,
                  rho=None, relative_eps: bool = False) -> PackedProblem:  # fmt: skip
    """Validate a ragged batch and build its packed form (arguments of :func:`sinkhorn_varlen`).

    ``normalize=False`` keeps the weights as given (GeomLoss' convention); relaxed
    problems (``rho``) keep them too, as :func:`flashot.sinkhorn` does.
    ``relative_eps``: each problem's ε is ``eps`` times its own mean cost.
    """
    if not isinstance(relative_eps, bool):
        raise TypeError(f"relative_eps must be True or False, got {relative_eps!r}")
    rho_xy = parse_rho(rho)
    relaxed = rho_xy != (None, None)
    normalize = normalize and not relaxed
    checks = DeviceChecks()
    (x, _), (y, _) = check_cloud(x, "x", checks), check_cloud(y, "y", checks)
    if x.device != y.device or x.dtype != y.dtype:
        raise ValueError(f"x and y must share device and dtype, got {x.device}/{x.dtype} and "
                         f"{y.device}/{y.dtype}")  # fmt: skip
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same feature dimension, got {x.shape[1]} "
                         f"and {y.shape[1]}")  # fmt: skip
    rows = _offsets(x_offsets, x.shape[0], "x_offsets")
    cols = _offsets(y_offsets, y.shape[0], "y_offsets")
    if len(rows) != len(cols):
        raise ValueError(f"x_offsets and y_offsets must describe the same number of problems, "
                         f"got {len(rows) - 1} and {len(cols) - 1}")  # fmt: skip
    seg = Segments(rows, cols)
    cost = get_cost(cost)
    if hasattr(cost, "compile"):
        raise NotImplementedError("batched solves take the plain costs (sqeuclidean, "
                                  "half_sqeuclidean, cosine), not labeled ones")  # fmt: skip
    eps_all = _eps_per_problem(eps, seg.count)
    if cost.normalize:
        for cloud, name in ((x, "x"), (y, "y")):
            checks.add((torch.linalg.vector_norm(cloud.detach(), dim=1) > 0).all(),
                       ValueError(f"{name} has a zero vector; the cosine cost is undefined there"))
    a = _weights(a, x.shape[0], x, seg, "a", checks, normalize)
    b = _weights(b, y.shape[0], y, seg.T, "b", checks, normalize)
    checks.verify()
    dtype = compute_dtype(x.dtype)
    engine = resolve_backend(backend, x.device, precision, dtype)
    if relative_eps:  # the means from an unscaled form, then the form at the problems' ε
        unit = torch.ones(seg.count, dtype=torch.float64)
        means = _mean_costs(_packed_form(cost, x, y, seg, dtype, engine.rounding, unit)[0],
                            a, b, seg)  # fmt: skip
        if not bool((means > 0).all()):
            worst = int(torch.argmin(means))
            raise ValueError(f"relative_eps needs a positive mean cost in every problem, got "
                             f"{float(means[worst]):g} in problem {worst} (coinciding points?): "
                             "pass an absolute eps")  # fmt: skip
        eps_all = eps_all * means
    eps0 = float(eps_all.max())
    shrink = torch.sqrt(eps0 / eps_all)
    form, bounds, diameters = _packed_form(cost, x, y, seg, dtype, engine.rounding, shrink)
    for bound in bounds:
        check_eps_range(eps0, bound, dtype, "eps")
    if relaxed and not bool((eps_all == eps0).all()):
        raise NotImplementedError("a relaxed batch (rho) takes one eps for all its problems")
    if relaxed and form.segments is not None and form.segments.near(eps0, NEAR_FROM):
        raise NotImplementedError(
            "a relaxed batch at eps above a problem's cost range: its value would lose "
            "digits (eps·ulp); solve those problems one by one (flashot.sinkhorn)"
        )
    return PackedProblem(x, y, a, b, form, eps_all, eps0, engine, diameters, rho_xy)


def pair_packing(x, y, wa, wb, debias: bool):
    """The packing of the B problems (x_i, y_i), and of their self problems if told.

    With ``debias`` the problems (x_i, x_i) and then (y_i, y_i) follow.

    Args:
        x: (B, n, d), y: (B, m, d) clouds.  wa: (B·n,), wb: (B·m,) weights or None.
        debias: append the 2B self problems.

    Returns:
        ``(X, Y, rows, cols, A, B)``: packed clouds, offsets and weights (None when
        every problem's are uniform).
    """
    bsz, n, m = x.shape[0], x.shape[1], y.shape[1]
    xs, ys = x.reshape(bsz * n, -1), y.reshape(bsz * m, -1)
    pairs = [(xs, n, wa, ys, m, wb)]
    if debias:
        pairs += [(xs, n, wa, xs, n, wa), (ys, m, wb, ys, m, wb)]
    rows, cols = [0], [0]
    for _, rn, _, _, cm, _ in pairs:
        rows += [rows[-1] + rn * (i + 1) for i in range(bsz)]
        cols += [cols[-1] + cm * (i + 1) for i in range(bsz)]

    def packed(side):  # (the weights of side 0 (x) or 3 (y) of every pair)
        if all(p[side + 2] is None for p in pairs):
            return None
        return torch.cat([
            torch.full((bsz * p[side + 1],), 1.0 / p[side + 1], dtype=x.dtype, device=x.device)
            if p[side + 2] is None else p[side + 2] for p in pairs
        ])  # fmt: skip

    packed_x, packed_y = torch.cat([p[0] for p in pairs]), torch.cat([p[3] for p in pairs])
    return packed_x, packed_y, rows, cols, packed(0), packed(3)


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
                  progress=False, rho=None, relative_eps=False,
                  init=None) -> BatchedSinkhornResult:  # fmt: skip
    """The solve behind :func:`sinkhorn_varlen` and :func:`sinkhorn_batched`."""
    from flashot.ot import ConvergenceWarning, _check_init  # (flashot.ot routes batches here)

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
        init = pp.from_own_eps(*_check_init(init, pp))
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
        r, c = engine.marginals(detached, fd, gd, log_a, log_b, eps0)
    if relaxed:  # the dual value per problem, with envelope-exact derivatives
        value = _relaxed_values(seg, f, g, a, b, r, eps0, pp.rho)
    else:
        value = seg.sum(a * f_s) + seg.T.sum(b * g_s)
    err_host = None
    if tol is not None:
        err_host = _errors(seg, r, c, fd, gd, log_a, log_b, pp.rho).cpu()
    finite = torch.isfinite(fd).all() & torch.isfinite(gd).all()
    if not (bool(finite) and (err_host is None or bool(torch.isfinite(err_host).all()))):
        raise FloatingPointError("Sinkhorn produced non-finite potentials; try a larger eps, "
                                 "an eps_schedule, or float64 inputs")  # fmt: skip
    converged = None
    if tol is not None:
        assert err_host is not None
        converged = err_host <= tol
        if isinstance(tol, FloorTolerance):
            floors = precision_floor(detached, fd, gd, log_a, log_b, eps0, per_problem=True)
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
