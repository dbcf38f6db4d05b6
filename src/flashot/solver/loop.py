r"""The Sinkhorn loop: ε schedules, symmetric or alternating updates, stopping.

The loop is backend-agnostic: it only calls the primitives of
:class:`~flashot.backends.base.Backend` on an attention form. In the attention
form the soft c-transform (log-domain Sinkhorn update) of ``g`` reads

.. math::

    T(g)_i = \alpha_i - \varepsilon \log \sum_j
        \exp\Big(\frac{\langle q_i, k_j \rangle + g_j - \beta_j
        + \varepsilon \log b_j}{\varepsilon}\Big),

and unbalanced sides are damped, ``f ← λ T(g)`` with ``λ = ρ / (ρ + ε)``.
The loop runs without autograd; :mod:`flashot.autodiff` differentiates the
final step only (envelope theorem).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from flashot.autodiff.functions import extrapolate, extrapolation_parts, transform_parts
from flashot.backends.base import Backend
from flashot.backends.dual import Potentials, marginal_error, row_mass
from flashot.backends.temperature import device_damping, schedule_table, temperatures_on
from flashot.geometry.costs import AttentionForm
from flashot.solver.blocks import in_blocks, replay_key, shapes, warm_form
from flashot.solver.graphs import GRAPHS
from flashot.solver.momentum import Relaxation, check_momentum
from flashot.solver.progress import Progress
from flashot.solver.schedule import EpsilonScaling, geomloss_schedule, temperatures
from flashot.solver.stopping import CheckSchedule, _check_iterations, _Stopping, precision_floor

__all__ = [
    "EpsilonScaling",
    "SolverOutput",
    "final_potentials",
    "geomloss_schedule",
    "marginal_error",
    "solve",
    "solve_self",
    "temperatures",
]

UPDATES = ("symmetric", "alternating")


@dataclass(frozen=True)
class SolverOutput:
    """The loop's final iterate (detached) and how it got there.

    Attributes:
        f: (n,) row potential.
        g: (m,) column potential (equal to f for a self problem).
        n_iter: iterations run (the initialization and final extrapolation not counted).
        converged: whether the error reached ``tol`` (None when ``tol`` is None).
        error: the last measured error (NaN if never measured).
        cause: why ``tol`` was missed (one of :data:`flashot.solver.stopping.CAUSES`),
            None otherwise.
        floor: the precision floor estimate
            (:func:`flashot.solver.stopping.precision_floor`) if computed.
        final: the final extrapolation ``(λ_x T(g), λ_y T(f))`` at the last ε, when
            asked for (``final_step=True``), or its streaming passes (``final_step`` a
            pair of flags; :func:`solve_self`'s ``final``); None otherwise.
        checks: with ``record=True``, ``(iteration, ε, error)`` of every check (None
            otherwise).
        pending: a replayed block's closing check, its error still on the device (0-dim;
            None otherwise; :func:`~flashot.solver.blocks.in_blocks`).
        iterates: with ``keep_iterates``, the stacked iterates ``(F (K+1, n), G (K+1, m))``,
            row 0 the start (a self problem's G is F); None otherwise.
    """

    f: torch.Tensor
    g: torch.Tensor
    n_iter: int
    converged: bool | None
    error: float
    cause: str | None = None
    floor: float | None = None
    final: tuple | None = None
    checks: tuple[tuple[int, float, float], ...] | None = None
    pending: torch.Tensor | None = None
    iterates: tuple[torch.Tensor, torch.Tensor] | None = None


@torch.no_grad()
def solve(
    form: AttentionForm,
    log_a: torch.Tensor,
    log_b: torch.Tensor,
    eps_list: Sequence[float],
    damping: Callable[[float], tuple[float, float]],
    rho: tuple[float | None, float | None],
    backend: Backend,
    *,
    max_iter: int,
    tol: float | None,
    check_every: int = 10,
    update: str = "symmetric",
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    progress: bool = False,
    final_step: bool | tuple[bool, bool] = False,
    record: bool = False,
    min_iter: int = 0,
    momentum: float | str | None = None,
    keep_iterates: bool = False,
) -> SolverOutput:
    """Run Sinkhorn iterations between two measures.

    Args:
        form: the cost in attention form, q (n, d'), k (m, d') (detached).
        log_a: (n,) log source weights.  log_b: (m,) log target weights.
        eps_list: temperatures, one iteration each; the last one is kept until the end.
        damping: ε ↦ (λ_x, λ_y), the unbalanced damping factors.
        rho: (ρ_x, ρ_y) for the stopping criterion (None entries are balanced sides).
        backend: the streaming primitives.
        max_iter: iterations at most (≥ len(eps_list)).
        tol: stop once the L1 marginal error is ≤ tol (checked every ``check_every``
            iterations at the final ε); None runs exactly ``max_iter`` iterations.
        check_every: iterations between two checks.
        update: ``"symmetric"`` (averaged Jacobi updates from the old potentials, as in
            GeomLoss) or ``"alternating"`` (Gauss–Seidel, as in OTT/POT).
        init: optional warm start (f (n,), g (m,)); otherwise GeomLoss' initialization
            ``f = λ T(0), g = λ T(0)`` at the first temperature (symmetric data then
            keep symmetric potentials, which the averaged updates need to converge fast).
        progress: print a progress line on stderr.
        final_step: also run the final extrapolation (``SolverOutput.final``) when no
            gradient needs it: in a replayed solve it then costs no launch of its own.
            A pair ``(q, k)`` of flags (:func:`~flashot.autodiff.functions.grads_needed`)
            runs instead the two passes of a differentiated one
            (:func:`~flashot.autodiff.functions.extrapolation_parts`, with ``W k`` for the
            flagged sides): ``SolverOutput.final`` is then ``(row, col)``, for
            ``extrapolate(..., parts=...)``.
        record: measure the error every ``check_every`` iterations, warm-up temperatures
            and ``tol=None`` included, and return the checks (``SolverOutput.checks``);
            each record waits for the device.
        min_iter: iterations at least before ``tol`` may stop the solve.
        momentum: over-relaxation of the alternating updates at the final ε (None,
            ``"auto"`` or ω in (0, 2); :mod:`flashot.solver.momentum`).
        keep_iterates: keep every iterate (``SolverOutput.iterates``) of a loop with
            symmetric steps and no ``tol`` (eager, or a replayed graph's copies): a double
            backward then sweeps back from them instead of running the schedule again.
    """
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
    momentum = check_momentum(momentum, update, tol)
    _check_iterations(max_iter, len(eps_list), tol, check_every, min_iter)
    options = dict(eps_list=eps_list, damping=damping, rho=rho, backend=backend,
                   max_iter=max_iter, tol=tol, check_every=check_every, update=update,
                   min_iter=min_iter, momentum=momentum)  # fmt: skip
    eps, lam = eps_list[-1], damping(eps_list[-1])

    def final(form, out, la, lb):
        if final_step is False:
            return None
        if final_step is True:
            return extrapolate(form, out.f, out.g, la, lb, eps, lam, backend, update)
        return extrapolation_parts(form, out.f, out.g, la, lb, eps, lam, backend, update,
                                   final_step)  # fmt: skip

    backend_key = None if progress or record else backend.graph_key(form)
    # the temperatures on the device too (one table, a graph's input) where every launch
    # of a step reads them there: a replay then serves any schedule of the same structure
    table = _table(backend, form, eps_list, log_a.dtype, damping)
    # (blocks only for alternating steps: the symmetric one's gate lives across them)
    if backend_key is not None and tol is not None and update == "alternating" and momentum is None:
        with backend.operand_scope():
            out = _solve_in_blocks(form, log_a, log_b, init, backend_key, table, options)
            return replace(out, final=final(form, out, log_a, log_b))
    keep = keep_iterates and tol is None and update == "symmetric"
    if backend_key is None or tol is not None:
        with backend.operand_scope():
            out = _iterate(form, log_a, log_b, init, progress=progress, record=record,
                           keep=keep, **_on(options, table))  # fmt: skip
            return replace(out, final=final(form, out, log_a, log_b))
    # a fixed sequence of launches with no host round trip: replayed as a CUDA graph
    # once it repeats; the key pins everything the launches depend on besides the data
    tensors = (form.q, form.k, form.alpha, form.beta, log_a, log_b, *_given(table), *(init or ()))
    bound = form.cost_bound
    key = (
        *replay_key(backend_key, form, tensors, eps_list, damping, table is not None),
        tuple(rho),
        max_iter,
        update,
        final_step,
        momentum,
        keep,
    )

    def run(q, k, alpha, beta, la, lb, *rest):
        form = AttentionForm(q, k, alpha, beta, cost_bound=bound)
        own, start = _split_inputs(rest, table)
        out = _iterate(form, la, lb, start or None, keep=keep, **_on(options, own))
        return out.f, out.g, final(form, out, la, lb), out.iterates

    with backend.operand_scope():  # (a replay returns copies: the iterates are the caller's)
        f, g, last, kept = GRAPHS(key, run, tensors)
    backend.replayed(form)
    return SolverOutput(f, g, max_iter, None, float("nan"), final=last, iterates=kept)


def final_potentials(
    form: AttentionForm,
    out: SolverOutput,
    log_a: torch.Tensor,
    log_b: torch.Tensor,
    eps: float,
    lam: tuple[float, float],
    backend: Backend,
    update: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final extrapolation of :func:`solve`'s ``out``, differentiable in ``form``.

    Takes ``out.final`` as the solve left it (``final_step=True``: the potentials;
    a pair of flags: the passes, to which autograd attaches here) or, without it, runs
    :func:`~flashot.autodiff.functions.extrapolate` now.

    Args:
        form: the attention form with its autograd history.
        out: the solve's output.  log_a, log_b, eps, lam, backend, update: the solve's.
    """
    if out.final is None:
        with backend.operand_scope():  # the accurate mode's split operands serve this pass too
            return extrapolate(form, out.f, out.g, log_a, log_b, eps, lam, backend, update)
    if isinstance(out.final[0], torch.Tensor):  # (final_step=True)
        return out.final[0], out.final[1]
    return extrapolate(form, out.f, out.g, log_a, log_b, eps, lam, backend, update, out.final)


def _solve_in_blocks(form, log_a, log_b, init, backend_key, table, options) -> SolverOutput:
    """:func:`solve`'s loop to a tolerance, in replayed blocks (:func:`.blocks.in_blocks`)."""
    eps_list, bound = options["eps_list"], form.cost_bound
    tensors = (form.q, form.k, form.alpha, form.beta, log_a, log_b, *_given(table))
    key = (backend_key, shapes(tensors), tuple(options["rho"]), options["update"])
    block_options = {**options, "tol": None}

    def block(span, checks, q, k, alpha, beta, la, lb, *rest):
        own = AttentionForm(q, k, alpha, beta, cost_bound=bound)
        cells, fg = _split_inputs(rest, table)
        out = _iterate(own, la, lb, tuple(fg) or None, **_on(block_options, cells), span=span,
                       check_end=checks)  # fmt: skip
        return out.f, out.g, *((out.pending,) if checks else ())

    def floor(f, g):
        return precision_floor(Potentials(form, f, g, log_a, log_b, eps_list[-1]))

    names = ("eps_list", "damping", "max_iter", "check_every", "min_iter", "tol")
    (f, g), it, error, stop = in_blocks(key, tensors, init or (), block, form=form, floor=floor,
                                        cells=table is not None, cache=GRAPHS,
                                        **{n: options[n] for n in names})  # fmt: skip
    options["backend"].replayed(form)
    return SolverOutput(f, g, it, stop.converged, error, stop.cause, stop.floor)


def _iterate(form, log_a, log_b, init, *, eps_list, damping, rho, backend, max_iter, tol,
             check_every, update, progress=False, record=False, min_iter=0, momentum=None,
             span=None, check_end=False, keep=False) -> SolverOutput:  # fmt: skip
    """The loop of :func:`solve` (arguments checked).

    ``span=(first, last)``: only those iterations (a block of :func:`.blocks.in_blocks`;
    from ``init`` unless ``first`` is 1); ``check_end``: measure the error at the last one
    and leave it on the device (``SolverOutput.pending``); ``keep``: stack the iterates
    (``SolverOutput.iterates``).
    """
    q_alpha, k_beta = form.alpha, form.beta
    first, final_it = span or (1, max_iter)
    eps = eps_list[min(first - 1, len(eps_list) - 1)]
    warm = warm_form(form, eps_list)
    if init is None:
        assert first == 1, "a block after the first starts from the previous one's potentials"
        lam_x, lam_y = damping(eps)
        zf, zg = torch.zeros_like(q_alpha), torch.zeros_like(k_beta)
        lse_r, lse_c = backend.potential_lse(Potentials(warm, zf, zg, log_a, log_b, eps))
        lam_x, lam_y = device_damping(eps, (lam_x, lam_y))
        f, g = lam_x * (q_alpha - lse_r), lam_y * (k_beta - lse_c)
    else:
        f, g = init
    kept = _stacks((f, g), final_it) if keep else None
    bar = Progress(progress, max_iter)
    # (f and g read when called: the potentials the loop has then)
    stop = _Stopping(tol, lambda: precision_floor(
        Potentials(form, f, g, log_a, log_b, eps_list[-1]), backend=backend))  # fmt: skip
    last = len(eps_list) - 1
    schedule = CheckSchedule(len(eps_list), check_every)
    # a backend's fast path (one exponential per element for both updates) keeps its
    # own device-side state; it falls back to exact updates row by row, never via the host
    state = backend.fast_state(f.device) if update == "symmetric" else None
    error, it = float("nan"), 0
    checks: list[tuple[int, float, float]] = []
    relax = None if momentum is None else Relaxation(momentum)
    pending = None
    for it in range(first, final_it + 1):
        eps = eps_list[min(it - 1, last)]
        lam = damping(eps)
        on_grid = schedule.on_grid(it)  # at the final ε
        stopping = tol is not None and on_grid and it >= min_iter
        # a record also checks the warm-up, every check_every iterations
        check = stopping or (record and (on_grid or schedule.in_warmup(it)))
        closing = check_end and it == final_it
        check = check or closing
        step_form = form if it - 1 >= last else warm
        if update == "symmetric":
            f, g, err = backend.jacobi_step(
                Potentials(step_form, f, g, log_a, log_b, eps), lam, rho, check=check, state=state
            )
        else:
            lse_r, _ = backend.row_attend(step_form, g - k_beta, eps, log_w=log_b)
            if check:  # columns are exact after the previous g-update
                err = marginal_error(f, row_mass(f, lse_r, q_alpha, log_a, eps), log_a, rho[0])
                err = backend.reduce(err)
            lam = device_damping(eps, lam)
            f_new = lam[0] * (q_alpha - lse_r)
            omega = relax.omega if relax is not None and it - 1 >= last else 1.0
            f = f_new if omega == 1.0 else torch.lerp(f, f_new, omega)
            lse_c, _ = backend.row_attend(step_form.T, f - q_alpha, eps, log_w=log_a)
            g_new = lam[1] * (k_beta - lse_c)
            # plain before a check: exact columns, so the row error is the whole error
            before_check = schedule.before(it)
            g = g_new if omega == 1.0 or before_check else torch.lerp(g, g_new, omega)
        if kept is not None:  # (copies: a step may reuse its buffers)
            kept[0][it], kept[1][it] = f, g
        if closing:
            pending = err  # (read by the caller, after the block: no wait in a capture)
        elif check:
            error = float(err)
            if relax is not None and it - 1 >= last:
                relax.observe(it, error)
            if record:
                checks.append((it, float(eps), error))  # (not a device row)
            if stopping and stop.done(error, it):
                break
        bar.update(it, eps, error)
    bar.update(it, eps, error, force=True)
    bar.close(done=it)
    stop.finish()
    iterates = None if kept is None else (kept[0][: it + 1], kept[1][: it + 1])
    return SolverOutput(f, g, it, stop.converged, error, stop.cause, stop.floor,
                        checks=tuple(checks) if record else None, pending=pending,
                        iterates=iterates)  # fmt: skip


def _stacks(starts, last: int) -> tuple:
    """Per potential, a (last + 1, n) stack of its iterates, row 0 its start."""
    out = tuple(p.new_empty(last + 1, p.shape[0]) for p in starts)
    for stack, p in zip(out, starts, strict=True):
        stack[0] = p
    return out


@torch.no_grad()
def solve_self(
    form: AttentionForm,
    log_a: torch.Tensor,
    eps_list: Sequence[float],
    damping: Callable[[float], float],
    rho: float | None,
    backend: Backend,
    *,
    max_iter: int,
    tol: float | None,
    check_every: int = 10,
    min_iter: int = 0,
    final: bool | None = None,
    keep_iterates: bool = False,
) -> SolverOutput:
    """Symmetric potential of the self problem OT_ε(a, a): ``p ← ½ (p + λ T(p))``.

    Args:
        form: the cost of the cloud with itself (q = k).
        log_a: (n,) log weights.
        eps_list, max_iter, tol, check_every, min_iter: as in :func:`solve`.
        damping: ε ↦ λ.
        rho: ρ or None.
        backend: the streaming primitives.
        final: also the pass of the final soft c-transform of p at the last ε
            (:func:`~flashot.autodiff.functions.transform_parts`, with ``W k`` when
            True): ``SolverOutput.final`` is then ``((lse, W k or None),)``, for
            ``soft_c_transform(..., parts=final[0])``. In a replayed solve it costs no
            launch of its own.
        keep_iterates: as in :func:`solve` (``SolverOutput.iterates`` is ``(P, P)``).
    """
    _check_iterations(max_iter, len(eps_list), tol, check_every, min_iter)
    backend_key = backend.graph_key(form) if form.segments is None else None
    table = _table(backend, form, eps_list, log_a.dtype, damping)  # (as in :func:`solve`)

    def last_pass(form, p, la):  # (SolverOutput.final)
        if final is None:
            return None
        return (transform_parts(form, p - form.beta, la, eps_list[-1], backend, final),)

    if backend_key is None:
        with backend.operand_scope():
            out = _self_iterations(form, log_a, _temperatures(eps_list, table), damping, rho,
                                   backend, max_iter, tol, check_every, min_iter,
                                   keep=keep_iterates and tol is None)  # fmt: skip
            return replace(out, final=last_pass(form, out.f, log_a))
    # a fixed sequence of launches, replayed as a CUDA graph as :func:`solve`'s loop is
    # (a debiased divergence's two self problems were most of its eager launches)
    tensors = (form.q, form.k, form.alpha, form.beta, log_a, *_given(table))
    bound = form.cost_bound

    def temps(rest):
        own, start = _split_inputs(rest, table)
        return _temperatures(eps_list, own), start

    if tol is not None:  # in blocks that end at a check (:func:`~flashot.solver.blocks.in_blocks`)
        key = ("self", backend_key, shapes(tensors), rho)

        def block(span, checks, q, k, alpha, beta, la, *rest):
            own = AttentionForm(q, k, alpha, beta, cost_bound=bound)
            own_eps, start = temps(rest)
            out = _self_iterations(own, la, own_eps, damping, rho, backend, max_iter, None,
                                   check_every, min_iter, start[0] if start else None, span,
                                   checks)  # fmt: skip
            return (out.f, *((out.pending,) if checks else ()))

        def floor(p):
            return precision_floor(Potentials(form, p, p, log_a, log_a, eps_list[-1]))

        with backend.operand_scope():
            (p,), it, error, stop = in_blocks(
                key, tensors, (), block, form=form, eps_list=eps_list, damping=damping,
                max_iter=max_iter, check_every=check_every, min_iter=min_iter, tol=tol,
                floor=floor, cells=table is not None, cache=GRAPHS,
            )  # fmt: skip
            parts = last_pass(form, p, log_a)
        return SolverOutput(p, p, it, stop.converged, error, stop.cause, stop.floor, final=parts)

    key = ("self", *replay_key(backend_key, form, tensors, eps_list, damping, table is not None),
           rho, max_iter, final, keep_iterates)  # fmt: skip

    def run(q, k, alpha, beta, la, *rest):
        own = AttentionForm(q, k, alpha, beta, cost_bound=bound)
        out = _self_iterations(own, la, temps(rest)[0], damping, rho, backend, max_iter, None,
                               check_every, min_iter, keep=keep_iterates)  # fmt: skip
        return out.f, last_pass(own, out.f, la), None if out.iterates is None else out.iterates[0]

    with backend.operand_scope():
        p, parts, kept = GRAPHS(key, run, tensors)
    iterates = None if kept is None else (kept, kept)
    return SolverOutput(p, p, max_iter, None, float("nan"), final=parts, iterates=iterates)


def _table(backend, form, eps_list, dtype, damping):
    """The schedule's device table (:mod:`~flashot.backends.temperature`), where read."""
    if not backend.reads_temperatures(form):
        return None
    return schedule_table(eps_list, form.q.device, dtype, damping)


def _temperatures(eps_list, table):
    """The schedule reading ``table``'s rows (:mod:`flashot.backends.temperature`), or as given."""
    return eps_list if table is None else temperatures_on(eps_list, table)


def _on(options: dict, table) -> dict:
    """``options`` whose ``eps_list`` reads ``table``'s rows (unchanged without a table)."""
    return {**options, "eps_list": _temperatures(options["eps_list"], table)}


def _given(table) -> tuple:
    return () if table is None else (table,)


def _split_inputs(rest: tuple, table) -> tuple:
    """``(its table, its other inputs)`` of a replayed function's trailing inputs.

    The table (a static copy of ``table``, or None without one) leads them, as
    :func:`_given` put it.
    """
    return (rest[0], rest[1:]) if table is not None else (None, rest)


def _self_iterations(form, log_a, eps_list, damping, rho, backend, max_iter, tol, check_every,
                     min_iter, init=None, span=None, check_end=False,
                     keep=False) -> SolverOutput:  # fmt: skip
    """The loop of :func:`solve_self`; ``init``, ``span``, ``check_end``, ``keep`` as there."""
    alpha = form.alpha
    first, final_it = span or (1, max_iter)
    last = len(eps_list) - 1
    schedule = CheckSchedule(len(eps_list), check_every)
    warm = warm_form(form, eps_list)
    if init is None:
        assert first == 1, "a block after the first starts from the previous one's potential"
        lse, _ = backend.row_attend(warm, -alpha, eps_list[0], log_w=log_a)
        p = _self_damping(eps_list[0], damping) * (alpha - lse)
    else:
        p = init
    kept = _stacks((p,), final_it)[0] if keep else None
    stop = _Stopping(tol, lambda: precision_floor(Potentials(form, p, p, log_a, log_a,
                                                             eps_list[-1])))  # fmt: skip
    error, it, pending = float("nan"), 0, None
    for it in range(first, final_it + 1):
        eps = eps_list[min(it - 1, last)]
        lse, _ = backend.row_attend(form if it - 1 >= last else warm, p - alpha, eps, log_w=log_a)
        check = tol is not None and schedule.on_grid(it) and it >= min_iter
        closing = check_end and it == final_it
        if check or closing:
            err = 2.0 * marginal_error(p, row_mass(p, lse, alpha, log_a, eps), log_a, rho)
            if closing:
                pending = err  # (read by the caller, after the block)
            else:
                error = float(err)
        p = 0.5 * (p + _self_damping(eps, damping) * (alpha - lse))
        if kept is not None:
            kept[it] = p
        if check and stop.done(error, it):
            break
    stop.finish()
    iterates = None if kept is None else (kept[: it + 1],) * 2
    return SolverOutput(p, p, it, stop.converged, error, stop.cause, stop.floor, pending=pending,
                        iterates=iterates)  # fmt: skip


def _self_damping(eps, damping):
    """λ(ε) of a self problem, from ``eps``'s device row where it has one."""
    return device_damping(eps, (damping(eps),) * 2)[0]
