"""The public entropic OT solver, :func:`sinkhorn`."""

from __future__ import annotations

import functools

import torch

from flashot.autodiff.functional import functional_transforms
from flashot.autodiff.functions import final_step_for, relaxed_side
from flashot.autodiff.implicit import implicit_potentials
from flashot.autodiff.second_order import Piece, check_hvp_tol, exact_second_order, spec_of
from flashot.autodiff.unrolled import Trajectory, keeps_iterates
from flashot.backends import entry_point
from flashot.backends.dual import Potentials, phi_sum
from flashot.batched import sinkhorn_batched
from flashot.caller import warn_at_caller
from flashot.geometry.costs import AttentionForm, LazyForm, attention_form, bounding_diameter
from flashot.problem import Problem, check_init, cloud_tensor, make_problem, read_finite
from flashot.result import SinkhornResult, SolveHistory, TransportPlan
from flashot.solver.loop import final_potentials, solve, temperatures
from flashot.solver.stopping import (
    ConvergenceWarning,
    final_verdict,
    precision_floor,
    resolve_stopping,
)

__all__ = ["ConvergenceWarning", "resolve_schedule", "sinkhorn"]


def resolve_schedule(eps_schedule, problem: Problem) -> list[float]:
    """The list of temperatures for ``eps_schedule`` (None, "geomloss", EpsilonScaling, floats)."""
    return temperatures(
        eps_schedule, problem.eps, lambda: bounding_diameter(problem.cost, problem.x, problem.y)
    )


def _compiler(problem):
    """``(x, y) ↦`` the problem's attention form: what compiles it, not the form.

    A closure over it holds the cost and the options (not the form, nor the problem
    holding it): results and second-order pieces make the form again from the clouds.
    """
    pf = problem.form
    cost, dtype, rounding, bound = problem.cost, pf.q.dtype, problem.engine.rounding, pf.cost_bound
    return lambda x, y: attention_form(cost, x, y, dtype, rounding, bound)


def _remade(problem, form: AttentionForm) -> AttentionForm | LazyForm:
    """The plan's form, made again from the clouds when used (:class:`LazyForm`).

    So a result holds the caller's x and y, not two more cloud-sized operands. Packed
    forms are kept.
    """
    if form.segments is not None:
        return form
    compile_form, x, y = _compiler(problem), problem.x, problem.y

    def build() -> AttentionForm:
        with torch.no_grad():
            return compile_form(x, y)

    return LazyForm(build, form.shape, current=form)


def _piece(problem, f: torch.Tensor, g: torch.Tensor, spec, trajectory=None) -> Piece:
    """The value's second-order piece: its form rebuilt from the clouds on demand.

    A first-order graph then keeps x and y (the caller's tensors) rather than the
    form's q and k, two more cloud-sized tensors through the backward pass; a second
    derivative compiles the form again (O((n + m) d)). Packed forms keep their operands.
    """
    pf = problem.form
    if pf.segments is not None:
        return Piece(1.0, (pf.q, pf.alpha, pf.k, pf.beta, problem.a, problem.b), f, g, spec,
                     trajectory=trajectory)  # fmt: skip
    compile_form = _compiler(problem)

    def theta(x, y, a, b):  # run by a double backward only
        form = compile_form(x, y)
        return form.q, form.alpha, form.k, form.beta, a, b

    return Piece(
        1.0,
        (problem.x, problem.y, problem.a, problem.b),
        f,
        g,
        spec,
        build=theta,
        trajectory=trajectory,
    )


@entry_point
@functional_transforms
def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    cost: str = "sqeuclidean",
    rho=None,
    max_iter: int = 1000,
    tol: float | str | None = "auto",
    check_every: int = 10,
    update: str = "auto",
    eps_schedule=None,
    init=None,
    backend="auto",
    precision: str = "auto",
    progress: bool = False,
    history: bool = False,
    min_iter: int = 0,
    warn: bool = True,
    relative_eps: bool = False,
    momentum: float | str | None = None,
    hvp_tol: float | None = None,
) -> SinkhornResult:
    r"""Entropic optimal transport between two weighted point clouds.

    Solves

    .. math::

        \mathrm{OT}_\varepsilon(a, b) = \min_{P \ge 0} \langle P, C \rangle
            + \varepsilon\,\mathrm{KL}(P \,\|\, a \otimes b)
            + \rho_x \mathrm{KL}(P 1 \,\|\, a) + \rho_y \mathrm{KL}(P^T 1 \,\|\, b)

    (the KL terms replaced by hard constraints on balanced sides) with log-domain
    Sinkhorn iterations streamed tile by tile: nothing of size n × m is stored.

    Args:
        x: (n, d) source points (float16, bfloat16, float32 or float64); a numpy array
            is taken as a CPU tensor, numpy weights go to their cloud's device and
            dtype, and results are tensors. A (B, n, d) batch (with y (B, m, d), weights
            (B, n) and (B, m)) is solved in one packed solve and returns a
            :class:`~flashot.batched.BatchedSinkhornResult`
            (:func:`~flashot.batched.sinkhorn_batched`; ``eps`` may then hold B values).
        y: (m, d) target points, same dtype and device.
        a: (n,) nonnegative source weights, None for uniform. Balanced problems
            normalize a and b to probability vectors; relaxed ones keep their mass.
        b: (m,) nonnegative target weights, None for uniform.
        eps: entropic regularization ε > 0, in units of the cost.
        cost: ``"sqeuclidean"`` ``|x−y|²``, ``"half_sqeuclidean"`` ``|x−y|²/2``, or
            ``"cosine"`` 1 − cos(x, y).
        rho: None (balanced), ρ > 0 for both marginals, or a pair (ρ_x, ρ_y) in
            which None keeps that side balanced.
        max_iter: iterations at most (the ε schedule's included).
        tol: stop once the L1 marginal error is ≤ tol, checked every
            ``check_every`` iterations; None runs exactly ``max_iter`` iterations.
            ``"auto"``: 1e-6, or the dtype's precision floor when that is within 10×
            of it (:class:`~flashot.solver.stopping.FloorTolerance`); a number is strict.
        check_every: iterations between two checks (a check is free: it reuses the
            iteration's reductions).
        update: ``"symmetric"`` (averaged Jacobi updates, GeomLoss) or
            ``"alternating"`` (Gauss–Seidel, OTT/POT); ``"auto"``: alternating with a
            tol (fewer iterations), symmetric with ``tol=None`` (fixed schedules) or
            between a measure and itself; alternating whenever ``momentum`` is set.
        eps_schedule: None (fixed ε), ``"geomloss"``, an
            :class:`~flashot.EpsilonScaling`, or an explicit sequence of
            temperatures ending at (or followed by) ε.
        init: optional warm start (f (n,), g (m,)), e.g. a previous result's potentials
            ((B, n), (B, m) for a batch, each problem's at its own ε).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or a backend instance.
        precision: ``"auto"``, ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``: how
            score tiles are computed (``"auto"`` is accurate float32/float64).
        progress: show a progress line on stderr.
        history: record the marginal error every ``check_every`` iterations (warm-up
            temperatures and ``tol=None`` included) in ``result.history``
            (:class:`~flashot.result.SolveHistory`); each record waits for the device,
            and a recorded fixed-iteration solve is not replayed as a CUDA graph.
        min_iter: iterations at least before ``tol`` may stop the solve (OTT's
            ``min_iterations``).
        warn: emit :class:`ConvergenceWarning` on a missed ``tol``; with False the
            result still says so (``converged``, ``cause``).
        relative_eps: ``eps`` is a fraction of the mean cost ``Σ a_i b_j C_ij`` (weights
            normalized; OTT's ``relative_epsilon="mean"``), which the result's ``eps``
            then holds multiplied out. The scale is a constant for gradients.
        momentum: over-relaxation of the alternating updates at the final ε (OTT's
            ``momentum``): None (plain), a float ω in (0, 2), or ``"auto"`` (ω from the
            measured convergence rate, Lehmann et al. 2021; needs a ``tol``). Same
            solution, fewer iterations where plain Sinkhorn is slow (small ε); see
            :mod:`flashot.solver.momentum`.
        hvp_tol: the relative error asked of second derivatives through ``cost``
            (Hessian-vector products by double backward): their dual system is solved
            by CG to the relative residual ``hvp_tol / 10`` (measured errors were 0.1–1.6
            times the residual, up to ~13 at ε near 0.1 % of the mean cost). None: 1e-3
            in float32 (and the half precisions), 1e-8 in float64. Solves without a
            ``tol`` differentiate their iterations instead, exactly, reading the
            iterates the solve kept where the step LSEs they imply hold to ``hvp_tol /
            10`` (else running the schedule again), and stopping an eager reverse sweep
            where its first steps could add at most ``hvp_tol / 100`` of the largest
            gradient.
            Diagnostics of the solves: :func:`flashot.record_dual_solves`.

    Returns:
        A :class:`~flashot.result.SinkhornResult`. Its ``cost`` is differentiable
        w.r.t. x, y, a and b (envelope theorem: only the final update is
        differentiated, O((n + m) d) memory).

    Warns:
        ConvergenceWarning: when ``tol`` was not reached within ``max_iter`` (unless
            ``warn=False``).
    """
    for flag, name in ((history, "history"), (warn, "warn")):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    hvp_tol = check_hvp_tol(hvp_tol)
    if getattr(x, "ndim", 2) == 3:  # a batch: one packed solve (flashot.batched)
        if history:
            raise NotImplementedError("batched (B, n, d) solves do not take history yet: "
                                      "loop over the problems for it")  # fmt: skip
        return sinkhorn_batched(  # type: ignore[return-value]
            cloud_tensor(x),
            cloud_tensor(y),
            a,
            b,
            eps=eps,
            cost=cost,
            max_iter=max_iter,
            tol=tol,
            check_every=check_every,
            update=update,
            eps_schedule=eps_schedule,
            backend=backend,
            precision=precision,
            progress=progress,
            min_iter=min_iter,
            warn=warn,
            momentum=momentum,
            rho=rho,
            relative_eps=relative_eps,
            init=init,
            hvp_tol=hvp_tol,
        )
    problem = make_problem(x, y, a, b, eps=eps, cost=cost, rho=rho, backend=backend,
                           precision=precision, relative_eps=relative_eps)  # fmt: skip
    eps = problem.eps  # (absolute)
    engine = problem.engine
    tol, update = resolve_stopping(tol, update, problem, momentum)
    temps = resolve_schedule(eps_schedule, problem)
    init = check_init(init, problem.a, problem.b)
    form = problem.form.detach()
    log_a, log_b = problem.log_a, problem.log_b
    rhos = (problem.rho_x, problem.rho_y)
    engine.take_score_memory()  # (counts this solve's score matrices from here)
    # one scope: a cached score matrix serves the final passes and the error too
    with engine.operand_scope():
        out = solve(
            form,
            log_a,
            log_b,
            temps,
            problem.damping,
            rhos,
            engine,
            max_iter=max_iter,
            tol=tol,
            check_every=check_every,
            update=update,
            init=init,
            progress=progress,
            # (replayed with the loop, its streaming passes too when differentiated)
            final_step=final_step_for(problem.form),
            record=history,
            min_iter=min_iter,
            momentum=momentum,
            keep_iterates=keeps_iterates(problem.form, max_iter, problem.a, problem.b),
        )
        # Final extrapolation: the only differentiated step (GeomLoss' convention).
        f, g = final_potentials(problem.form, out, log_a, log_b, eps, problem.damping(eps), engine,
                                update)  # fmt: skip
        fd, gd = f.detach(), g.detach()
        pf = problem.form
        theta = (pf.q, pf.alpha, pf.k, pf.beta, problem.a, problem.b)
        exact = None
        if torch.is_grad_enabled() and any(t.requires_grad for t in theta):
            exact = (theta, spec_of(problem, fd.dtype, hvp_tol))
        plan = TransportPlan(form if exact is not None else _remade(problem, form), fd, gd, log_a,
                             log_b, eps, engine, problem.x, problem.y, rhos, exact)  # fmt: skip
        # a fixed-iteration balanced solve needs neither the error nor the plan's mass:
        # the error is then measured only if asked for (it costs a pass over the plan)
        error_t = excess = None
        if tol is not None or not problem.balanced:
            error_t, excess = plan._marginal_error()
    score_memory = engine.take_score_memory()
    value = _dual_value(problem, f, g, excess)  # queued before the checks wait
    if exact is not None:
        trajectory = None  # (to a tolerance: the converged problem's second derivatives)
        if tol is None:
            # (with history=True, a fixed momentum falls back to plain steps where a
            # check sees no progress: a path the replay does not know)
            refusal = None if not (history and momentum is not None) else (
                "second derivatives of a fixed-iteration solve with momentum and "
                "history=True are not available: pass history=False")  # fmt: skip
            trajectory = Trajectory(tuple(float(t) for t in temps), max_iter, update, init,
                                    None if momentum is None else float(momentum), check_every,
                                    refusal, out.iterates)  # fmt: skip
        value = exact_second_order(value, [_piece(problem, fd, gd, exact[1], trajectory)])
    read = read_finite(fd, gd, error_t)
    error = None if read is None else read[0]
    at_end = Potentials(form, fd, gd, log_a, log_b, eps)
    floor_now = functools.cache(lambda: precision_floor(at_end))
    bound = problem.form.cost_bound
    converged, cause, why = final_verdict(tol, error, out, floor_now, problem.form.q.dtype, update,
                                          None if bound is None else bound / eps)  # fmt: skip
    if why is not None and warn:
        warn_at_caller(why, ConvergenceWarning)
    f_out, g_out = (f, g) if exact is None else implicit_potentials(theta, fd, gd, exact[1])
    record = None
    if history:
        checks = out.checks or ()
        record = SolveHistory([c[0] for c in checks], [c[1] for c in checks],
                              [c[2] for c in checks], [float(t) for t in temps])  # fmt: skip
    return SinkhornResult(f_out, g_out, value, out.n_iter, converged, eps, plan, error, cause,
                          record, score_memory)  # fmt: skip


def _dual_value(problem: Problem, f, g, excess) -> torch.Tensor:
    """The entropic OT value with envelope-exact gradients.

    Balanced: ``⟨a, f⟩ + ⟨b, g⟩``. Relaxed: the dual objective
    ``⟨a, φ(f)⟩ + ⟨b, φ(g)⟩ − ε (m(P) − m(a) m(b))``, written as
    :func:`~flashot.autodiff.functions.relaxed_side` terms (whose derivatives are the
    envelope ones) plus a detached correction that restores the exact value.
    ``excess`` is ``m(P) − m(a) m(b)`` (:func:`~flashot.backends.dual.mass_excess`).
    """
    a, b, eps = problem.a, problem.b, problem.eps
    if problem.balanced:
        return (a * f).sum() + (b * g).sum()
    rho_x, rho_y = problem.rho_x, problem.rho_y
    m_a, m_b = a.sum(), b.sum()
    # carries the envelope derivatives; its value has ε-sized terms that cancel
    grads = relaxed_side(f, a, eps, rho_x) + relaxed_side(g, b, eps, rho_y) + eps * m_a * m_b
    with torch.no_grad():  # the value, with no ε-sized cancellation
        value = phi_sum(f, a, rho_x) + phi_sum(g, b, rho_y) - eps * excess
    return value + (grads - grads.detach())
