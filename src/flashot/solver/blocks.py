"""A schedule's iterations as fixed launch sequences, replayed as CUDA graphs.

The warm-up steps' form (:func:`warm_form`), what a run of steps launches
(:func:`steps_key`, :func:`replay_key`: the keys of :data:`~flashot.solver.graphs.GRAPHS`)
and a solve to a tolerance in blocks that each end at a check (:func:`in_blocks`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

from flashot.backends.near import is_near_uniform, warm_bounds
from flashot.geometry.costs import AttentionForm
from flashot.solver.graphs import GRAPHS
from flashot.solver.stopping import CheckSchedule, _Stopping

__all__ = ["in_blocks", "replay_key", "shapes", "steps_key", "warm_form"]


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
    bound, seg = warm_bounds(form.cost_bound, seg)
    return replace(form, cost_bound=bound, segments=seg)


def steps_key(form, eps_list, damping, first: int, last_it: int, cells: bool = False) -> tuple:
    """What iterations ``first…last_it`` of a schedule launch.

    Per step: its temperature, whether it is the final one, which LSE it takes (the
    warm-up steps by :func:`warm_form`'s near-uniform rule, the final ones by the
    form's) and its damping. With ``cells`` (the launches read the temperatures and
    the damping from a device table) a warm-up step's values are left out unless it
    takes the near-uniform LSE (torch ops with their scalars); the final one's are
    kept, which the extrapolation and the checks take as scalars.
    """
    warm, last = warm_form(form, eps_list), len(eps_list) - 1
    steps = []
    for it in range(first, last_it + 1):
        i = min(it - 1, last)
        e = eps_list[i]
        near = is_near_uniform(form if i == last else warm, e)
        by_row = cells and i < last and not near  # (read from the device table)
        steps.append((None, i == last, near) if by_row else (e, i == last, near, damping(e)))
    return tuple(steps)


def replay_key(backend_key, form, tensors, eps_list, damping, cells) -> tuple:
    """What a replayed loop's launches depend on besides the data and the solver's options.

    The backend's key, the inputs' shapes and every temperature's step
    (:func:`steps_key`).
    """
    steps = steps_key(form, eps_list, damping, 1, len(eps_list), cells)
    return backend_key, shapes(tensors), steps


def shapes(tensors) -> tuple:
    """The tensors' (shape, dtype, device), a key's part."""
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def in_blocks(key, tensors, start, block, *, form, eps_list, damping, max_iter, check_every,
              min_iter, tol, floor, cells=False, cache=GRAPHS):  # fmt: skip
    """A solve to a tolerance in blocks of iterations that each end at a check, replayed.

    Such a solve waits for the device only at its checks (every ``check_every``
    iterations at the final ε): the iterations up to a check are a fixed sequence of
    launches. Each block is a key of :data:`GRAPHS`, run eagerly when first met,
    captured the second time, replayed after that. The warm-up temperatures are a block
    of their own, and a block's key holds only its own steps' temperatures
    (:func:`steps_key`) and whether it checks: a long solve's blocks at the final ε
    share one graph, and so do solves whose ε schedules differ in the warm-up only (a
    GeomLoss schedule starts from the data's diameter, which a training loop moves
    every step). The iterates, checks and stopping are the eager loop's.

    Args:
        key: what the launches depend on besides the data, the temperatures and the
            block (the backend's key, the inputs' shapes, the options).
        form: the cost (for the near-uniform rule of each step; :func:`warm_form`).
        eps_list, damping, max_iter, check_every, min_iter, tol: as in :func:`solve`.
        tensors: the data (the form's tensors and log weights).
        start: the potentials to start from, or ``()`` (the loop initializes).
        block: ``block((first, last), checks, *tensors, *potentials)`` runs iterations
            ``first…last`` and returns the potentials, then, if it checks, the error
            (0-dim, on the device).
        floor: ``floor(*potentials)``, the precision floor (:func:`precision_floor`).
        cells: the blocks read their temperatures from a device table among ``tensors``
            (keys then hold the warm-up's structure, not its values; :func:`steps_key`).
        cache: the graph cache (the caller's :data:`~flashot.solver.graphs.GRAPHS`).

    Returns:
        ``(potentials, iterations, error, stopping)`` (a :class:`_Stopping`, finished).
    """
    last = len(eps_list) - 1
    schedule = CheckSchedule(len(eps_list), check_every)
    checks = [it for it in range(1, max_iter + 1) if schedule.on_grid(it) and it >= min_iter]
    checked_at = set(checks)
    ends = sorted(checked_at | {max_iter} | ({last} if last > 0 else set()))
    pots = tuple(start)
    stop = _Stopping(tol, lambda: floor(*pots))
    error, first, it = float("nan"), 1, 0
    for it in ends:
        checked = it in checked_at
        steps = steps_key(form, eps_list, damping, first, it, cells)
        block_key = (*key, steps, checked, not pots)
        out = cache(block_key, functools.partial(block, (first, it), checked), (*tensors, *pots))
        pots = out[:-1] if checked else out
        if checked:
            error = float(out[-1])
            if stop.done(error, it):
                break
        first = it + 1
    stop.finish()
    return pots, it, error, stop
