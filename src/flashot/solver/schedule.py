"""ε schedules: GeomLoss' annealing from the data's diameter down to ε, or given lists."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_SCHEDULE", "EpsilonScaling", "geomloss_schedule", "temperatures"]

#: the longest ε schedule (temperatures) built: beyond it scaling is surely a mistake
MAX_SCHEDULE = 10_000


@dataclass(frozen=True)
class EpsilonScaling:
    """Geometric ε annealing ("ε-scaling") from the data diameter down to the target ε.

    The temperatures are GeomLoss' (with p = 2): ``D²``, then ``D² s^{2k}`` for
    k = 0, 1, … while above ε, then ε; ``D`` is the bounding-box diagonal of the
    embedded clouds unless given. One Sinkhorn iteration runs per temperature,
    then iterations continue at ε until ``tol`` or ``max_iter``.

    Attributes:
        scaling: ratio of successive blurs √ε, in (0, 1).
        diameter: the diameter D, or None to measure it from the data.
    """

    scaling: float = 0.5
    diameter: float | None = None

    def __post_init__(self):
        if not (isinstance(self.scaling, (int, float)) and 0 < self.scaling < 1):
            raise ValueError(f"scaling must be in (0, 1), got {self.scaling!r}")
        if self.diameter is not None and not (self.diameter > 0 and math.isfinite(self.diameter)):
            raise ValueError(f"diameter must be finite and > 0, got {self.diameter!r}")


def geomloss_schedule(diameter: float, eps: float, scaling: float, p: int = 2) -> list[float]:
    """GeomLoss' temperature list: ``[D^p, exp(p log D − p k log(1/s))…, ε]``.

    Args:
        diameter: D > 0.
        eps: final temperature ε = blur^p.
        scaling: ratio of successive blurs, in (0, 1).
        p: the cost's exponent (``|x − y|^p / p``).
    """
    blur = eps ** (1.0 / p)
    count = max(0.0, math.log(diameter / blur) / math.log(1 / scaling))
    if count > MAX_SCHEDULE:
        raise ValueError(
            f"scaling={scaling!r} gives an eps schedule of {count:.3g} temperatures from the "
            f"diameter {diameter:g} down to blur {blur:g}; at most {MAX_SCHEDULE} are "
            "supported: use a smaller scaling"
        )
    steps = np.arange(p * np.log(diameter), p * np.log(blur), p * np.log(scaling))
    return [diameter**p] + [float(np.exp(e)) for e in steps] + [eps]


def temperatures(eps_schedule, eps: float, diameter: Callable[[], float]) -> list[float]:
    """The temperatures of ``eps_schedule`` ending at ``eps``.

    Args:
        eps_schedule: None (fixed ε), ``"geomloss"``, an :class:`EpsilonScaling`, or an
            explicit sequence of temperatures ending at (or followed by) ε.
        eps: the final ε.
        diameter: gives the data's diameter D when a schedule needs it (asked lazily).
    """
    if eps_schedule is None:
        return [eps]
    if isinstance(eps_schedule, str):
        if eps_schedule != "geomloss":
            raise ValueError(
                f"eps_schedule must be None, 'geomloss', an EpsilonScaling or floats, "
                f"got {eps_schedule!r}"
            )
        eps_schedule = EpsilonScaling()
    if isinstance(eps_schedule, EpsilonScaling):
        d = eps_schedule.diameter or diameter()
        if d <= 0:  # all points coincide: nothing to anneal
            return [eps]
        temps = geomloss_schedule(d, eps, eps_schedule.scaling)
        return [t for t in temps[:-1] if t > eps] + [eps]
    if isinstance(eps_schedule, Sequence) and all(
        isinstance(t, numbers.Real) and not isinstance(t, bool) for t in eps_schedule
    ):
        temps = [float(t) for t in eps_schedule]
        if any(not (t > 0 and math.isfinite(t)) for t in temps):
            raise ValueError(f"eps_schedule temperatures must be finite and > 0, got {temps}")
        return [*temps, eps] if not temps or temps[-1] != eps else temps
    raise TypeError(
        "eps_schedule must be None, 'geomloss', an EpsilonScaling or a sequence of floats, "
        f"got {eps_schedule!r}"
    )
