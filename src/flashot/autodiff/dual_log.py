"""Diagnostics of the dual solves behind second derivatives (:func:`record_dual_solves`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

__all__ = ["DualSolveInfo", "DualSolveLog", "log_solve", "record_dual_solves"]


@dataclass(frozen=True)
class DualSolveInfo:
    """What one dual solve of a second derivative did.

    Attributes:
        n_iter: CG iterations (two streaming plan products each); 0 for a small
            problem's direct solve (:mod:`flashot.autodiff.dense_dual`).
        residual: the true relative residual ``‖b − S w‖ / ‖b‖`` reached (the worst
            column of a batch of directions).
        tol: the residual asked for (the accuracy option over
            :data:`~flashot.autodiff.second_order.RESIDUAL_PER_ERROR`).
        converged: ``residual ≤ tol``.
        columns: right-hand sides solved together (directions of one ``hvp`` call).
        eps: ε of the problem.  shape: (n, m).
    """

    n_iter: int
    residual: float
    tol: float
    converged: bool
    columns: int
    eps: float
    shape: tuple[int, int]


class DualSolveLog(list):
    """The :class:`DualSolveInfo` of every dual solve run inside :func:`record_dual_solves`."""

    @property
    def last(self) -> DualSolveInfo | None:
        """The latest solve's record, or None before any."""
        return self[-1] if self else None


_LOGS: list[DualSolveLog] = []


@contextlib.contextmanager
def record_dual_solves():
    """Record the dual solves run in the block: a :class:`DualSolveLog` is yielded.

    Every dual solve (second derivatives after a solve to a tolerance: ``flashot.hvp``,
    double backward of ``sinkhorn``/``sinkhorn_divergence``) appends its
    :class:`DualSolveInfo`. Blocks nest; each sees the solves run inside it.

    Example::

        with flashot.record_dual_solves() as log:
            hv = flashot.hvp(x, y, v, eps=0.1)
        log.last.n_iter, log.last.residual, log.last.converged
    """
    log = DualSolveLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def log_solve(info: DualSolveInfo) -> None:
    """Append a solve's record to every open :func:`record_dual_solves` block."""
    for log in _LOGS:
        log.append(info)
