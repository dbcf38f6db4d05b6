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
import triton

from flashot.backends.device import on_device
from flashot.backends.temperature import LOG2E
from flashot.backends.triton import _configs
from flashot.backends.triton._combine import _combine_kernel
from flashot.backends.triton._kernels import _plan_sums_kernel
from flashot.backends.triton._launch import temp_args

__all__ = ["exact_lse", "partials_budget"]

#: bytes of partials any one-pass step may take (see partials_budget)
PARTIALS_FLOOR = 1 << 26


def partials_budget(n: int, m: int, d: int) -> int:
    """Bytes of partials a one-pass step may take: the clouds and their split copies.

    At least :data:`PARTIALS_FLOOR`; memory then stays O((n + m)·d).
    """
    return max(PARTIALS_FLOOR, 8 * (n + m) * d)


def exact_lse(backend, pot):
    """``(lse_r (n,), lse_c (m,))`` of potentials f, g (see module), or None.

    None over the partials' budget or for a packed form (its blocks are the fused pass's).
    ``backend``: the :class:`~flashot.backends.triton.TritonBackend` (its operands,
    tiles and launches); ``pot``: a :class:`~flashot.backends.dual.Potentials`.
    """
    form, f, g, log_a, log_b, eps = pot.parts()
    if form.segments is not None:
        return None
    q, k, split_args, presplit, nb, mb, key = backend._sums_operands(form)
    n, m, d = q.shape[0], k.shape[0], q.shape[1]
    dev = q.device
    bd, chunks = _configs.block_d(d, q.element_size())
    cfg = backend._table_tiles(key, nb, mb, dev)
    if 4 * triton.cdiv(m, cfg.kwargs["BLOCK_N"]) * n > partials_budget(n, m, d):
        return None
    lse_r = torch.empty(n, device=dev, dtype=torch.float32)
    lse_c = torch.empty(m, device=dev, dtype=torch.float32)
    block_n = cfg.kwargs["BLOCK_N"]

    def build(splits, per, probe=False):
        """Grid, arguments and constexprs with ``splits`` row splits; partials unless probe."""
        row_lse = col_max = col_sum = lse_r
        if not probe:
            row_lse = torch.empty(triton.cdiv(m, block_n), n, device=dev, dtype=torch.float32)
            col_max = torch.empty(splits, m, device=dev, dtype=torch.float32)
            col_sum = torch.empty_like(col_max)

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_N"]), splits)

        unused = (lse_r,) * 9  # R, C, the gate, the products' weights and sums, BLOCKS
        args = (q, k, f, form.alpha, g, form.beta, log_a, log_b, *unused, n, m, d,
                LOG2E / eps, 0.0, 0.0, 0, *temp_args(eps, lse_r), per, q.stride(0),
                q.stride(1), k.stride(0), k.stride(1), nb, mb, *split_args, row_lse, col_max,
                col_sum)  # fmt: skip
        consts = dict(BLOCK_D=bd, D_CHUNKS=chunks, GATED=False, MULTIPLY=False,
                      PRECISION=backend._kernel_dot(key[4]), PRESPLIT=presplit,
                      SEGMENTED=False, EXACT=True)  # fmt: skip
        return grid, args, consts

    exact_key = (*key, "exact")  # its own occupancy and fitted tiles

    def plan_for(tiles):
        nonlocal block_n
        block_n = tiles.kwargs["BLOCK_N"]
        return build(*backend._split(_plan_sums_kernel, exact_key, tiles, build, m, n, dev))

    plan = backend._run_fitting(_plan_sums_kernel, exact_key, cfg, plan_for, dev)
    row_lse, col_max, col_sum = plan[1][-3:]
    with on_device(dev):  # rows: LSE partials (unit sums); columns: (max, sum) pairs
        for part_max, part_sum, out, size in ((row_lse, row_lse, lse_r, n),
                                              (col_max, col_sum, lse_c, m)):  # fmt: skip
            _combine_kernel[(triton.cdiv(size, 128), 1)](
                part_max, part_sum, part_max, out, out, size, 1, part_max.shape[0], eps,
                *temp_args(eps, out), 0, 0,
                BLOCK=128, BLOCK_P=1, HAS_V=False, UNIT_SUMS=part_sum is part_max,
            )  # fmt: skip
    return lse_r, lse_c
