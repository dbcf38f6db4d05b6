r"""Temperatures that also live on the device, so that one CUDA graph serves any schedule.

A replayed solve (:mod:`flashot.graphs`) repeats its captured launches with their
captured scalars. With ε passed as a scalar, a graph serves only the ε schedule it was
captured with, and GeomLoss' schedule starts from the data's diameter: in a training
loop, where the clouds move every step, it never repeats. A :class:`Temperature` is a
float (for the host's decisions, which the graph's key pins) that carries ``cell``, a
view of a small device table that a graph takes as an input:

.. math::

    \text{row } i = \big(\varepsilon_i,\ \log_2(e)/\varepsilon_i,\
        \min(1, \varepsilon_i/\varepsilon_{i-1})\big),

rounded from float64 to float32, as scalar kernel arguments are: a kernel that reads
the row computes what it computes from the scalars, bit for bit. Kernels and torch ops
that support it read the row (:func:`device_value`); the solver keys a replay by the
schedule's structure instead of its values only when the backend says that every
launch of a step does (:meth:`flashot.backends.base.Backend.reads_temperatures`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["Temperature", "device_value", "follows", "schedule_table", "temperatures_on"]

LOG2E = 1.0 / math.log(2.0)
#: the table's columns: ε, log2(e)/ε, and the ratio to the previous row's ε (at most 1)
EPS, SCALE, RATIO = 0, 1, 2


class Temperature(float):
    """A temperature ε (a float) with its row of a device table (see module).

    Attributes:
        cell: (3,) float32 view ``(ε, log2(e)/ε, min(1, ε/ε_prev))`` of the table.
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


def schedule_table(eps_list: Sequence[float], device: torch.device) -> torch.Tensor:
    """The (k, 3) float32 device table of a schedule (see module), in one copy."""
    rows = [(e, LOG2E / e, 1.0 if i == 0 else min(1.0, e / eps_list[i - 1]))
            for i, e in enumerate(eps_list)]  # fmt: skip
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32).to(device)


def temperatures_on(eps_list: Sequence[float], table: torch.Tensor) -> list[Temperature]:
    """The schedule's temperatures, each with its row of ``table`` (a graph's input)."""
    return [Temperature(e, table[i], i) for i, e in enumerate(eps_list)]


def device_value(eps: float) -> float | torch.Tensor:
    """ε for a torch op: a 0-dim device tensor for a :class:`Temperature`, else the float.

    ``x * device_value(ε)`` rounds as ``x * ε`` does (a float scalar is cast to float32
    first); a division may differ from the scalar one by an ulp.
    """
    return eps.cell[EPS] if isinstance(eps, Temperature) else eps


def follows(eps: float, last: float | None) -> bool:
    """Whether ``eps`` is the row after ``last`` in one table (its ratio is then theirs)."""
    if not (isinstance(eps, Temperature) and isinstance(last, Temperature)):
        return False
    one_table = eps.cell.untyped_storage().data_ptr() == last.cell.untyped_storage().data_ptr()
    return one_table and eps.index == last.index + 1
