r"""Packing of many problems into one block-diagonal problem (see :mod:`flashot.batched`).

Validation of a ragged batch (offsets, weights per problem, ε per problem), its packed
attention form (each problem centered on its own mean, its coordinates scaled for its
own ε), per-problem mean costs for ``relative_eps``, and the packing of debiased pairs.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashot.autodiff.functions import extrapolate
from flashot.autodiff.unrolled import keeps_iterates
from flashot.backends import resolve_backend
from flashot.backends.base import Backend
from flashot.backends.near import NEAR_FROM
from flashot.geometry.costs import AttentionForm, Cost, _centered, get_cost
from flashot.geometry.segments import Segments
from flashot.problem import (
    DeviceChecks,
    check_cloud,
    check_eps_range,
    check_positive,
    check_weights,
    compute_dtype,
    mean_costs,
    parse_rho,
)
from flashot.solver.loop import solve

__all__ = ["PackedProblem", "pack_problems", "pair_packing"]


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
        dtype = compute_dtype(like.dtype)

        def uniform():
            sizes = torch.tensor(seg.row_counts, dtype=torch.float64)
            return (1.0 / sizes).to(like.device)[seg.row_ids(like.device)].to(dtype)

        return seg.device_table(("uniform", str(like.device), dtype), uniform).clone()
    w = check_weights(w, n, like, name, checks)  # (one problem's checks, on the packing)
    mass = seg.sum(w.detach())
    checks.add(
        (mass > 0).all(),
        ValueError(f"{name} sums to zero within a problem; every problem needs mass"),
    )
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
        points = [r + c for r, c in zip(seg.row_counts, seg.T.row_counts, strict=True)]
        sizes = seg.device_table(
            ("points", str(u.device), dtype),
            lambda: torch.tensor(points, dtype=dtype, device=u.device),
        )
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
        return self._per_problem(f, g, self.eps / self.eps0)

    def from_own_eps(self, f: torch.Tensor, g: torch.Tensor):
        """Each problem's own potentials (N,), (M,) → at ε_0: ``f ε_0/ε_s`` (a warm start)."""
        return self._per_problem(f, g, self.eps0 / self.eps)

    def _per_problem(self, f: torch.Tensor, g: torch.Tensor, scale: torch.Tensor):
        seg, scale = self.segments, scale.to(device=f.device, dtype=f.dtype)
        return f * scale[seg.row_ids(f.device)], g * scale[seg.T.row_ids(f.device)]

    def potentials(self, temps, **solve_options):
        """Solve, then the differentiable final step: ``(f, g, SolverOutput)`` at ε_0.

        ``solve_options``: those of :func:`flashot.solver.loop.solve` (``max_iter``, ``tol``, …).
        """
        log_a, log_b = torch.log(self.a.detach()), torch.log(self.b.detach())
        detached, engine = self.form.detach(), self.engine
        keep = keeps_iterates(self.form, solve_options["max_iter"], self.a, self.b)
        out = solve(detached, log_a, log_b, temps, self.damping, self.rho, engine,
                    keep_iterates=keep, **solve_options)  # fmt: skip
        update = solve_options.get("update", "symmetric")
        with engine.operand_scope():
            f, g = extrapolate(self.form, out.f, out.g, log_a, log_b, self.eps0,
                               self.damping(self.eps0), engine, update)  # fmt: skip
        return f, g, out


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
            checks.add(
                (torch.linalg.vector_norm(cloud.detach(), dim=1) > 0).all(),
                ValueError(f"{name} has a zero vector; the cosine cost is undefined there"),
            )
    a = _weights(a, x.shape[0], x, seg, "a", checks, normalize)
    b = _weights(b, y.shape[0], y, seg.T, "b", checks, normalize)
    checks.verify()
    dtype = compute_dtype(x.dtype)
    engine = resolve_backend(backend, x.device, precision, dtype)
    if relative_eps:  # the means from an unscaled form, then the form at the problems' ε
        unit = torch.ones(seg.count, dtype=torch.float64)
        means = mean_costs(_packed_form(cost, x, y, seg, dtype, engine.rounding, unit)[0], a, b)
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
