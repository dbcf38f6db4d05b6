r"""Temperatures that also live on the device, so that one CUDA graph serves any schedule.

A replayed solve (:mod:`flashot.solver.graphs`) repeats its captured launches with their
captured scalars. With ε passed as a scalar, a graph serves only the ε schedule it was
captured with, and GeomLoss' schedule starts from the data's diameter: in a training
loop, where the clouds move every step, it never repeats. A :class:`Temperature` is a
float (for the host's decisions, which the graph's key pins) that carries ``cell``, a
view of a small device table that a graph takes as an input:

.. math::

    \text{row } i = \big(\varepsilon_i,\ \log_2(e)/\varepsilon_i,\
        \min(1, \varepsilon_i/\varepsilon_{i-1}),\ \lambda_x(\varepsilon_i),\
        \lambda_y(\varepsilon_i)\big),

with the unbalanced damping ``λ = ρ/(ρ + ε)`` (1 for a balanced side), rounded from
float64 to the solve's dtype (float32 on the GPU, as scalar kernel arguments are): a
kernel or a torch op that reads the row computes what it computes from the scalars,
bit for bit (a division may differ by an ulp: see :func:`device_value`). Kernels and torch ops
that support it read the row (:func:`device_value`); the solver keys a replay by the
schedule's structure instead of its values only when the backend says that every
launch of a step does (:meth:`flashot.backends.base.Backend.reads_temperatures`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Temperature",
    "device_damping",
    "device_scale",
    "device_value",
    "follows",
    "schedule_table",
    "temperatures_on",
]

LOG2E = 1.0 / math.log(2.0)
#: the table's columns: ε, log2(e)/ε, the ratio to the previous row's ε (at most 1), λ_x, λ_y
EPS, SCALE, RATIO, LAM_X, LAM_Y = 0, 1, 2, 3, 4
#: a launch's ``temp_at`` bits: read ε and log2(e)/ε from the row; also the ratio (it
#: scales the fused gate's limit); also the damping (it scales the update's weights)
READ_ROW, READ_RATIO, READ_DAMPING = 1, 2, 4


class Temperature(float):
    """A temperature ε (a float) with its row of a device table (see module).

    Attributes:
        cell: (5,) view ``(ε, log2(e)/ε, min(1, ε/ε_prev), λ_x, λ_y)`` of the table.
        index: the row's index in its schedule.
    """

    cell: torch.Tensor
    index: int

    def __new__(cls, value: float, cell: torch.Tensor, index: int):  # noqa: D102
        self = super().__new__(cls, value)
        self.cell, self.index = cell, index
        return self

    def __reduce__(self):  # (a pickled temperature is its value)
        return float, (float(self),)


def schedule_table(eps_list: Sequence[float], device: torch.device,
                   dtype: torch.dtype = torch.float32,
                   damping: Callable[[float], float | tuple[float, float]] | None = None,
                   ) -> torch.Tensor:  # fmt: skip
    """The (k, 5) device table of a schedule (see module), in one copy; read-only.

    A table of the same rows, device and dtype is the same tensor (the last
    :data:`TABLES_KEPT`): a debiased divergence's three solves share one, and a repeated
    call copies nothing. A CUDA table is copied from pinned memory without waiting for
    the device: a blocking copy would wait for the work queued before it (the previous
    solve's replay), which the host would otherwise overlap with its own.

    Args:
        eps_list: the temperatures.
        device, dtype: the solve's (the potentials' dtype).
        damping: ε ↦ (λ_x, λ_y), or ε ↦ λ for both sides; None: 1.
    """
    rows = []
    for i, e in enumerate(eps_list):
        lam = (1.0, 1.0) if damping is None else damping(e)
        lam = lam if isinstance(lam, tuple) else (lam, lam)
        rows.append((e, LOG2E / e, 1.0 if i == 0 else min(1.0, e / eps_list[i - 1]), *lam))
    key = (tuple(rows), torch.device(device), dtype)
    table = _TABLES.pop(key, None)
    if table is None:
        table = torch.tensor(rows, dtype=torch.float64).to(dtype)
        if table.device != key[1]:
            if key[1].type == "cuda":
                table = table.pin_memory()
            table = table.to(key[1], non_blocking=True)
    _TABLES[key] = table  # (most recent last)
    while len(_TABLES) > TABLES_KEPT:
        _TABLES.pop(next(iter(_TABLES)))
    return table


#: schedule tables kept for reuse (:func:`schedule_table`)
TABLES_KEPT = 8
_TABLES: dict = {}


def temperatures_on(eps_list: Sequence[float], table: torch.Tensor) -> list[Temperature]:
    """The schedule's temperatures, each with its row of ``table`` (a graph's input)."""
    return [Temperature(e, table[i], i) for i, e in enumerate(eps_list)]


def device_value(eps: float) -> float | torch.Tensor:
    """ε for a torch op: a 0-dim device tensor for a :class:`Temperature`, else the float.

    ``x * device_value(ε)`` rounds as ``x * ε`` does (a float scalar is cast to x's
    dtype first, as the table was); a division may differ from the scalar one by an ulp.
    """
    return eps.cell[EPS] if isinstance(eps, Temperature) else eps


def device_scale(eps: float) -> float | torch.Tensor:
    """``log2(e)/ε`` for a torch op: the row's (0-dim) for a :class:`Temperature`, else a float."""
    return eps.cell[SCALE] if isinstance(eps, Temperature) else LOG2E / eps


def device_damping(eps: float, lam: tuple) -> tuple:
    """``(λ_x, λ_y)`` at ``eps`` for torch ops: the row's for a :class:`Temperature`.

    The solver builds the table with the damping that gives ``lam``; a float ``eps``
    returns ``lam``.
    """
    return (eps.cell[LAM_X], eps.cell[LAM_Y]) if isinstance(eps, Temperature) else lam


def follows(eps: float, last: float | None) -> bool:
    """Whether ``eps`` is the row after ``last`` in one table (its ratio is then theirs)."""
    if not (isinstance(eps, Temperature) and isinstance(last, Temperature)):
        return False
    one_table = eps.cell.untyped_storage().data_ptr() == last.cell.untyped_storage().data_ptr()
    return one_table and eps.index == last.index + 1
