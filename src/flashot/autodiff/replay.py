r"""A fixed-iteration solve replayed as one autograd node, and its reverse sweep.

:func:`unrolled_potentials` returns the schedule's last iterate ``z_K = (f_K, g_K)`` as a
differentiable function of θ = (q, α, k, β, log a, log b). Written with one
:class:`~flashot.autodiff.unrolled.Transform` node per pass, its backward crossed the
autograd engine 2K times, with a Python Function, saved tensors and ~20 small torch
ops per node: at 10 000 points the host took four times the device's time. Here the K
iterations are one node, :class:`Replay`:

- its forward runs the schedule without autograd and keeps every iterate and every
  pass's negated LSE ``r`` (O(K (n + m)), what the per-pass nodes kept);
- its backward is the adjoint sweep written out: per iteration, from the cotangents
  ``(ū_f, ū_g)`` of its output, one :func:`~flashot.autodiff.unrolled.transform_vjp`
  per transform (one streamed plan_vjp each) gives the cotangents of its input
  potentials and θ's share:

  .. math::

      f_i = \tfrac12 (f_{i-1} + λ_x T_x(g_{i-1})),\ g_i = \tfrac12 (g_{i-1} + λ_y T_y(f_{i-1}))
      \;\Rightarrow\;
      ū_{f_{i-1}} = \tfrac12 ū_{f_i} + (\partial_h T_y)^T \tfrac{λ_y}{2} ū_{g_i},\
      ū_{g_{i-1}} = \tfrac12 ū_{g_i} + (\partial_h T_x)^T \tfrac{λ_x}{2} ū_{f_i}

  (symmetric updates; alternating ones with momentum ω take ``f_i = (1 − ω) f_{i−1} + ω
  λ_x T_x(g_{i−1})``, then ``g_i`` from ``f_i``, and reverse in that order).

A *mirror* problem (a debiased loss's self problem OT(a, a): both sides one cloud with
one weight vector, symmetric steps from a zero start) has ``f_i = g_i`` and the two
transforms equal: the forward runs the rows' transform only, and as the sweep is linear
in the cotangents and swapping the sides leaves it unchanged, the sources' gradients
depend on ``w = ū_f + ū_g`` alone, which obeys ``w_{i−1} = ½ w_i + (∂_h T_x)^T
\tfrac{λ}{2} w_i``: one reverse product per iteration instead of two. θ's shares then sit
in the rows' slots (q, α, k, β, log b), which the sources reach through the same maps as
the columns' (k, β, q, α, log a).

Run eagerly (large problems, the CPU), the reverse sweep checks its tail every few
steps (:class:`_Tail`, one host read each): at a schedule's first temperatures, far
above the cost's scale, the plan's rows are near uniform and the adjoint halves a step
with GeomLoss' averaging, so the sweep stops once what its remaining steps could add is
below ``hvp_tol / 100`` of θ's largest gradient, or its rounding where that is larger.

Both directions are fixed launch sequences given the shapes and the schedule: where the
backend offers a graph key (:meth:`~flashot.backends.base.Backend.graph_key`: small
problems on a GPU) they run through :data:`REPLAY_GRAPHS`, eagerly the first time a key
is met, captured as a CUDA graph the second time and replayed after. Where its passes
and reverse products read ε from a device table
(:meth:`~flashot.backends.base.Backend.reads_vjp_temperatures`), the key is the
schedule's structure (its length, which temperatures are warm-up ones, which take the
near-uniform path, those by value) and the table is an input: a GeomLoss schedule that
moves with the data (its diameter) replays the same graphs. Otherwise temperatures and
the cost's bound are keyed by value.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from flashot.autodiff.implicit import DualSpec
from flashot.autodiff.unrolled import (
    Trajectory,
    damping,
    fill_transform_grads,
    spec_at,
    transform_form,
    transform_pass,
    transform_vjp,
)
from flashot.backends import entry_point
from flashot.backends.dual import Potentials
from flashot.backends.near import is_near_uniform
from flashot.backends.temperature import device_damping, schedule_table, temperatures_on
from flashot.geometry.costs import AttentionForm
from flashot.solver.blocks import shapes
from flashot.solver.graphs import GraphCache, capture_or_eager
from flashot.solver.stopping import CheckSchedule

__all__ = ["REPLAY_GRAPHS", "Replay", "mirrors", "unrolled_potentials"]

#: captured replays (forward and backward of each piece: a debiased value holds three)
REPLAY_GRAPHS = GraphCache(capacity=8, capture=capture_or_eager)


def unrolled_potentials(theta, trajectory: Trajectory, spec: DualSpec, mirror: bool = False):
    """The solve's last iterate ``(f_K (n,), g_K (m,))`` as a differentiable function of θ.

    Replays :func:`flashot.solver.loop.solve`'s loop (initialization, symmetric or
    alternating updates, damping, momentum) as one :class:`Replay` node; the warm-up
    temperatures' near-uniform evaluation is the same function, evaluated otherwise.

    Args:
        theta: (q, α, k, β, a, b) with their autograd history.
        trajectory: how the solve ran.  spec: the problem's :class:`DualSpec`.
        mirror: replay as a mirror (see the module): θ's two sides are one cloud and one
            weight vector, (k, β, b) the same functions of the sources as (q, α, a) (a self
            problem; the caller vouches for the maps), and :func:`mirrors` holds.
    """
    if trajectory.refusal is not None:
        raise RuntimeError(trajectory.refusal)
    q, alpha, k, beta, a, b = theta
    if mirror and not mirrors(trajectory, spec, theta):
        raise ValueError("internal: a mirror replay needs symmetric steps from zero, one ρ "
                         "and two sides alike")  # fmt: skip
    init = () if trajectory.init is None else tuple(t.detach() for t in trajectory.init)
    f, g, *_ = Replay.apply(q, alpha, k, beta, torch.log(a), torch.log(b), trajectory, spec,
                            mirror, *init)  # fmt: skip
    return f, g


def mirrors(trajectory: Trajectory, spec: DualSpec, theta) -> bool:
    """Whether a problem declared a mirror replays as one.

    Symmetric steps from zero, one ρ, not packed, sides of one shape whose gradients are
    asked for alike.
    """
    q, alpha, k, beta, a, b = theta
    return (trajectory.update == "symmetric" and trajectory.init is None
            and trajectory.momentum in (None, 1.0) and spec.rho[0] == spec.rho[1]
            and spec.segments is None and q.shape == k.shape and a.shape == b.shape
            and (q.requires_grad, alpha.requires_grad, a.requires_grad)
            == (k.requires_grad, beta.requires_grad, b.requires_grad))  # fmt: skip


class Replay(torch.autograd.Function):
    """``z_K(θ)``: the schedule's iterations, differentiable once (see the module).

    Outputs ``(f_K, g_K)`` and, for the backward only, the stacked iterates and LSEs
    (marked non-differentiable).
    """

    @staticmethod
    def forward(ctx, q, alpha, k, beta, log_a, log_b, trajectory, spec, mirror, *init):
        """The schedule, without autograd: ``(f_K, g_K, F, G, R_x, R_y)``."""
        theta = (q, alpha, k, beta, log_a, log_b)
        sweep = _Sweep(trajectory, spec, mirror=mirror)
        out = _run(sweep, "forward", _Sweep.forward, (*theta, *init))
        ctx.mark_non_differentiable(*out[2:])
        ctx.save_for_backward(*theta, *out[2:])
        ctx.sweep = sweep
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @entry_point
    def backward(ctx, u_f, u_g, *_):
        """The adjoint sweep: θ's gradients, then None for the other arguments."""
        saved, sweep = ctx.saved_tensors, ctx.sweep
        theta, stacks = saved[:6], saved[6:]
        u_f = torch.zeros_like(stacks[0][0]) if u_f is None else u_f
        u_g = torch.zeros_like(stacks[1][0]) if u_g is None else u_g
        needs = tuple(ctx.needs_input_grad[:6])
        fn = lambda own, *t: own.backward(needs, *t)  # noqa: E731
        grads = _run(sweep, ("backward", needs), fn, (*theta, *stacks, u_f, u_g))
        return (*grads, None, None, None) + (None,) * (len(ctx.needs_input_grad) - 9)


def _run(sweep: _Sweep, direction, fn, tensors) -> tuple:
    """``fn(sweep, *tensors)``, through :data:`REPLAY_GRAPHS` where the backend keys a graph.

    Keyed by the schedule's structure where the backend's passes read temperatures from
    a device table (which is then one more input): a replay serves points that move.
    """
    spec, (q, alpha, k, beta) = sweep.spec, tensors[:4]
    form = transform_form(q, alpha, k, beta, spec)
    backend_key = _graph_key(spec, form)
    kept = _kept(sweep.trajectory, alpha, beta)
    if direction == "forward" and kept is not None:  # (elementwise ops: no graph needed)
        own = dataclasses.replace(sweep, kept=kept)
        with spec.backend.operand_scope(spec.operands):
            held = own.kept_within_tol(*tensors[:6])
        if held:
            return tuple(fn(own, *tensors))
        kept = None  # (their LSEs are off by more than cg_tol: the schedule runs again)
    if backend_key is None:  # (eager: the reverse sweep may check its tail on the host)
        # (not a packed batch's: its bound is against the largest problem's gradients,
        # and a small problem beside it would lose its own relative accuracy)
        own = dataclasses.replace(sweep, tail_checks=spec.segments is None, kept=kept)
        with spec.backend.operand_scope(spec.operands):
            return tuple(fn(own, *tensors))
    if not spec.backend.reads_vjp_temperatures(form):
        key = (direction, backend_key, shapes(tensors), sweep.values_key())

        def captured(*t):  # a capture converts its own operands (its inputs are its buffers)
            with spec.backend.operand_scope([]):
                return tuple(fn(sweep, *t))

        return REPLAY_GRAPHS(key, captured, tensors)
    table = sweep.table(q.device, alpha.dtype)
    key = (direction, backend_key, shapes(tensors), sweep.structure_key(form))

    def on_table(*t):
        own = dataclasses.replace(sweep, temps=tuple(temperatures_on(sweep.temps, t[-1])))
        with spec.backend.operand_scope([]):
            return tuple(fn(own, *t[:-1]))

    return REPLAY_GRAPHS(key, on_table, (*tensors, table))


def _kept(trajectory: Trajectory, alpha, beta) -> tuple | None:
    """The solve's own iterates ``(F, G)`` where they fit this replay, else None."""
    kept, K = trajectory.iterates, trajectory.iterations
    if kept is None or trajectory.update != "symmetric":  # (symmetric steps take no momentum)
        return None
    fits = all(t.shape == (K + 1, s.shape[0]) and (t.dtype, t.device) == (s.dtype, s.device)
               for t, s in zip(kept, (alpha, beta), strict=True))  # fmt: skip
    return kept if fits else None


def _implied_lse(pot: torch.Tensor, own: torch.Tensor, lams) -> torch.Tensor:
    """``r_i = (2 f_i − f_{i−1}) / λ_i − α`` (row 0: ``f_0 / λ_0 − α``) of stacked iterates.

    In float64 from the stored floats (no rounding of its own), returned in theirs.
    """
    wide = pot.double()
    lam = torch.stack([torch.as_tensor(v, dtype=wide.dtype, device=wide.device)
                       for v in lams])[:, None]  # fmt: skip
    t = wide.clone()
    t[1:] = 2.0 * wide[1:] - wide[:-1]
    return (t / lam - own.double()).to(pot.dtype)


def _graph_key(spec: DualSpec, form: AttentionForm):
    """The backend's graph key for the replay's launches, or None (eager)."""
    return spec.backend.graph_key(form)


@dataclasses.dataclass
class _Sweep:
    """The schedule's steps, forward and in reverse, for one trajectory and spec.

    ``temps``: the schedule's temperatures, floats or
    :class:`~flashot.backends.temperature.Temperature` s of a device table. ``mirror``:
    replayed as a mirror problem (see the module). ``tail_checks``: the reverse sweep
    may stop before the schedule's start (:class:`_Tail`; host reads, so eager runs only).
    ``kept``: the solve's own iterates (:func:`_kept`), which the forward then reads
    instead of running the schedule (never inside a graph: it would hold their addresses).
    """

    trajectory: Trajectory
    spec: DualSpec
    temps: tuple = ()
    mirror: bool = False
    tail_checks: bool = False
    kept: tuple | None = None

    def __post_init__(self):
        self.temps = self.temps or tuple(self.trajectory.temps)

    def _schedule_key(self) -> tuple:
        traj, spec = self.trajectory, self.spec
        return (traj.iterations, traj.update, traj.momentum, traj.check_every,
                traj.init is None, spec.rho, self.mirror)  # fmt: skip

    def values_key(self) -> tuple:
        """What pins the launches besides shapes, scalars taken by value."""
        return self._schedule_key(), self.trajectory.temps, self.spec.cost_bound

    def structure_key(self, form: AttentionForm) -> tuple:
        """What pins the launches besides shapes when they read temperatures on the device.

        Per temperature: whether it is a warm-up one, and its value where it takes the
        near-uniform path (whose launches take ε by value).
        """
        steps = []
        last = len(self.temps) - 1
        for i, e in enumerate(self.trajectory.temps):
            bound = spec_at(self.spec, e, i < last).cost_bound
            near = is_near_uniform(dataclasses.replace(form, cost_bound=bound), e)
            steps.append((i < last, e if near else None))
        return self._schedule_key(), tuple(steps)

    def table(self, device, dtype) -> torch.Tensor:
        """The schedule's device table (ε, log2(e)/ε, ratio, λ_x, λ_y per temperature)."""
        return schedule_table(self.trajectory.temps, device, dtype, self._damping)

    def _damping(self, e: float) -> tuple[float, float]:
        """(λ_x, λ_y) at ε = e, as floats."""
        return damping(self.spec.rho[0], e), damping(self.spec.rho[1], e)

    def _steps(self):
        """Per iteration 1…K: its ε, whether a warm-up one, ω, ω of its columns."""
        traj, temps = self.trajectory, self.temps
        last, schedule = len(temps) - 1, CheckSchedule(len(temps), traj.check_every)
        for it in range(1, traj.iterations + 1):
            e, warm = temps[min(it - 1, last)], it - 1 < last
            omega = traj.momentum if traj.momentum is not None and not warm else 1.0
            col_omega = 1.0 if omega == 1.0 or schedule.before(it) else omega
            yield it, e, warm, omega, col_omega

    def _lam(self, e, side: int):
        """λ of ``side`` (0: rows, 1: columns) at ε = e: a temperature's row, or a float."""
        return device_damping(e, self._damping(e))[side]

    def _transform(self, theta, side: int, h, e, warm):
        """``(λ T(h), r)`` at ε = e: the rows' transform T_x (side 0) or the columns' T_y."""
        (q, alpha, k, beta, log_w, _), _, spec = _side(theta, side, h, self.spec)
        t, r = transform_pass(q, alpha, k, beta, log_w, h, spec_at(spec, e, warm))
        return self._lam(e, side) * t, r

    def _both(self, theta, f, g, e, warm, stabilized: bool = True):
        """``((λ_x T_x(g), r_x), (λ_y T_y(f), r_y))`` at ε = e: a symmetric step's transforms.

        By the backend's :meth:`~flashot.backends.base.Backend.potential_lse`: one pass
        over the scores where the backend fuses the two (``stabilized``: from fused sums
        where the backend takes them).
        """
        q, alpha, k, beta, log_a, log_b = theta
        spec = spec_at(self.spec, e, warm)
        form = transform_form(q, alpha, k, beta, spec)
        with spec.backend.operand_scope(spec.operands):
            lse_r, lse_c = spec.backend.potential_lse(
                Potentials(form, f, g, log_a.detach(), log_b.detach(), spec.eps),
                stabilized=stabilized,
            )
        return ((self._lam(e, 0) * (form.alpha - lse_r), -lse_r),
                (self._lam(e, 1) * (form.beta - lse_c), -lse_c))  # fmt: skip

    def forward(self, q, alpha, k, beta, log_a, log_b, *init):
        """``(f_K, g_K, F, G, R_x, R_y)``: iterates and LSEs stacked, index 0 the start."""
        theta, traj = (q, alpha, k, beta, log_a, log_b), self.trajectory
        if self.kept is not None:
            return self._from_kept(alpha, beta)
        K, temps = traj.iterations, self.temps
        F, RX = alpha.new_zeros(K + 1, q.shape[0]), alpha.new_zeros(K + 1, q.shape[0])
        G, RY = beta.new_zeros(K + 1, k.shape[0]), beta.new_zeros(K + 1, k.shape[0])
        if init:
            F[0], G[0] = init
        else:
            warm = len(temps) > 1
            F[0], RX[0] = self._transform(theta, 0, torch.zeros_like(beta), temps[0], warm)
            if not self.mirror:
                G[0], RY[0] = self._transform(theta, 1, torch.zeros_like(alpha), temps[0], warm)
        for it, e, warm, omega, col_omega in self._steps():
            f, g = F[it - 1], G[it - 1]
            if self.mirror:  # (f = g: the rows' transform is the columns')
                t_x, RX[it] = self._transform(theta, 0, f, e, warm)
                F[it] = 0.5 * (f + t_x)
                continue
            if traj.update == "symmetric":
                (t_x, RX[it]), (t_y, RY[it]) = self._both(theta, f, g, e, warm)
                F[it], G[it] = 0.5 * (f + t_x), 0.5 * (g + t_y)
                continue
            t_x, RX[it] = self._transform(theta, 0, g, e, warm)
            F[it] = t_x if omega == 1.0 else torch.lerp(f, t_x, omega)
            t_y, RY[it] = self._transform(theta, 1, F[it], e, warm)
            G[it] = t_y if col_omega == 1.0 else torch.lerp(g, t_y, col_omega)
        if self.mirror:
            G.copy_(F)
            RY.copy_(RX)
        return F[K].clone(), G[K].clone(), F, G, RX, RY

    def _from_kept(self, alpha, beta):
        """:meth:`forward`'s stacks from the solve's own iterates (symmetric steps).

        A step ``f_i = ½ (f_{i−1} + λ_i (α − lse_i))`` solved for its transform gives
        ``r_i = −lse_i = (2 f_i − f_{i−1}) / λ_i − α``, and the start ``f_0 = λ_0 (α −
        lse_0)`` gives ``r_0``, with no pass. Formed in float64 from the stored floats,
        so its only error is theirs: f_i rounded at f's scale (twice, in 2 f_i), which
        :meth:`kept_within_tol` bounds.
        """
        F, G = self.kept
        stacks = []
        for side, (own, pot) in enumerate(((alpha, F), (beta, G))[: 1 if self.mirror else 2]):
            lams = [self._lam(self.temps[0], side)]
            lams += [self._lam(e, side) for _, e, *_ in self._steps()]
            stacks.append(_implied_lse(pot, own, lams))
        if self.mirror:  # (one potential, one ρ, α = β: the columns' LSEs are the rows')
            stacks.append(stacks[0])
        K = self.trajectory.iterations
        return F[K].clone(), G[K].clone(), F, G, *stacks

    def kept_within_tol(self, q, alpha, k, beta, log_a, log_b) -> bool:
        """Whether the LSEs the kept iterates imply are within ``cg_tol`` of a pass's.

        Each kept f_i is rounded at f's scale, so ``r_i`` from it is off by up to
        ``2^-23 max|f|`` (as is the solve's own run-to-run rounding, which reaches r the
        same way): a relative error of ``2^-23 max|f| / ε_i`` in the plan weights the
        reverse products use, largest at the last, smallest ε. Large potentials (wide
        norms against a small ε: GeomLoss' blur 0.05 at d = 64, ~1e-3) would carry it
        into the HVP, so one exact pass at the last step measures it; above ``cg_tol``
        (hvp_tol / 10, as the dual solves) the schedule runs again instead (one host read).
        """
        traj, theta = self.trajectory, (q, alpha, k, beta, log_a, log_b)
        K = traj.iterations
        if K == 0:  # (no step: the start alone, exact but for f_0's own rounding)
            return True
        *_, (_, e, warm, _, _) = self._steps()
        eps = float(traj.temps[min(K - 1, len(traj.temps) - 1)])
        assert self.kept is not None
        F, G = self.kept
        if self.mirror:  # (passes as the schedule's own: exact LSEs)
            exact = [self._transform(theta, 0, F[K - 1], e, warm)[1]]
        else:
            exact = [t[1] for t in self._both(theta, F[K - 1], G[K - 1], e, warm, False)]
        gaps = []
        for side, r in enumerate(exact):
            own, pot = (alpha, F) if side == 0 else (beta, G)
            implied = _implied_lse(pot[K - 1 : K + 1], own, [self._lam(e, side)] * 2)[1]
            gaps.append((r - implied).abs().max())
        return float(torch.stack(gaps).max()) <= self.spec.cg_tol * eps

    def _pair_vjp(self, theta, needs, f, g, r_x, r_y, u_x, u_y, e, warm):
        """A symmetric step's two VJP lists (rows' transform, columns'), or None.

        From the backend's :meth:`~flashot.backends.base.Backend.symmetric_vjp`: one pass,
        and where k takes a gradient a second on the transposed form (its terms are
        column reductions there: that pass's rows), against four launches of two reverse
        products; None leaves the step to those.
        """
        q, alpha, k, beta, log_a, log_b = theta
        spec = spec_at(self.spec, e, warm)
        u0, u1 = self._lam(e, 0) * u_x, self._lam(e, 1) * u_y
        form = transform_form(q, alpha, k, beta, spec)
        la, lb, back = log_a.detach(), log_b.detach(), None
        with spec.backend.operand_scope(spec.operands):
            fused = spec.backend.symmetric_vjp(form, f, g, r_x, r_y, la, lb, u0, u1, spec.eps,
                                               column_sums=not needs[2])  # fmt: skip
            if fused is not None and needs[2]:
                back = spec.backend.symmetric_vjp(form.T, g, f, r_y, r_x, lb, la, u1, u0,
                                                  spec.eps, column_sums=False)  # fmt: skip
        if fused is None or (needs[2] and back is None):
            return None
        row_k0, col0, col_q1, col1 = fused
        row_k1 = col_q0 = None
        if back is not None:  # (u' ⊙ Π^y q, _, Π^xᵀ(u ⊙ q), Π^xᵀ u)
            row_k1, _, col_q0, col0 = back
        outs = []
        for side, u, row_k, col_q, col in ((0, u0, row_k0, col_q0, col0),
                                           (1, u1, row_k1, col_q1, col1)):  # fmt: skip
            wanted = (*(needs[i] for i in _ORDER[side]), True)
            out: list = [None] * 6
            out[1] = u if wanted[1] else None  # (∂α of the transform: its cotangent)
            fill_transform_grads(out, wanted, spec.eps, row_k, col_q, col)
            outs.append(out)
        return outs

    def backward(self, needs, q, alpha, k, beta, log_a, log_b, F, G, RX, RY, u_f, u_g):
        """θ's gradients (None where ``needs`` is False) from ``(ū_{f_K}, ū_{g_K})``."""
        traj, theta = self.trajectory, (q, alpha, k, beta, log_a, log_b)
        grads: list = [None] * 6  # q, α, k, β, log a, log b

        tail = _Tail(alpha.dtype, self.spec.cg_tol) if self.tail_checks else None

        def take(side, out):  # a transform's VJP list: θ's shares added, ū_h returned
            for i, t in zip(_ORDER[side], out[:5], strict=True):
                if t is not None:
                    grads[i] = t if grads[i] is None else grads[i] + t
                    if tail is not None:
                        tail.record(i, t)
            return out[5]

        def vjp(side, u, h, r, e, warm, h_needed=True):  # λ T(h) with cotangent u: ū_h
            parts, order, spec = _side(theta, side, h, self.spec)
            u, spec = self._lam(e, side) * u, spec_at(spec, e, warm)
            wanted = (*(needs[i] for i in order), h_needed)
            return take(side, transform_vjp(parts, r, u, u, spec, wanted, self.mirror))

        if self.mirror:  # w = ū_f + ū_g, θ's shares in the rows' slots (see the module)
            w = u_f + u_g
            for it, e, warm, *_ in reversed(list(self._steps())):
                w = 0.5 * w + vjp(0, 0.5 * w, G[it - 1], RX[it], e, warm)
                if tail is not None and tail.done(grads):
                    return _needed(needs, grads, theta)
            if traj.init is None:
                warm = len(traj.temps) > 1
                vjp(0, w, torch.zeros_like(beta), RX[0], self.temps[0], warm, h_needed=False)
            return _needed(needs, grads, theta)
        for it, e, warm, omega, col_omega in reversed(list(self._steps())):
            if traj.update == "symmetric":
                u_tx, u_ty = 0.5 * u_f, 0.5 * u_g
                pair = self._pair_vjp(theta, needs, F[it - 1], G[it - 1], RX[it], RY[it],
                                      u_tx, u_ty, e, warm)  # fmt: skip
                if pair is not None:
                    u_f, u_g = u_tx + take(1, pair[1]), u_ty + take(0, pair[0])
                else:
                    u_f, u_g = (u_tx + vjp(1, u_ty, F[it - 1], RY[it], e, warm),
                                u_ty + vjp(0, u_tx, G[it - 1], RX[it], e, warm))  # fmt: skip
            else:
                u_f = u_f + vjp(1, col_omega * u_g, F[it], RY[it], e, warm)
                u_g = (1.0 - col_omega) * u_g
                u_g = u_g + vjp(0, omega * u_f, G[it - 1], RX[it], e, warm)
                u_f = (1.0 - omega) * u_f
            if tail is not None and tail.done(grads):
                return _needed(needs, grads, theta)
        if traj.init is None:
            warm = len(traj.temps) > 1
            zero_g, zero_f = torch.zeros_like(beta), torch.zeros_like(alpha)  # (T(0), Tᵀ(0))
            vjp(0, u_f, zero_g, RX[0], self.temps[0], warm, h_needed=False)
            vjp(1, u_g, zero_f, RY[0], self.temps[0], warm, h_needed=False)
        return _needed(needs, grads, theta)


#: the reverse sweep's tail (eager runs): every TAIL_EVERY steps the θ shares of those
#: steps are compared with the sums so far. Where the schedule starts far above the
#: cost's scale (the peer's ``scaling=0.9``: ~15–18 of 51–54 steps), the adjoint there
#: halves a step (GeomLoss' averaging, the plan's rows near uniform), and the shares
#: with it.
TAIL_EVERY = 4
#: a check's shares at most this share of the previous check's, twice in a row
TAIL_RATIO = 0.5
#: the rest of the sweep, bounded as a geometric series of the larger of those two
#: ratios, at most TAIL_SHARE of the dual solves' ``cg_tol`` (``hvp_tol / 100``) of the
#: largest θ gradient, and never less than its rounding, TAIL_TOL (float32: 4 ulp; a
#: dtype without an entry runs the whole sweep)
TAIL_TOL = {torch.float32: 2.0**-21, torch.float64: 2.0**-48}
TAIL_SHARE = 0.1


class _Tail:
    """Whether a reverse sweep's remaining steps change θ's gradients by less than rounding.

    A check (every :data:`TAIL_EVERY` steps, one host read) takes, per θ gradient i, the
    sum Δ_i of the norms of the shares added since the last check (:meth:`record`; no
    copy of the sums is kept) and the norm A_i of the sum. The sweep stops when, for
    every i, the last two checks' ratios Δ_i / Δ_i' are at most :data:`TAIL_RATIO` and
    ``Δ_i r / (1 − r) ≤ tol · max_j A_j`` with r the larger ratio (``tol`` the larger of
    ``TAIL_SHARE · cg_tol`` and the dtype's :data:`TAIL_TOL`): the steps left
    then add at most that much, as long as they keep decaying at least as fast (the
    shares of earlier, larger temperatures decay faster: their plans are nearer
    uniform). The bound is against the largest gradient, as rounding is: an HVP much
    smaller than its terms is as far from float64 from either.
    """

    def __init__(self, dtype: torch.dtype, cg_tol: float = 0.0):
        floor = TAIL_TOL.get(dtype)
        self.tol = 0.0 if floor is None else max(floor, TAIL_SHARE * cg_tol)
        self.steps = 0
        self.pending: dict[int, torch.Tensor] = {}
        self.deltas: list[dict[int, float]] = []

    def record(self, i: int, share: torch.Tensor) -> None:
        """One step's share of θ's gradient i (its norm, kept on the device)."""
        if self.tol:
            norm = share.norm()
            self.pending[i] = norm if i not in self.pending else self.pending[i] + norm

    def done(self, grads: list) -> bool:
        """After one more step with θ's gradients ``grads`` (None where untouched)."""
        self.steps += 1
        if self.tol == 0.0 or self.steps % TAIL_EVERY:
            return False
        live = [i for i, t in enumerate(grads) if t is not None]
        if not live:
            return False
        zero = grads[live[0]].new_zeros(())
        norms = [self.pending.get(i, zero) for i in live] + [grads[i].norm() for i in live]
        values = torch.stack(norms).tolist()  # (the one host read)
        self.pending = {}
        self.deltas.append(dict(zip(live, values[: len(live)], strict=True)))
        if len(self.deltas) < 3 or not all(math.isfinite(v) for v in values):
            return False
        scale = max(values[len(live) :])
        for i in live:
            d, d1, d2 = (check.get(i, 0.0) for check in self.deltas[-1:-4:-1])
            if d == 0.0 and d1 == 0.0:
                continue
            if d1 == 0.0 or d2 == 0.0:
                return False
            r = max(d / d1, d1 / d2)
            if r > TAIL_RATIO or d * r / (1.0 - r) > self.tol * scale:
                return False
        return True


def _needed(needs, grads, theta) -> tuple:
    """θ's gradients: None where not needed, zeros where needed and untouched."""
    return tuple(None if not need else (torch.zeros_like(t) if g is None else g)
                 for need, g, t in zip(needs, grads, theta, strict=True))  # fmt: skip


#: θ's indices (q, α, k, β, log a, log b) in the parts of each side's transform
_ORDER = ((0, 1, 2, 3, 5), (2, 3, 0, 1, 4))


def _side(theta, side: int, h, spec: DualSpec):
    """``(parts, θ indices, spec)`` of one side's transform.

    Side 0: the rows' T_x(h) over q's rows with weights b; side 1: the columns' T_y(h)
    over k's rows with weights a.
    """
    order = _ORDER[side]
    return (*(theta[i] for i in order), h), order, (spec if side == 0 else spec.T)
