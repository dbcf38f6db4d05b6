r"""The debiased Sinkhorn divergence.

.. math::

    S_\varepsilon(a, b) = \mathrm{OT}_\varepsilon(a, b)
        - \tfrac12 \mathrm{OT}_\varepsilon(a, a) - \tfrac12 \mathrm{OT}_\varepsilon(b, b)
        \;\Big[ + \tfrac{\varepsilon}{2} (m(a) - m(b))^2 \text{ when relaxed} \Big],

computed as GeomLoss does (Feydy et al., 2019; Séjourné et al., 2019): three
Sinkhorn problems share one ε schedule, the self problems use symmetric
potentials, and one final extrapolation is differentiated. In dual form,
``S = ⟨a, f − p⟩ + ⟨b, g − q⟩`` when balanced, with ``(f, g)`` the potentials of
(a, b) and ``p``, ``q`` those of (a, a) and (b, b).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from flashot.autodiff.functional import functional_transforms
from flashot.autodiff.functions import (
    dual_term,
    final_step_for,
    grads_needed,
    soft_c_transform,
)
from flashot.autodiff.second_order import Piece, check_hvp_tol, exact_second_order, spec_of
from flashot.autodiff.unrolled import Trajectory, keeps_iterates
from flashot.backends import entry_point
from flashot.batched import sinkhorn_divergence_batched
from flashot.caller import warn_at_caller
from flashot.geometry.costs import attention_form, self_attention_form
from flashot.ops import node_when_compiling
from flashot.ot import resolve_schedule, sinkhorn
from flashot.problem import (
    Problem,
    check_init,
    cloud_tensor,
    compute_dtype,
    make_problem,
    parse_rho,
    weights_tensor,
)
from flashot.solver.loop import final_potentials, solve, solve_self
from flashot.solver.stopping import ConvergenceWarning, describe_miss, resolve_stopping

__all__ = ["DebiasedPotentials", "debiased_potentials", "sinkhorn_divergence"]


@dataclass(frozen=True)
class DebiasedPotentials:
    """Differentiable potentials of the three problems of a Sinkhorn divergence.

    Attributes:
        f: (n,) potential of OT(a, b) on x.  g: (m,) its potential on y.
        p: (n,) symmetric potential of OT(a, a), or None without debiasing.
        q: (m,) symmetric potential of OT(b, b), or None without debiasing.
        converged: False if any problem missed ``tol`` (None when tol is None).
        misses: the warning text of each problem that missed ``tol``.
        trajectory: how OT(a, b)'s fixed-iteration solve ran (``tol=None``), for its
            second derivatives (:mod:`flashot.autodiff.unrolled`); None after a solve
            to a tolerance.
        self_iterates: the self problems' kept iterates (``Trajectory.iterates``), or
            None each.
    """

    f: torch.Tensor
    g: torch.Tensor
    p: torch.Tensor | None
    q: torch.Tensor | None
    converged: bool | None
    misses: tuple[str, ...] = ()
    trajectory: Trajectory | None = None
    self_iterates: tuple = (None, None)

    def value(self, problem: Problem, hvp_tol: float | None = None) -> torch.Tensor:
        """The (debiased) Sinkhorn cost, differentiable w.r.t. x, y, a, b.

        Twice: see :mod:`flashot.autodiff.second_order`; ``hvp_tol`` as in
        :func:`flashot.sinkhorn`.
        """
        a, b, eps, rho = problem.a, problem.b, problem.eps, problem.rho_x
        out = dual_term(self.f, a, eps, rho) + dual_term(self.g, b, eps, rho)
        if self.p is not None and self.q is not None:
            out = out - dual_term(self.p, a, eps, rho) - dual_term(self.q, b, eps, rho)
        if not (torch.is_grad_enabled() and out.requires_grad):
            return out
        pf, relaxed = problem.form, rho is not None
        dtype = self.f.dtype
        spec = spec_of(problem, dtype, hvp_tol)
        cost, rounding, bound = problem.cost, problem.engine.rounding, pf.cost_bound

        def theta(x, y, a, b):  # run by a double backward only
            form = attention_form(cost, x, y, dtype, rounding, bound)
            return form.q, form.alpha, form.k, form.beta, a, b

        pair = self.trajectory
        pieces = [Piece(1.0, (problem.x, problem.y, a, b), self.f.detach(), self.g.detach(),
                        spec, relaxed, theta, pair)]  # fmt: skip
        if self.p is not None and self.q is not None:
            # a self problem's trajectory: symmetric steps from the solver's start
            # a divergence's rho is symmetric: the problem's spec serves its self problems
            for cloud, w, pot, kept in zip((problem.x, problem.y), (a, b), (self.p, self.q),
                                           self.self_iterates, strict=True):  # fmt: skip
                own = None if pair is None else replace(pair, update="symmetric", init=None,
                                                        momentum=None, iterates=kept)  # fmt: skip
                pieces.append(Piece(-0.5, (cloud, w), pot.detach(), pot.detach(), spec, relaxed,
                                    lambda c, w: theta(c, c, w, w), own, mirror=True))  # fmt: skip
        return exact_second_order(out, pieces)


def debiased_potentials(
    problem: Problem,
    temps: list[float],
    *,
    debias: bool = True,
    max_iter: int,
    tol: float | None,
    check_every: int = 10,
    update: str = "symmetric",
    min_iter: int = 0,
    momentum: float | str | None = None,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DebiasedPotentials:
    """Solve OT(a, b) (and OT(a, a), OT(b, b) when debiasing), then extrapolate once.

    Args:
        problem: the (a, x) ↔ (b, y) problem; its rho must be symmetric.
        temps: ε schedule ending at ``problem.eps``.
        debias: also solve the two self problems.
        max_iter, tol, check_every, update, min_iter: as in :func:`flashot.solver.loop.solve`.
        momentum: as there, for OT(a, b) (the self problems take symmetric steps).
        init: a checked warm start (f, g) of OT(a, b), or None.
    """
    if problem.rho_x != problem.rho_y:
        raise ValueError("a Sinkhorn divergence needs the same rho on both sides")
    eps, rho, engine = problem.eps, problem.rho_x, problem.engine
    lam = problem.damping(eps)[0]
    form, log_a, log_b = problem.form.detach(), problem.log_a, problem.log_b
    opts: dict[str, Any] = dict(max_iter=max_iter, tol=tol, check_every=check_every,
                                min_iter=min_iter)  # fmt: skip
    out = solve(
        form,
        log_a,
        log_b,
        temps,
        problem.damping,
        (rho, rho),
        engine,
        update=update,
        final_step=final_step_for(problem.form),
        momentum=momentum,
        init=init,
        keep_iterates=keeps_iterates(problem.form, max_iter, problem.a, problem.b),
        **opts,
    )
    f, g = final_potentials(problem.form, out, log_a, log_b, eps, (lam, lam), engine, update)
    dtype = problem.form.q.dtype
    outs = [("OT(a, b)", out)]
    p = q = None
    kept: list = []
    if debias:
        selves = []
        sides = ((problem.x, problem.a, log_a, "OT(a, a)"),
                 (problem.y, problem.b, log_b, "OT(b, b)"))  # fmt: skip
        for cloud, w, log_w, name in sides:
            # the joint box holds each cloud's own: the problem's bound serves
            self_form = self_attention_form(problem.cost, cloud, dtype, engine.rounding,
                                            problem.form.cost_bound)  # fmt: skip
            res = solve_self(
                self_form.detach(),
                log_w,
                temps,
                lambda e: problem.damping(e)[0],
                rho,
                engine,
                final=grads_needed(self_form)[0],
                keep_iterates=keeps_iterates(self_form, max_iter, w),
                **opts,
            )
            outs.append((name, res))
            kept.append(res.iterates)
            assert res.final is not None
            # (its pass ran with the solve: autograd gets the elementwise step only)
            selves.append(soft_c_transform(self_form, res.f, log_w, eps, lam, engine,
                                           res.final[0]))  # fmt: skip
        p, q = selves
    converged = None if tol is None else all(o.converged for _, o in outs)
    bound = problem.form.cost_bound
    scale = None if bound is None else bound / eps
    misses = tuple(
        f"{name}: "
        + describe_miss(
            o.cause or "max_iter", tol or 0.0, o.error, o.floor, o.n_iter, dtype, update, scale
        )
        for name, o in outs
        if o.converged is False
    )
    trajectory = None
    if tol is None:
        omega = None if momentum is None else float(momentum)
        trajectory = Trajectory(tuple(float(t) for t in temps), max_iter, update, init, omega,
                                check_every, iterates=out.iterates)  # fmt: skip
    return DebiasedPotentials(
        f, g, p, q, converged, misses, trajectory, tuple(kept) if kept else (None, None)
    )


def _asymmetric(x, y, a, b, *, rho, eps, init, **options) -> torch.Tensor:
    r"""The divergence with ρ_x ≠ ρ_y, from three full relaxed solves.

    ``OT(a, b) − ½ OT(a, a) − ½ OT(b, b) + ε/2 (m(a) − m(b))²``, each OT the relaxed value
    with (ρ_x, ρ_y): ``S(a, a) = 0``, and with one ρ the formula is the symmetric
    divergence's value.
    """
    ab = sinkhorn(x, y, a, b, eps=eps, rho=rho, init=init, **options)
    options["relative_eps"] = False  # (the self problems take OT(a, b)'s absolute ε)
    aa = sinkhorn(x, x, a, a, eps=ab.eps, rho=rho, **options).cost
    bb = sinkhorn(y, y, b, b, eps=ab.eps, rho=rho, **options).cost
    mass = _mass(a, x) - _mass(b, y)
    return ab.cost - 0.5 * (aa + bb) + 0.5 * ab.eps * mass**2


def _mass(w, cloud) -> torch.Tensor:
    """m(w) of given weights (1 for uniform ones, which are probability vectors)."""
    if w is None:
        return torch.ones((), dtype=compute_dtype(cloud.dtype), device=cloud.device)
    w = weights_tensor(w, cloud, "weights")
    return w.to(compute_dtype(cloud.dtype)).sum()


@node_when_compiling("divergence")
@entry_point
@functional_transforms
def sinkhorn_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    cost: str = "sqeuclidean",
    rho: float | None = None,
    max_iter: int = 1000,
    tol: float | str | None = "auto",
    check_every: int = 10,
    update: str = "auto",
    eps_schedule=None,
    backend="auto",
    precision: str = "auto",
    min_iter: int = 0,
    warn: bool = True,
    relative_eps: bool = False,
    momentum: float | str | None = None,
    init=None,
    hvp_tol: float | None = None,
) -> torch.Tensor:
    """Debiased Sinkhorn divergence ``S_ε(a, b)`` (see the module docstring).

    Takes the same options as :func:`flashot.sinkhorn`. With ``rho=(ρ_x, ρ_y)``,
    ρ_x ≠ ρ_y, the three problems are full relaxed solves with (ρ_x, ρ_y), combined as
    ``OT(a, b) − ½ OT(a, a) − ½ OT(b, b) + ε/2 (m(a) − m(b))²`` (OTT's convention of one
    relaxation for all three; the formula is the symmetric divergence's value when
    ρ_x = ρ_y, and ``S(a, a) = 0``).

    Args:
        x: (n, d) source points.  y: (m, d) target points. A (B, n, d) and (B, m, d)
            batch gives (B,) values from one packed solve
            (:func:`~flashot.batched.sinkhorn_divergence_batched`).
        a: (n,) source weights or None.  b: (m,) target weights or None.
        options: ``eps``, ``cost``, ``rho``, ``max_iter``, ``tol``, ``check_every``,
            ``update``, ``eps_schedule``, ``backend``, ``precision``, ``min_iter``,
            ``warn``, ``relative_eps``, ``momentum``: as in :func:`flashot.sinkhorn`
            (``relative_eps`` scales by the mean cost between x and y; ``momentum``
            relaxes OT(a, b), the self problems take symmetric steps).
        init: optional warm start (f (n,), g (m,)) of OT(a, b), e.g. the potentials of
            a previous solve (``flashot.sinkhorn(...).f, .g``); the self problems
            start as usual.
        hvp_tol: the relative error asked of second derivatives, as in
            :func:`flashot.sinkhorn`.

    Returns:
        A 0-dim tensor, differentiable w.r.t. x, y, a and b; nonnegative up to
        solver tolerance, and 0 when the measures coincide.

    Warns:
        ConvergenceWarning: when any of the three problems missed ``tol`` (unless
            ``warn=False``).
    """
    if not isinstance(warn, bool):
        raise TypeError(f"warn must be True or False, got {warn!r}")
    hvp_tol = check_hvp_tol(hvp_tol)
    if getattr(x, "ndim", 2) == 3:  # a batch: 3B problems in one packed solve
        extra = (("rho", rho), ("relative_eps", relative_eps or None), ("init", init))
        given = [k for k, v in extra if v is not None]
        if given:
            raise NotImplementedError(f"batched (B, n, d) divergences do not take "
                                      f"{', '.join(given)} yet: loop over the "
                                      "problems")  # fmt: skip
        return sinkhorn_divergence_batched(
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
            min_iter=min_iter,
            warn=warn,
            momentum=momentum,
            hvp_tol=hvp_tol,
        )
    if rho is not None and not isinstance(rho, (int, float)):
        rx, ry = parse_rho(rho)
        if rx != ry:  # three full solves with (ρ_x, ρ_y): OTT's convention
            return _asymmetric(x, y, a, b, rho=(rx, ry), eps=eps, cost=cost,
                               max_iter=max_iter, tol=tol, check_every=check_every,
                               update=update, eps_schedule=eps_schedule, backend=backend,
                               precision=precision, min_iter=min_iter, warn=warn,
                               relative_eps=relative_eps, momentum=momentum, init=init,
                               hvp_tol=hvp_tol)  # fmt: skip
        rho = rx
    problem = make_problem(x, y, a, b, eps=eps, cost=cost, rho=rho, backend=backend,
                           precision=precision, relative_eps=relative_eps)  # fmt: skip
    tol, update = resolve_stopping(tol, update, problem, momentum)
    temps = resolve_schedule(eps_schedule, problem)
    options: dict[str, Any] = dict(max_iter=max_iter, tol=tol, check_every=check_every,
                                   min_iter=min_iter, momentum=momentum)  # fmt: skip
    init = check_init(init, problem.a, problem.b)
    pots = debiased_potentials(problem, temps, update=update, init=init, **options)
    if pots.converged is False and warn:
        warn_at_caller("sinkhorn_divergence: " + "; ".join(pots.misses), ConvergenceWarning)
    value = pots.value(problem, hvp_tol)
    if not bool(torch.isfinite(value)):
        raise FloatingPointError(
            "Sinkhorn divergence is not finite; try a larger eps or float64 inputs"
        )
    return value
