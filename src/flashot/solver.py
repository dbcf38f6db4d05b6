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

import collections
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from flashot.autodiff.functions import extrapolate
from flashot.backends.base import Backend
from flashot.backends.near import is_near_uniform
from flashot.costs import AttentionForm, _row_blocks
from flashot.dual import marginal_error, row_mass
from flashot.graphs import GRAPHS
from flashot.momentum import Relaxation, check_momentum
from flashot.progress import Progress
from flashot.schedule import EpsilonScaling, geomloss_schedule, temperatures

__all__ = [
    "EpsilonScaling",
    "SolverOutput",
    "describe_miss",
    "geomloss_schedule",
    "marginal_error",
    "precision_floor",
    "solve",
    "solve_self",
    "temperatures",
]

UPDATES = ("symmetric", "alternating")
#: warm-up temperatures take the near-uniform LSE from this multiple of the cost's bound
WARM_NEAR_FROM = 4.0
@dataclass(frozen=True)
class SolverOutput:
    """The loop's final iterate (detached) and how it got there.

    Attributes:
        f: (n,) row potential.
        g: (m,) column potential (equal to f for a self problem).
        n_iter: iterations run (the initialization and final extrapolation not counted).
        converged: whether the error reached ``tol`` (None when ``tol`` is None).
        error: the last measured error (NaN if never measured).
        cause: why ``tol`` was missed (one of :data:`CAUSES`), None otherwise.
        floor: the precision floor estimate (:func:`precision_floor`) if computed.
        final: the final extrapolation ``(λ_x T(g), λ_y T(f))`` at the last ε, when
            asked for (``final_step=True``; None otherwise).
        checks: with ``record=True``, ``(iteration, ε, error)`` of every check (None
            otherwise).
    """

    f: torch.Tensor
    g: torch.Tensor
    n_iter: int
    converged: bool | None
    error: float
    cause: str | None = None
    floor: float | None = None
    final: tuple[torch.Tensor, torch.Tensor] | None = None
    checks: tuple[tuple[int, float, float], ...] | None = None


#: causes a solve that missed ``tol`` can report (``SolverOutput.cause``)
CAUSES = ("max_iter", "no_progress", "oscillation", "precision_floor", "eps_too_small",
          "final_step")
#: a stalled error is at the precision floor when within this factor of the estimate
#: (float32 solves stalled at 0.01–0.25 of it on 48 random problems, both updates)
FLOOR_FACTOR = 1.0
#: a tol under the floor estimate by this factor is out of reach (stalls were ≥ 0.008 of it)
UNREACHABLE = 1000.0
#: Relative spread of the last checks' errors under which a miss made no progress at all
#: (rounding noise: the potentials no longer move), and over which ups and downs swing.
FLAT, SWING = 1e-4, 1e-3


#: the tolerance of ``tol="auto"``
AUTO_TOL = 1e-6


class FloorTolerance(float):
    """A tolerance that also takes the dtype's precision floor as convergence.

    ``tol="auto"`` is ``FloorTolerance(1e-6)``: a solve converges at 1e-6 or at an
    error under :func:`precision_floor` within :data:`SLACK` × 1e-6 (float32 rarely
    reaches 1e-6 once ε is well below the cost's scale; it says so only when ε is too
    small).
    """

    #: how far above the tolerance the precision floor may be and still count
    SLACK = 10.0

    def reached(self, error: float, floor: Callable[[], float]) -> bool:
        """Whether ``error`` meets this tolerance; ``floor()`` is asked only if needed."""
        if error <= self:
            return True
        return error <= self.SLACK * self and error <= FLOOR_FACTOR * floor()


def resolve_stopping(tol, update: str, problem=None, momentum=None) -> tuple[float | None, str]:
    """``(tol, update)`` with the defaults resolved (see :func:`flashot.sinkhorn`).

    ``tol="auto"``: :class:`FloorTolerance` (1e-6). ``update="auto"``: alternating when
    solving to a tolerance (3–4× fewer iterations than symmetric, measured in
    benchmarks/NOTES.md), symmetric for a fixed iteration count (GeomLoss' schedule,
    one fused pass per step) and for a ``problem`` between a measure and itself, where
    the averaged steps keep f = g and converge in a few dozen iterations (alternating
    ones take thousands at small ε). With a ``momentum``, alternating (it relaxes those).
    """
    if isinstance(tol, str):
        if tol != "auto":
            raise ValueError(f"tol must be a number ≥ 0, None or 'auto', got {tol!r}")
        tol = FloorTolerance(AUTO_TOL)
    if update == "auto" and momentum is not None:
        update = "alternating"
    if update == "auto":  # (the self-problem check waits for the device: only with a tol)
        same = tol is not None and problem is not None and _is_self_problem(problem)
        update = "symmetric" if tol is None or same else "alternating"
    return tol, update


def _is_self_problem(problem) -> bool:
    """Whether a problem transports a measure onto itself (same points, weights, ρ)."""
    x, y = problem.x, problem.y
    if x.shape != y.shape or problem.rho_x != problem.rho_y:
        return False
    if not torch.equal(problem.a, problem.b):
        return False
    x, y = x.detach(), y.detach()
    if x.data_ptr() == y.data_ptr() and x.stride() == y.stride() and x.dtype == y.dtype:
        return True  # the same storage (NaN-free: the problem's points are checked finite)
    # a block of rows at a time: torch.equal on CUDA makes a boolean copy of the cloud
    return all(torch.equal(u, v) for u, v in zip(_row_blocks(x), _row_blocks(y), strict=True))


def precision_floor(form, f, g, log_a, log_b, eps: float, per_problem: bool = False):
    r"""The smallest L1 marginal error the dtype can attain at these potentials.

    A row's log residual ``ln R_i = (f_i − α_i + ℓ_i)/ε`` is formed from terms of size
    ``|f_i|``, ``α_i`` and ``|ℓ_i| ≈ |f_i − α_i|``, each rounded to ``u`` relative (the
    unit roundoff of the compute dtype); the LSE adds about ``u log m``. Summed with the
    weights, the worst case is

    .. math::

        \mathrm{floor} = u \Big(\sum_i a_i \frac{2(|f_i| + |\alpha_i|)}{\varepsilon}
            + m(a) \log m \Big) + (\text{same for the columns}).

    Rounding errors partly cancel, so solves settle below it (float32: 0.01–0.25 of
    it). A solve whose error stalls under :data:`FLOOR_FACTOR` times it has stopped for
    precision, not for lack of iterations.

    With ``per_problem``, a packed form's (:mod:`flashot.segments`) floors of each of its
    problems, (B,) float64 on the host; otherwise one float.
    """
    u = torch.finfo(f.dtype).eps
    n, m = f.shape[0], g.shape[0]
    seg = form.segments if per_problem else None
    with torch.no_grad():
        if seg is None:
            parts = []
            for pot, offset, log_w, other in ((f, form.alpha, log_a, m),
                                              (g, form.beta, log_b, n)):  # fmt: skip
                w = torch.exp(log_w)
                size = (w * (pot.abs() + offset.abs())).sum() * (2.0 / eps)
                parts.append(size + w.sum() * math.log(max(other, 2)))
            return u * float(sum(parts))
        out = torch.zeros(seg.count, dtype=torch.float64)
        for side, pot, offset, log_w in ((seg, f, form.alpha, log_a),
                                         (seg.T, g, form.beta, log_b)):  # fmt: skip
            w = torch.exp(log_w)
            size = side.sum(w * (pot.abs() + offset.abs())) * (2.0 / eps)
            logs = torch.tensor([math.log(max(c1 - c0, 2))
                                 for c0, c1 in itertools.pairwise(side.cols)])  # fmt: skip
            out += size.double().cpu() + side.sum(w).double().cpu() * logs.double()
        return u * out


class _Stopping:
    """Stop at ``tol``; stop early only at the dtype's precision floor.

    A stall (the best error improved by less than 0.1 % over ``patience`` checks) ends
    the solve only when the error is within :data:`FLOOR_FACTOR` of
    :func:`precision_floor`; the symmetric iteration also has slow, non-monotone
    phases far above it, where it must go on. A solve that misses ``tol`` names its
    cause (:data:`CAUSES`).
    """

    def __init__(self, tol: float | None, floor: Callable[[], float], patience: int = 8):
        self.tol, self.patience, self.floor_fn = tol, patience, floor
        self.best, self.flat = math.inf, 0
        self.floor: float | None = None
        self.recent: collections.deque[float] = collections.deque(maxlen=patience)
        self.converged: bool | None = None if tol is None else False
        self.cause: str | None = None

    def done(self, error: float, it: int) -> bool:
        if not math.isfinite(error):
            raise FloatingPointError(
                f"Sinkhorn diverged at iteration {it} (marginal error {error}); "
                "try a larger eps or an eps_schedule"
            )
        self.recent.append(error)
        assert self.tol is not None  # (only called with a tolerance)
        if error <= self.tol:
            self.converged = True
            return True
        self.flat = self.flat + 1 if error > 0.999 * self.best else 0
        self.best = min(self.best, error)
        if self.flat < self.patience:
            return False
        self.flat = 0
        floor = self.floor = self.floor_fn()
        if self.best <= FLOOR_FACTOR * floor:
            # ε drives the floor (∝ 1/ε) when it stalls far above the requested tol
            if self.best > 10 * self.tol:
                self.cause = "eps_too_small"
            elif isinstance(self.tol, FloorTolerance):  # as close as the dtype gets
                self.converged = self.tol.reached(self.best, lambda: floor)
            else:
                self.cause = "precision_floor"
            return True
        return False

    def finish(self) -> None:
        """Name the cause of a miss that ran to ``max_iter``."""
        if self.converged is not False or self.cause is not None:
            return
        recent = list(self.recent)
        floor = self.floor = self.floor_fn()
        assert self.tol is not None  # (converged is False: there is a tolerance)
        if floor > UNREACHABLE * self.tol:  # even the best rounding luck is above tol
            self.cause = "eps_too_small"
        elif len(recent) >= 4 and max(recent) - min(recent) <= FLAT * max(recent):
            self.cause = "no_progress"
        elif len(recent) >= 4 and min(recent) > 0.999 * self.best and _swings(recent):
            self.cause = "oscillation"
        else:
            self.cause = "max_iter"


def _swings(errors: list[float]) -> bool:
    """Whether a sequence of errors rises as often as it falls (no trend, an oscillation)."""
    ups = sum(b > a for a, b in zip(errors, errors[1:], strict=False))
    return ups >= (len(errors) - 1) // 2 and max(errors) - min(errors) > SWING * max(errors)


def describe_miss(cause: str, tol: float, error: float, floor: float | None, n_iter: int,
                  dtype: torch.dtype, update: str = "symmetric",
                  scale: float | None = None) -> str:  # fmt: skip
    """The warning text of a solve that missed ``tol``: what happened and what works.

    ``scale`` is the cost's bound over ε, the iterations a flat error may still need.
    """
    other = "alternating" if update == "symmetric" else "symmetric"
    head = f"Sinkhorn did not reach tol={tol:g} (marginal error {error:.3e} after {n_iter} iterations)"
    fl = "" if floor is None else f"{floor:.1e}"
    why = {
        "max_iter": "max_iter was not enough; increase max_iter or use an eps_schedule"
        + (", or update='alternating' (fewer iterations at small eps)" if other == "alternating"
           else ""),
        "no_progress": "the error has not changed over the last checks: the potentials move "
        "by about eps per iteration and may need up to cost scale / eps"
        + ("" if scale is None else f" = {scale:.1e}")
        + " iterations; increase max_iter a lot, use eps_schedule='geomloss' or a larger eps",
        "oscillation": "the error oscillates with no trend over the last checks; slow "
        f"convergence can look like this, so increase max_iter, or try update='{other}' or "
        "an eps_schedule",
        "precision_floor": f"the error stalled at the precision floor of {dtype} for these "
        f"potentials and eps (rounding bound {fl}); use float64 inputs, a larger eps or a "
        "larger tol",
        "final_step": "the loop met tol, but the potentials after the final (differentiated) "
        "step measure slightly above it; a smaller tol lands the final step under yours",
        "eps_too_small": f"eps is too small for {dtype}: rounding alone leaves marginal errors "
        f"up to {fl}, far above tol; use float64 inputs or a larger eps",
    }[cause]
    return f"{head}: {why}"


def _check_iterations(max_iter: int, n_schedule: int, tol: float | None, check_every: int,
                      min_iter: int = 0):  # fmt: skip
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
    if isinstance(min_iter, bool) or not isinstance(min_iter, int) or not 0 <= min_iter <= max_iter:
        raise ValueError(
            f"min_iter must be an integer in [0, max_iter={max_iter}], got {min_iter!r}"
        )
    if max_iter < n_schedule:
        raise ValueError(
            f"max_iter={max_iter} is shorter than the ε schedule ({n_schedule} temperatures); "
            "the solve would stop before reaching eps"
        )
    if tol is not None and not (isinstance(tol, (int, float)) and tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tol must be a finite number ≥ 0 or None, got {tol!r}")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be a positive integer, got {check_every!r}")


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
    final_step: bool = False,
    record: bool = False,
    min_iter: int = 0,
    momentum: float | str | None = None,
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
        record: measure the error every ``check_every`` iterations, warm-up temperatures
            and ``tol=None`` included, and return the checks (``SolverOutput.checks``);
            each record waits for the device.
        min_iter: iterations at least before ``tol`` may stop the solve.
        momentum: over-relaxation of the alternating updates at the final ε (None,
            ``"auto"`` or ω in (0, 2); :mod:`flashot.momentum`).
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
        if not final_step:
            return None
        return extrapolate(form, out.f, out.g, la, lb, eps, lam, backend, update)

    replay = tol is None and not (progress or record)
    backend_key = backend.graph_key(form) if replay else None
    if backend_key is None:
        with backend.operand_scope():
            out = _iterate(form, log_a, log_b, init, progress=progress, record=record, **options)
            return replace(out, final=final(form, out, log_a, log_b))
    # a fixed sequence of launches with no host round trip: replayed as a CUDA graph
    # once it repeats; the key pins everything the launches depend on besides the data
    tensors = (form.q, form.k, form.alpha, form.beta, log_a, log_b, *(init or ()))
    bound = form.cost_bound
    key = (
        *_replay_key(backend_key, form, tensors, eps_list, damping),
        tuple(rho),
        max_iter,
        update,
        final_step,
        momentum,
    )

    def run(q, k, alpha, beta, la, lb, *start):
        form = AttentionForm(q, k, alpha, beta, cost_bound=bound)
        out = _iterate(form, la, lb, start or None, **options)
        return out.f, out.g, *(final(form, out, la, lb) or ())

    with backend.operand_scope():
        f, g, *last = GRAPHS(key, run, tensors)
    final_pair = (last[0], last[1]) if last else None
    return SolverOutput(f, g, max_iter, None, float("nan"), final=final_pair)


def warm_form(form: AttentionForm, eps_list: Sequence[float]) -> AttentionForm:
    """The form the warm-up steps of a schedule take: near path from a higher ε only.

    The near-uniform LSE (:mod:`flashot.backends.near`) buys a few ulps of the cost's
    range at ε above it. A warm-up temperature only starts the next one, and up to
    :data:`WARM_NEAR_FROM` × the bound (a schedule's first temperature ``D²`` is at most
    twice it) the usual path's ``ε·ulp`` is as small. Far above, it is not: the offsets
    ``ε log Σ`` it rounds to are a gauge the symmetric update keeps for good, and in
    float32 one of 1e12 swamps the potentials. The final ε keeps the usual rule.
    """
    seg = form.segments
    if len(eps_list) == 1 or (form.cost_bound is None and (seg is None or seg.bounds is None)):
        return form
    # a packed form decides per problem, from its segments' bounds
    bound = None if form.cost_bound is None else WARM_NEAR_FROM * form.cost_bound
    return replace(form, cost_bound=bound,
                   segments=None if seg is None else seg.scaled_bounds(WARM_NEAR_FROM))


def _iterate(form, log_a, log_b, init, *, eps_list, damping, rho, backend, max_iter, tol,
             check_every, update, progress=False, record=False,
             min_iter=0, momentum=None) -> SolverOutput:  # fmt: skip
    """The loop of :func:`solve` (arguments checked)."""
    q_alpha, k_beta = form.alpha, form.beta
    eps = eps_list[0]
    warm = warm_form(form, eps_list)
    if init is None:
        lam_x, lam_y = damping(eps)
        zf, zg = torch.zeros_like(q_alpha), torch.zeros_like(k_beta)
        lse_r, lse_c = backend.potential_lse(warm, zf, zg, log_a, log_b, eps)
        f, g = lam_x * (q_alpha - lse_r), lam_y * (k_beta - lse_c)
    else:
        f, g = init
    bar = Progress(progress, max_iter)
    stop = _Stopping(tol, lambda: precision_floor(form, f, g, log_a, log_b, eps_list[-1]))
    last = len(eps_list) - 1
    # a backend's fast path (one exponential per element for both updates) keeps its
    # own device-side state; it falls back to exact updates row by row, never via the host
    state = backend.fast_state(f.device) if update == "symmetric" else None
    error, it = float("nan"), 0
    checks: list[tuple[int, float, float]] = []
    relax = None if momentum is None else Relaxation(momentum)
    for it in range(1, max_iter + 1):
        eps = eps_list[min(it - 1, last)]
        lam = damping(eps)
        on_grid = it - 1 >= last and (it - last) % check_every == 0  # at the final ε
        stopping = tol is not None and on_grid and it >= min_iter
        # a record also checks the warm-up, every check_every iterations
        check = stopping or (record and (on_grid or (it - 1 < last and it % check_every == 0)))
        step_form = form if it - 1 >= last else warm
        if update == "symmetric":
            f, g, err = backend.jacobi_step(
                step_form, f, g, log_a, log_b, eps, lam, rho, check=check, state=state
            )
        else:
            lse_r, _ = backend.row_attend(step_form, g - k_beta, eps, log_w=log_b)
            if check:  # columns are exact after the previous g-update
                err = marginal_error(f, row_mass(f, lse_r, q_alpha, log_a, eps), log_a, rho[0])
            f_new = lam[0] * (q_alpha - lse_r)
            omega = relax.omega if relax is not None and it - 1 >= last else 1.0
            f = f_new if omega == 1.0 else torch.lerp(f, f_new, omega)
            lse_c, _ = backend.row_attend(step_form.T, f - q_alpha, eps, log_w=log_a)
            g_new = lam[1] * (k_beta - lse_c)
            # plain before a check: exact columns, so the row error is the whole error
            before_check = it >= last and (it + 1 - last) % check_every == 0
            g = g_new if omega == 1.0 or before_check else torch.lerp(g, g_new, omega)
        if check:
            error = float(err)
            if relax is not None and it - 1 >= last:
                relax.observe(it, error)
            if record:
                checks.append((it, eps, error))
            if stopping and stop.done(error, it):
                break
        bar.update(it, eps, error)
    bar.update(it, eps, error, force=True)
    bar.close()
    stop.finish()
    return SolverOutput(f, g, it, stop.converged, error, stop.cause, stop.floor,
                        checks=tuple(checks) if record else None)  # fmt: skip


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
) -> SolverOutput:
    """Symmetric potential of the self problem OT_ε(a, a): ``p ← ½ (p + λ T(p))``.

    Args:
        form: the cost of the cloud with itself (q = k).
        log_a: (n,) log weights.
        eps_list, max_iter, tol, check_every, min_iter: as in :func:`solve`.
        damping: ε ↦ λ.
        rho: ρ or None.
        backend: the streaming primitives.
    """
    _check_iterations(max_iter, len(eps_list), tol, check_every, min_iter)
    backend_key = backend.graph_key(form) if tol is None and form.segments is None else None
    if backend_key is None:
        with backend.operand_scope():
            return _self_iterations(form, log_a, eps_list, damping, rho, backend, max_iter, tol,
                                    check_every, min_iter)  # fmt: skip
    # a fixed sequence of launches, replayed as a CUDA graph as :func:`solve`'s loop is
    # (a debiased divergence's two self problems were most of its eager launches)
    tensors = (form.q, form.k, form.alpha, form.beta, log_a)
    key = ("self", *_replay_key(backend_key, form, tensors, eps_list, damping), rho, max_iter)
    bound = form.cost_bound

    def run(q, k, alpha, beta, la):
        own = AttentionForm(q, k, alpha, beta, cost_bound=bound)
        out = _self_iterations(own, la, eps_list, damping, rho, backend, max_iter, None,
                               check_every, min_iter)  # fmt: skip
        return (out.f,)

    with backend.operand_scope():
        (p,) = GRAPHS(key, run, tensors)
    return SolverOutput(p, p, max_iter, None, float("nan"))


def _replay_key(backend_key, form, tensors, eps_list, damping) -> tuple:
    """What a replayed loop's launches depend on besides the data and the solver's options.

    The backend's key, which LSE each step takes (the warm-up steps by :func:`warm_form`'s
    rule, the final ones by the form's), the inputs' shapes, the temperatures and their
    damping.
    """
    warm, last = warm_form(form, eps_list), len(eps_list) - 1
    return (
        backend_key,
        tuple(is_near_uniform(form if i == last else warm, e) for i, e in enumerate(eps_list)),
        tuple((t.shape, t.dtype, t.device) for t in tensors),
        tuple(eps_list),
        tuple(damping(e) for e in eps_list),
    )


def _self_iterations(form, log_a, eps_list, damping, rho, backend, max_iter, tol, check_every,
                     min_iter) -> SolverOutput:  # fmt: skip
    """The loop of :func:`solve_self`."""
    alpha = form.alpha
    eps = eps_list[0]
    warm = warm_form(form, eps_list)
    lse, _ = backend.row_attend(warm, -alpha, eps, log_w=log_a)
    p = damping(eps) * (alpha - lse)
    last = len(eps_list) - 1
    stop = _Stopping(tol, lambda: precision_floor(form, p, p, log_a, log_a, eps_list[-1]))
    error, it = float("nan"), 0
    for it in range(1, max_iter + 1):
        eps = eps_list[min(it - 1, last)]
        lse, _ = backend.row_attend(form if it - 1 >= last else warm, p - alpha, eps, log_w=log_a)
        check = tol is not None and it - 1 >= last and (it - last) % check_every == 0
        check = check and it >= min_iter
        if check:
            error = 2.0 * float(marginal_error(p, row_mass(p, lse, alpha, log_a, eps), log_a, rho))
        p = 0.5 * (p + damping(eps) * (alpha - lse))
        if check and stop.done(error, it):
            break
    stop.finish()
    return SolverOutput(p, p, it, stop.converged, error, stop.cause, stop.floor)
