r"""A problem sharded by rows over the ranks of a process group, as a backend.

Every rank holds a slice of the rows of x and a slice of y. Its potentials are its
slices of f and g, and a soft c-transform of them runs over *all* columns,

.. math::

    \ell_i = \varepsilon \log \sum_{r} \sum_{j \in \text{rank } r}
        w_j \exp\big((\langle q_i, k_j\rangle + h_j)/\varepsilon\big),

streamed by an inner backend over the columns gathered once (``mode="gather"``) or
passed around the ring of ranks (``mode="ring"``) and merged with a log-sum-exp.
:class:`ShardedBackend` offers the solver's primitives that way, and sums the loop's
errors and floors over the ranks (:meth:`ShardedBackend.reduce`): the one Sinkhorn
loop (:func:`flashot.solver.loop.solve`) then runs a sharded solve unchanged, with
every option it has (ε schedules, unbalanced sides, ``min_iter``, momentum, history).
Communication per row pass is the column potentials, O(m) (gather) or the column
shards, O(m d / W) per step of the ring.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from flashot.backends.base import Backend
from flashot.geometry.costs import AttentionForm

__all__ = ["Comm", "ShardedBackend", "merge_lse"]


class Comm:
    """The group's collectives, with every rank's shard sizes known on every rank.

    Args:
        group: the process group (None: the default one).
        mode: ``"gather"`` or ``"ring"``.
        sizes: ``[(n_r, m_r)]``, every rank's rows of x and of y.
    """

    def __init__(self, group, mode: str, sizes: list[tuple[int, int]]):
        self.group, self.mode = group, mode
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sizes = sizes
        self._kept: list = []  # (tensor, side, gathered): the solve's constant gathers

    def total_size(self, side: int) -> int:
        """Points of a side (0: x, 1: y) over all ranks."""
        return sum(s[side] for s in self.sizes)

    def gather_once(self, t: torch.Tensor, side: int) -> torch.Tensor:
        """:meth:`gather` of a tensor fixed through the solve (features, log weights).

        Gathered on first use, then kept (by identity).
        """
        for src, s, out in self._kept:
            if src is t and s == side:
                return out
        out = self.gather(t, side)
        self._kept = [*self._kept[-7:], (t, side, out)]  # (a solve keeps a handful)
        return out

    def gather(self, t: torch.Tensor, side: int) -> torch.Tensor:
        """Every rank's (size_r, ...) slice of a side, concatenated in rank order.

        Slices are padded to the largest (gloo gathers equal sizes only).
        """
        top = max(s[side] for s in self.sizes)
        mine = t.detach().contiguous()
        if len(mine) < top:
            mine = torch.cat([mine, mine.new_zeros((top - len(mine), *mine.shape[1:]))])
        parts = [mine.new_empty(mine.shape) for _ in self.sizes]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat([p[: s[side]] for p, s in zip(parts, self.sizes, strict=True)])

    def total(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """The all-reduced value of a tensor (a copy)."""
        out = t.detach().clone()
        dist.all_reduce(out, op=op, group=self.group)
        return out

    def ring(self, parts: tuple[torch.Tensor, ...], side: int) -> Iterator[tuple]:
        """Every rank's version of ``parts`` (this rank's first), passed around the ring."""
        cur = tuple(p.detach().contiguous() for p in parts)
        owner = self.rank
        for step in range(self.world):
            yield cur
            if step == self.world - 1:
                return
            nxt_owner = (owner - 1) % self.world
            size = self.sizes[nxt_owner][side]
            nxt = tuple(p.new_empty((size, *p.shape[1:])) for p in cur)
            dst, src = (self.rank + 1) % self.world, (self.rank - 1) % self.world
            ops = []
            for send, recv in zip(cur, nxt, strict=True):
                ops += [dist.P2POp(dist.isend, send, self._global(dst), self.group),
                        dist.P2POp(dist.irecv, recv, self._global(src), self.group)]  # fmt: skip
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            cur, owner = nxt, nxt_owner

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def merge_lse(lse, avg, part, out, eps: float):
    """Log-sum-exp merge of two column blocks' ``(lse, softmax average)`` (n,), (n, p).

    A block without mass in a row (LSE −∞: a rank whose weights are all zero) adds
    nothing, whatever its average holds; a row without mass in either averages to 0.
    """
    if lse is None:
        return part, out
    top = torch.maximum(lse, part)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w_old, w_new = torch.exp((lse - top) / eps), torch.exp((part - top) / eps)
    total = w_old + w_new
    if out is not None and avg is not None:
        mixed = torch.where(w_old[:, None] > 0, avg * w_old[:, None], 0.0)
        mixed = mixed + torch.where(w_new[:, None] > 0, out * w_new[:, None], 0.0)
        avg = torch.where(total[:, None] > 0, mixed / total[:, None], 0.0)
    return top + eps * torch.log(total), avg


def _columns(part: tuple, has_v: bool, has_w: bool) -> tuple:
    """``(k, h, v or None, log w or None)`` from a ring step's tensors."""
    k, h, *rest = part
    return k, h, rest[0] if has_v else None, rest[-1] if has_w else None


class ShardedBackend(Backend):
    """The solver's primitives on a problem sharded by rows over a process group.

    Forms the loop passes are this rank's: q (n_r, d') and k (m_r, d') are its shards
    of the two clouds (``form.T`` swaps them); :meth:`row_attend` reduces over every
    rank's columns. A collective: every rank makes the same calls.

    Args:
        engine: the backend that streams each rank's passes.
        comm: the group (:class:`Comm`).
        x_feat: this rank's features of x (the q of the forms passed in), (n_r, d').
        y_feat: its features of y (their k), (m_r, d').
    """

    name = "sharded"

    def __init__(self, engine: Backend, comm: Comm, x_feat: torch.Tensor, y_feat: torch.Tensor):
        self.engine, self.comm = engine, comm
        self.precision = engine.precision
        self.precisions = engine.precisions
        self._features = ((x_feat, 0), (y_feat, 1))

    def _side(self, feat: torch.Tensor) -> int:
        for own, side in self._features:
            if feat is own:
                return side
        raise AssertionError("internal: a form of the sharded backend holds other features")

    def global_shape(self, form: AttentionForm) -> tuple[int, int]:
        """``(n, m)`` over all ranks."""
        return self.comm.total_size(self._side(form.q)), self.comm.total_size(self._side(form.k))

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks (an all-reduce)."""
        return self.comm.total(t)

    def operand_scope(self, carry: list | None = None):
        """The inner backend's."""
        return self.engine.operand_scope(carry)

    def row_attend(self, form, h, eps, v=None, log_w=None):
        """:meth:`Backend.row_attend` of this rank's rows over every rank's columns.

        ``h`` (m_r,), ``v`` (m_r, p) and ``log_w`` (m_r,) are this rank's columns.
        """
        side, comm = self._side(form.k), self.comm
        # every rank's columns (k, h, values, log w): gathered (the solve's constants once)
        # or passed around the ring
        if comm.mode == "gather":
            blocks = [(comm.gather_once(form.k, side), comm.gather(h, side),
                       None if v is None else comm.gather(v, side),
                       None if log_w is None else comm.gather_once(log_w, side))]  # fmt: skip
        else:
            sent = (form.k, h, *(t for t in (v, log_w) if t is not None))
            blocks = (_columns(part, v is not None, log_w is not None)
                      for part in comm.ring(sent, side))  # fmt: skip
        lse = avg = None
        for k, hh, vals, lw in blocks:
            whole = AttentionForm(form.q, k, form.alpha, torch.zeros_like(hh),
                                  cost_bound=form.cost_bound)  # fmt: skip
            part, out = self.engine.row_attend(whole, hh, eps, vals, lw)
            lse, avg = merge_lse(lse, avg, part, out, eps)
        return lse, avg
