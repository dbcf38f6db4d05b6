"""When a Sinkhorn solve stops, and what it says when it misses its tolerance.

The solver (:mod:`flashot.solver.loop`) checks the L1 marginal error every few iterations;
:class:`_Stopping` ends the solve at ``tol``, or early only at the dtype's precision
floor (:func:`precision_floor`), and names the cause of a miss (:data:`CAUSES`), which
:func:`describe_miss` turns into the warning a user reads.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashot.geometry.costs import _row_blocks

__all__ = [
    "AUTO_TOL",
    "CAUSES",
    "CheckSchedule",
    "ConvergenceWarning",
    "FloorTolerance",
    "describe_miss",
    "precision_floor",
    "resolve_stopping",
]


@dataclass(frozen=True)
class CheckSchedule:
    """When a solve measures its marginal error: the one rule every loop follows.

    Iteration ``it`` (from 1) runs at temperature ``temps[min(it − 1, last)]``, with
    ``last = n_temps − 1``. Checks at the final ε fall every ``check_every`` iterations
    counted from its first one; a recorded history also checks the warm-up every
    ``check_every`` iterations.
    """

    n_temps: int
    check_every: int

    @property
    def last(self) -> int:
        """The index of the final ε in the schedule."""
        return self.n_temps - 1

    def at_final(self, it: int) -> bool:
        """Iteration ``it`` runs at the final ε."""
        return it - 1 >= self.last

    def on_grid(self, it: int) -> bool:
        """A check at the final ε (where ``tol`` may stop the solve)."""
        return self.at_final(it) and (it - self.last) % self.check_every == 0

    def in_warmup(self, it: int) -> bool:
        """A recorded check of the warm-up (``history=True``)."""
        return not self.at_final(it) and it % self.check_every == 0

    def before(self, it: int) -> bool:
        """The next iteration checks (its columns must then be exact)."""
        return self.on_grid(it + 1)


class ConvergenceWarning(UserWarning):
    """Sinkhorn missed ``tol``; the message names the cause and what to try."""


#: causes a solve that missed ``tol`` can report (``SolverOutput.cause``)
CAUSES = (
    "max_iter",
    "no_progress",
    "oscillation",
    "precision_floor",
    "eps_too_small",
    "final_step",
)
#: a stalled error is at the precision floor when within this factor of the estimate
#: (float32 solves stalled at 0.01–0.25 of it on 48 random problems, both updates)
FLOOR_FACTOR = 1.0
#: checks without progress after which an error under the floor estimate ends a solve (a
#: stall above it waits ``patience`` checks and goes on). v49: 8 checks (80 iterations) of
#: noise at 0.3–0.45 of the floor made OTDD's self problems take 104–114 iterations
#: instead of 24–54 (float32, both precisions of the kernels)
AT_FLOOR_PATIENCE = 2
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


def precision_floor(pot, per_problem: bool = False, backend=None):
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

    ``pot``: the problem at potentials (f, g) (:class:`~flashot.backends.dual.Potentials`).
    ``backend``: sums and sizes over a sharded problem's ranks
    (:meth:`~flashot.backends.base.Backend.reduce`). With ``per_problem``, a packed
    form's (:mod:`flashot.geometry.segments`) floors of each of its problems, (B,) float64
    on the host; otherwise one float.
    """
    form, f, g, log_a, log_b, eps = pot.parts()
    u = torch.finfo(f.dtype).eps
    n, m = (f.shape[0], g.shape[0]) if backend is None else backend.global_shape(form)
    seg = form.segments if per_problem else None
    with torch.no_grad():
        if seg is None:
            parts = []
            for pot, offset, log_w in ((f, form.alpha, log_a), (g, form.beta, log_b)):
                w = torch.exp(log_w)
                parts += [(w * (pot.abs() + offset.abs())).sum() * (2.0 / eps), w.sum()]
            sums = torch.stack(parts)
            size_f, mass_a, size_g, mass_b = (
                sums if backend is None else backend.reduce(sums)
            ).tolist()
            return u * (
                size_f + mass_a * math.log(max(m, 2)) + size_g + mass_b * math.log(max(n, 2))
            )
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

    A stall (the best error improved by less than 0.1 % over :data:`AT_FLOOR_PATIENCE`
    checks) ends the solve only when the error is within :data:`FLOOR_FACTOR` of
    :func:`precision_floor`; the symmetric iteration also has slow, non-monotone
    phases far above it, where it must go on (the floor is asked again at every check
    of a stall, ``patience`` counting its length). A solve that misses ``tol`` names its
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
        if self.flat < AT_FLOOR_PATIENCE:
            return False
        floor = self.floor = self.floor_fn()
        if self.best > FLOOR_FACTOR * floor:  # stalled above the floor: go on
            if self.flat >= self.patience:
                self.flat = 0
            return False
        # ε drives the floor (∝ 1/ε) when it stalls far above the requested tol
        if self.best > 10 * self.tol:
            self.cause = "eps_too_small"
        elif isinstance(self.tol, FloorTolerance):  # as close as the dtype gets
            self.converged = self.tol.reached(self.best, lambda: floor)
        else:
            self.cause = "precision_floor"
        return True

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
    ups = sum(b > a for a, b in itertools.pairwise(errors))
    return ups >= (len(errors) - 1) // 2 and max(errors) - min(errors) > SWING * max(errors)


def final_verdict(tol, error: float | None, out, floor_now, dtype: torch.dtype, update: str,
                  scale: float | None) -> tuple[bool | None, str | None, str | None]:  # fmt: skip
    """``(converged, cause, message)`` of a solve's final potentials against ``tol``.

    The loop's output ``out`` (a :class:`~flashot.solver.loop.SolverOutput`) tells why it
    stopped; the error at the final extrapolation decides. A loop that met ``tol`` whose
    extrapolation misses it stopped at the precision floor (within
    :data:`FLOOR_FACTOR` of ``floor_now()``, or above tol at the floor) or lost it in
    the final step. ``message`` is the warning text (:func:`describe_miss`), None when
    converged or without ``tol``; ``scale`` the cost's bound over ε.
    """
    if tol is None:
        return None, None, None
    assert error is not None  # (measured whenever there is a tol)
    converged = tol.reached(error, floor_now) if isinstance(tol, FloorTolerance) else error <= tol
    if converged:
        return True, None, None
    cause, floor = out.cause or "max_iter", out.floor
    if out.converged:  # the loop met tol; the final (extrapolated) potentials do not
        floor = floor_now()
        at_floor = error <= FLOOR_FACTOR * floor or out.error > tol
        cause = "precision_floor" if at_floor else "final_step"
    return False, cause, describe_miss(cause, tol, error, floor, out.n_iter, dtype, update, scale)


def describe_miss(cause: str, tol: float, error: float, floor: float | None, n_iter: int,
                  dtype: torch.dtype, update: str = "symmetric",
                  scale: float | None = None) -> str:  # fmt: skip
    """The warning text of a solve that missed ``tol``: what happened and what works.

    ``scale`` is the cost's bound over ε, the iterations a flat error may still need.
    """
    other = "alternating" if update == "symmetric" else "symmetric"
    head = (
        f"Sinkhorn did not reach tol={tol:g} (marginal error {error:.3e} after {n_iter} iterations)"
    )
    fl = "" if floor is None else f"{floor:.1e}"
    why = {
        "max_iter": "max_iter was not enough; increase max_iter or use an eps_schedule"
        + (
            ", or update='alternating' (fewer iterations at small eps)"
            if other == "alternating"
            else ""
        ),
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
