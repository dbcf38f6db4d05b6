r"""Streaming primitives in plain PyTorch: the CPU engine and the oracle of the GPU kernels.

Scores are formed one (BLOCK_M, BLOCK_N) tile at a time with ``addmm`` and reduced
with an online log-sum-exp, exactly the recurrence the Triton kernels run on chip:

.. math::

    m' = \max(m, \max_j S_{ij}),\quad
    s' = s\,e^{m - m'} + \sum_j e^{S_{ij} - m'},\quad
    o' = o\,e^{m - m'} + \sum_j e^{S_{ij} - m'} v_j .

Tile sizes come from a memory budget, so peak memory is O((n + m) d + budget).
"""

from __future__ import annotations

import torch

from flashot.backends.base import Backend
from flashot.backends.row_pool import run_row_blocks, tile_sizes

__all__ = ["TorchBackend"]

# exp(t) for t below this is < 1e-34 (float32) / 1e-304 (float64) of the row's largest
# term: clamping there changes no sum, and keeps exp off the subnormal path (10x slower).
_EXP_FLOOR = {torch.float32: -80.0, torch.float64: -700.0}


class TorchBackend(Backend):
    """Blockwise PyTorch implementation of the streaming primitives (CPU and CUDA).

    Args:
        precision: ``"auto"``/``"fp32"`` (full precision of the input dtype), or
            ``"tf32"``/``"bf16"``/``"fp16"``: the problem between the clouds rounded to that
            precision (the operands are rounded when the form is built; products of
            rounded operands are exact, so scores are then computed in float32).
        budget: the largest score tile, in elements (default 2**20: 4 MB in float32, which
            measured fastest on a 2-core CPU at n = 5 000 and 40 000).
    """

    name = "torch"
    precisions = ("fp32", "tf32", "bf16", "fp16")

    def __init__(self, precision: str = "auto", budget: int = 1 << 20):
        super().__init__(precision)
        if budget < 1:
            raise ValueError(f"budget must be a positive number of elements, got {budget}")
        self.budget = int(budget)

    def _row_attend(self, form, h, eps, v=None):
        """See :meth:`flashot.backends.base.Backend._row_attend`."""
        q, k = form.q, form.k
        n, m = q.shape[0], k.shape[0]
        inv_eps = 1.0 / eps
        block_m, block_n = tile_sizes(n, m, self.budget)
        floor = _EXP_FLOOR[q.dtype]
        keep = torch.isfinite(h)
        keep = None if bool(keep.all()) else keep.to(q.dtype)  # zero-weight columns
        lse = torch.empty(n, dtype=q.dtype, device=q.device)
        out = None if v is None else torch.empty(n, v.shape[1], dtype=q.dtype, device=q.device)

        def attend_rows(i0, i1):
            run_max = run_sum = acc = None
            for j0 in range(0, m, block_n):
                j1 = min(m, j0 + block_n)
                s = torch.addmm(h[j0:j1], q[i0:i1], k[j0:j1].T, beta=inv_eps, alpha=inv_eps)
                tile_max = s.amax(1)
                new_max = tile_max if run_max is None else torch.maximum(run_max, tile_max)
                # rows whose bias is all -inf so far: shift by 0, not by -inf
                shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
                e = s.sub_(shift[:, None]).clamp_(min=floor).exp_()
                if keep is not None:
                    e.mul_(keep[j0:j1])
                tile_sum = e.sum(1)
                tile_acc = None if v is None else e @ v[j0:j1]
                if run_max is None:
                    run_sum, acc = tile_sum, tile_acc
                else:
                    decay = torch.exp(run_max - shift)
                    run_sum = run_sum * decay + tile_sum
                    if v is not None:
                        acc = acc * decay[:, None] + tile_acc
                run_max = shift
            lse[i0:i1] = eps * (run_max + torch.log(run_sum))
            if v is not None:
                out[i0:i1] = acc / run_sum[:, None]

        run_row_blocks(attend_rows, n, block_m, n * m, q, k, h, v)
        return lse, out
