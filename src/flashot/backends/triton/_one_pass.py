r"""Both LSEs of a Jacobi step from one streaming pass, with no window (wide features).

The fused pass (``_plan_sums_kernel``) shares one exponential per score between the row
and the column sums, which needs every residual ``ln R`` inside a fixed window; early
steps of a small-ε solve fall outside it and take two exact passes instead (rows, then
columns). From ``ONE_PASS_FROM_D`` in "fp32" the score tile's three half products, not
its exponentials, bound a pass, so a second exponential per score is cheap and one
exact pass serves both sides: ``_plan_sums_kernel`` with EXACT writes base-2
partials (row LSEs, column ``(max, sum)`` pairs) of

.. math::

    \mathrm{lse}^r_i = ε \ln \sum_j b_j e^{(s_{ij} + g_j − β_j)/ε}, \qquad
    \mathrm{lse}^c_j = ε \ln \sum_i a_i e^{(s_{ij} + f_i − α_i)/ε},

per (column block, row) and per (row split, column), which ``_combine_kernel`` merges.
The row partials are one float each, the block's base-2 LSE (a (max, sum) pair would
take twice the memory): ``4·⌈m / BLOCK_N⌉·n`` bytes, at most :func:`partials_budget`,
else the caller takes the fused path (156 MB at n = m = 50k, within the budget from
d = 256; 625 MB at 100k, within it at d = 512).
"""

from __future__ import annotations

import torch

from flashot.backends.device import on_device
from flashot.backends.triton._ahead import fire
from flashot.backends.triton._combine import _combine_kernel
from flashot.backends.triton._configs import cdiv
from flashot.backends.triton._launch import run, table_tiles, temp_args
from flashot.backends.triton._plan_sums import SumsLaunch

__all__ = ["ExactLaunch", "exact_lse", "partials_budget"]

#: bytes of partials any one-pass step may take (see partials_budget)
PARTIALS_FLOOR = 1 << 26


def partials_budget(n: int, m: int, d: int) -> int:
    """Bytes of partials any one-pass step may take: the clouds and their split copies.

    At least :data:`PARTIALS_FLOOR`; memory then stays O((n + m)·d).
    """
    return max(PARTIALS_FLOOR, 8 * (n + m) * d)


class ExactLaunch(SumsLaunch):
    """``_plan_sums_kernel`` with EXACT: base-2 LSE partials of rows and columns."""

    def __init__(self, backend, pot):
        super().__init__(backend, pot)
        self.consts = {**self.consts, "EXACT": True}
        self.key = (*self.key, "exact")  # its own occupancy and fitted tiles
        self.autotuned = self.full = None
        self.lse_r = self.sums
        self.lse_c = torch.empty(self.m, device=self.device, dtype=torch.float32)

    def allocate(self):
        """The row LSEs (no sums are accumulated)."""
        return torch.empty(self.n, device=self.device, dtype=torch.float32)

    def outputs(self, splits, tiles, probe):
        """Row LSE partials per column block, column (max, sum) pairs per row split."""
        unused = self.lse_r
        row_lse = col_max = col_sum = unused
        if not probe:
            blocks = cdiv(self.m, tiles.kwargs["BLOCK_N"])
            row_lse = torch.empty(blocks, self.n, device=self.device, dtype=torch.float32)
            col_max = torch.empty(splits, self.m, device=self.device, dtype=torch.float32)
            col_sum = torch.empty_like(col_max)
        return dict(R=unused, C=unused, GATE_IN=unused, GATE_OUT=unused, MUL_A=unused,
                    MUL_B=unused, R_DEN=unused, C_DEN=unused, ROW_LSE=row_lse,
                    COL_MAX=col_max, COL_SUM=col_sum)  # fmt: skip


def exact_lse(backend, pot):
    """``(lse_r (n,), lse_c (m,))`` of potentials f, g (see module), or None.

    None over the partials' budget or for a packed form (its blocks are the fused pass's).
    ``backend``: the :class:`~flashot.backends.triton.TritonBackend` (its operands,
    tiles and launches); ``pot``: a :class:`~flashot.backends.dual.Potentials`.
    """
    if pot.form.segments is not None:
        return None
    op = ExactLaunch(backend, pot)
    n, m, dev = op.n, op.m, op.device
    cfg = table_tiles(op.key[:-1], op.nb, op.mb, dev, backend.autotune)
    if 4 * cdiv(m, cfg.kwargs["BLOCK_N"]) * n > partials_budget(n, m, op.d):
        return None
    plan = run(op, cfg, dev, backend.splits)
    eps = pot.eps
    with on_device(dev):  # rows: LSE partials (unit sums); columns: (max, sum) pairs
        for part_max, part_sum, out, size in (
            (plan.args["ROW_LSE"], plan.args["ROW_LSE"], op.lse_r, n),
            (plan.args["COL_MAX"], plan.args["COL_SUM"], op.lse_c, m),
        ):
            fire(_combine_kernel, (cdiv(size, 128), 1),
                PART_MAX=part_max, PART_SUM=part_sum, PART_ACC=part_max, LSE=out, OUT=out,
                n=size, p=1, splits=part_max.shape[0], eps=eps, **temp_args(eps, out),
                stride_on=0, stride_op=0, BLOCK=128, BLOCK_P=1, HAS_V=False,
                UNIT_SUMS=part_sum is part_max,
            )  # fmt: skip
    return op.lse_r, op.lse_c
