r"""One large problem sharded over the ranks of a torch.distributed process group.

Every rank holds a slice of the rows of x (``x_local``, with weights ``a_local``) and a
slice of y, and calls :func:`sinkhorn` with the same options. A Sinkhorn update of
the rank's potentials is a soft c-transform over *all* columns,

.. math::

    f_i = -\varepsilon \log \sum_{r} \sum_{j \in \text{rank } r}
        b_j \exp\big((g_j - C_{ij})/\varepsilon\big),

streamed by the backend over each rank's column shard and merged with a log-sum-exp.
Communication per iteration is the potentials, O(n + m): the other cloud's features
are all-gathered once when they fit (``mode="gather"``), or passed around the ring of
ranks every half-step (``mode="ring"``, memory O((n + m)/W · d) per rank, traffic
O((n + m) d) per iteration). Works with NCCL (GPUs) and gloo (CPUs) under ``torchrun``.

Failures do not hang: inputs and options are checked on each rank, then every rank
learns every rank's verdict (one collective) and raises the same error. Collectives
otherwise wait for at most the process group's timeout (``init_process_group(timeout=)``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashot.autodiff.functions import soft_c_transform
from flashot.backends import entry_point, resolve_backend
from flashot.backends.base import Backend
from flashot.backends.dual import row_mass
from flashot.caller import warn_at_caller
from flashot.geometry.costs import (
    AttentionForm,
    Cost,
    _centered,
    column_box,
    column_sum,
    get_cost,
    joint_box,
)
from flashot.problem import check_positive, compute_dtype
from flashot.solver.loop import temperatures
from flashot.solver.stopping import (
    CheckSchedule,
    ConvergenceWarning,
    FloorTolerance,
    _check_iterations,
    describe_miss,
    resolve_stopping,
)

__all__ = ["GATHER_SHARE", "DistributedPlan", "DistributedSinkhornResult", "free_bytes", "sinkhorn"]

MODES = ("auto", "gather", "ring")
UPDATES = ("auto", "alternating", "symmetric")
#: ``mode="auto"`` gathers when the gathered clouds take at most this share of free memory
GATHER_SHARE = 0.5


def free_bytes(device: torch.device) -> int:
    """Memory a rank can still allocate on ``device``.

    CUDA: the driver's free memory; CPU: the available physical memory.
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # (no sysconf: assume it fits)
        return 1 << 62


def _auto_mode(group, sizes, x_local: torch.Tensor) -> str:
    """``"gather"`` when every rank has room for both gathered clouds, else ``"ring"``."""
    n, m = (sum(s[i] for s in sizes) for i in (0, 1))
    need = (n + m) * (x_local.shape[1] + 1) * 4  # float32 features and offsets, both sides
    fits = torch.tensor([need <= GATHER_SHARE * free_bytes(x_local.device)],
                        dtype=torch.int32, device=x_local.device)  # fmt: skip
    dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)  # every rank the same mode
    return "gather" if bool(fits.item()) else "ring"


@dataclass(frozen=True)
class _Side:
    """One rank's share of a cloud in attention form: features, offsets, log weights."""

    feat: torch.Tensor
    offset: torch.Tensor
    log_w: torch.Tensor
    index: int  # 0: a share of the rows (x), 1: of the columns (y)


@dataclass(frozen=True)
class DistributedSinkhornResult:
    """What :func:`sinkhorn` returns on each rank.

    Attributes:
        f: (n_local,) this rank's slice of the potential on x.
        g: (m_local,) its slice of the potential on y.
        cost: the global OT value (0-dim), equal on every rank; its gradient w.r.t.
            ``x_local``/``y_local`` is the global value's (envelope theorem), with no
            collective in the backward pass.
        n_iter: iterations run.  converged: error within ``tol`` (None without tol).
        marginal_error: the global L1 marginal error, equal on every rank.
        plan: the sharded lazy plan (:class:`DistributedPlan`).
        mode: ``"gather"`` or ``"ring"``, the mode that ran.
    """

    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    n_iter: int
    converged: bool | None
    marginal_error: float
    plan: DistributedPlan
    mode: str = "gather"


class DistributedPlan:
    """The sharded plan: ``plan @ V_local`` gives this rank's rows of ``P V``.

    ``V_local`` (m_local, p) or (m_local,) are this rank's rows of V; every rank must
    call the product (it is a collective). ``plan.T @ U_local`` likewise.
    """

    def __init__(self, comm: _Comm, rows: _Side, cols: _Side, f, g, eps: float, engine):
        self._comm, self._rows, self._cols = comm, rows, cols
        self._f, self._g, self._eps, self._engine = f, g, eps, engine

    @property
    def T(self) -> DistributedPlan:
        """The transposed plan."""
        return DistributedPlan(self._comm, self._cols, self._rows, self._g, self._f, self._eps,
                               self._engine)  # fmt: skip

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        if not isinstance(v, torch.Tensor) or v.dim() not in (1, 2):
            raise ValueError("V_local must be a (m_local, p) or (m_local,) tensor")
        if v.shape[0] != self._cols.feat.shape[0]:
            raise ValueError(f"V_local must have {self._cols.feat.shape[0]} rows (this rank's "
                             f"columns), got {v.shape[0]}")  # fmt: skip
        vv = v.detach().to(self._f.dtype).reshape(v.shape[0], -1)
        with torch.no_grad():
            lse, avg = _transform(self._comm, self._engine, self._rows, self._cols, self._g,
                                  self._eps, vv)  # fmt: skip
            r = row_mass(self._f, lse, self._rows.offset, self._rows.log_w, self._eps)
            out = r[:, None] * avg
        return out.reshape((*v.shape[0:0], len(out), *v.shape[1:])).to(v.dtype)


class _Comm:
    """The group's collectives, with shard sizes known on every rank."""

    def __init__(self, group, mode: str, sizes: list[tuple[int, int]]):
        self.group, self.mode = group, mode
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sizes = sizes  # [(n_r, m_r)] for every rank
        self._kept: list = []  # (tensor, side, gathered): the solve's constant gathers

    def gather_once(self, t: torch.Tensor, side: int) -> torch.Tensor:
        """:meth:`gather` of a tensor fixed through the solve (features, log weights).

        Gathered on first use, then kept: gather mode's copy of the other cloud.
        """
        for src, s, out in self._kept:
            if src is t and s == side:
                return out
        out = self.gather(t, side)
        self._kept.append((t, side, out))
        return out

    def gather(self, t: torch.Tensor, side: int) -> torch.Tensor:
        """Concatenate every rank's (size_r, ...) slice of a side (0: rows, 1: columns).

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

    def ring(self, parts: tuple[torch.Tensor, ...], side: int):
        """Yield every rank's version of ``parts`` (this rank's first), passed around the ring."""
        cur = tuple(p.contiguous() for p in parts)
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


def _transform(comm: _Comm, engine: Backend, rows: _Side, cols: _Side, pot_cols, eps: float,
               v: torch.Tensor | None = None):  # fmt: skip
    """Row LSE ``ε log Σ_j w_j e^{(⟨q_i, k_j⟩ + g_j − β_j)/ε}`` over all ranks' columns.

    Also the softmax average of ``v`` (this rank's (m_local, p) values) when given.
    """
    h_local = pot_cols - cols.offset
    if comm.mode == "gather":
        feat = comm.gather_once(cols.feat, cols.index)
        log_w = comm.gather_once(cols.log_w, cols.index)
        h_all = comm.gather(h_local, cols.index)  # per call: O(n + m) per iteration
        shards = [(feat, h_all, log_w, *(() if v is None else (comm.gather(v, cols.index),)))]
    else:
        shards = comm.ring((cols.feat, h_local, cols.log_w, *(() if v is None else (v,))),
                           cols.index)  # fmt: skip
    lse = avg = None
    for feat, h, log_w, *vals in shards:
        form = AttentionForm(rows.feat, feat, rows.offset, torch.zeros_like(h))
        part, out = engine.row_attend(form, h, eps, vals[0] if vals else None, log_w)
        if lse is None:
            lse, avg = part, out
            continue
        top = torch.maximum(lse, part)
        w_old, w_new = torch.exp((lse - top) / eps), torch.exp((part - top) / eps)
        if out is not None and avg is not None:
            avg = (avg * w_old[:, None] + out * w_new[:, None]) / (w_old + w_new)[:, None]
        lse = top + eps * torch.log(w_old + w_new)
    return lse, avg


def _key(value) -> str:
    """An option's value as compared across ranks (``repr``: NaN-safe, exact floats)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return repr(value)


def _option_error(x, eps, cost, max_iter, tol, check_every, update, eps_schedule, backend,
                  precision) -> str | None:  # fmt: skip
    """The first invalid option's message, found on this rank without raising."""
    checks = (
        lambda: check_positive(eps, "eps"),
        lambda: get_cost(cost),
        lambda: _check_iterations(max_iter, 0, None, check_every),
        lambda: (
            resolve_stopping(tol, "auto")
            if isinstance(tol, str)
            else _check_iterations(1, 0, tol, 1)
        ),
        lambda: _check_update(update),
        lambda: temperatures(eps_schedule, check_positive(eps, "eps"), lambda: 1.0),
        lambda: resolve_backend(backend, x.device, precision, compute_dtype(x.dtype)),
    )
    for check in checks:
        try:
            check()
        except (ValueError, TypeError, RuntimeError, ImportError) as err:
            return str(err)
    return None


def _check_update(update) -> None:
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")


def _local_checks(x, y, a, b, mode) -> tuple[str | None, tuple]:
    """This rank's error (None if fine) and what must agree across ranks."""
    for t, name in ((x, "x_local"), (y, "y_local")):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point:
            return f"{name} must be a floating (n, d) tensor", ()
        if t.shape[0] == 0:
            return f"{name} must hold at least one point on every rank", ()
        if not bool(torch.isfinite(column_box(t.detach())).all()):  # no (n, d) temporary
            return f"{name} contains NaN or infinite values", ()
    if x.dtype != y.dtype or x.device != y.device:
        return "x_local and y_local must share dtype and device", ()
    if x.shape[1] != y.shape[1]:
        return f"x_local and y_local must have the same d, got {x.shape[1]} and {y.shape[1]}", ()
    for w, t, name in ((a, x, "a_local"), (b, y, "b_local")):
        if w is None:
            continue
        if not isinstance(w, torch.Tensor) or w.shape != (t.shape[0],):
            return f"{name} must be a ({t.shape[0]},) tensor", ()
        if w.requires_grad:
            return f"{name}: gradients w.r.t. the weights are not supported in sharded solves", ()
        if not bool(torch.isfinite(w).all() & (w >= 0).all()):
            return f"{name} must be finite and nonnegative", ()
    if mode not in MODES:
        return f"mode must be one of {MODES}, got {mode!r}", ()
    return None, (x.shape[1], str(x.dtype), x.device.type, a is None, b is None)


def _sides(comm: _Comm, cost: Cost, x, y, a, b, dtype, rounding):
    """Both local sides in attention form around the global center.

    Also the weights normalized by their global sums and the global bounding-box diagonal.
    """
    u, v = cost.embed(x.to(dtype)), cost.embed(y.to(dtype))
    with torch.no_grad():
        sums = comm.total(torch.cat([column_sum(u.detach()), column_sum(v.detach())]))
        count = sum(n + m for n, m in comm.sizes)
        d = u.shape[1]
        center = (sums[:d] + sums[d:]) / count
        box = joint_box(u.detach(), v.detach())
        lo = comm.total(box[0], dist.ReduceOp.MIN)
        hi = comm.total(box[1], dist.ReduceOp.MAX)
        diameter = float(torch.linalg.vector_norm((hi - lo).double()))
    q, alpha = _centered(u, center, rounding, 2.0 * cost.scale, cost.scale)
    k, beta = _centered(v, center, rounding, 1.0, cost.scale)
    logs = []
    for w, t, side in ((a, x, 0), (b, y, 1)):
        total = sum(s[side] for s in comm.sizes)
        if w is None:
            logs.append(torch.full((t.shape[0],), -math.log(total), dtype=dtype, device=t.device))
        else:
            w = w.to(dtype)
            mass = comm.total(w.sum())  # (the same on every rank: all raise or none)
            if not bool(mass > 0):
                raise ValueError(
                    f"{('a_local', 'b_local')[side]}: the weights sum to zero "
                    "over all ranks; give at least one point a positive weight"
                )
            logs.append(torch.log(w / mass))
    return (q, alpha, logs[0]), (k, beta, logs[1]), diameter


@entry_point
def sinkhorn(
    x_local, y_local, a_local=None, b_local=None, *, eps: float, group=None,
    cost: str = "sqeuclidean", max_iter: int = 1000, tol: float | str | None = "auto",
    check_every: int = 10, update: str = "auto", eps_schedule=None, backend="auto",
    precision: str = "auto", mode: str = "auto", warn: bool = True,
) -> DistributedSinkhornResult:  # fmt: skip
    """Balanced entropic OT between clouds sharded by rows over a process group.

    Call it on every rank of ``group`` (default: the world) with that rank's slices;
    see the module for the communication. Options are those of :func:`flashot.sinkhorn`
    and must be equal on every rank (checked).

    Args:
        x_local: (n_r, d) this rank's source points.  y_local: (m_r, d) its target points.
        a_local: (n_r,) its source weights or None (uniform over all n points).
        b_local: (m_r,) its target weights or None.
        eps: ε > 0.  group: a process group, None for the default one.
        cost, max_iter, tol, check_every, update, eps_schedule, backend, precision: as in
            :func:`flashot.sinkhorn` (``tol`` is checked on the global error).
        mode: ``"gather"`` (all-gather both clouds' features once per solve),
            ``"ring"`` (pass the shards around every half-step), ``"auto"`` (gather when
            the gathered clouds take at most :data:`GATHER_SHARE` of every rank's free
            memory, else ring; decided collectively).
        warn: emit :class:`flashot.ConvergenceWarning` (on every rank) when the global
            error missed ``tol``.

    Raises:
        ValueError: on every rank alike, when any rank's inputs or options are invalid
            (the message names the rank and the argument), when the ranks disagree on the
            options or on d, dtype and device, or when all weights are zero.

    Returns:
        A :class:`DistributedSinkhornResult` (local potentials, global cost).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashot.distributed.sinkhorn needs an initialized process "
                           "group (torch.distributed.init_process_group, e.g. under "
                           "torchrun)")  # fmt: skip
    error, shared = _local_checks(x_local, y_local, a_local, b_local, mode)
    if error is None:
        error = _option_error(x_local, eps, cost, max_iter, tol, check_every, update,
                              eps_schedule, backend, precision)  # fmt: skip
    opts = (("eps", _key(eps)), ("cost", _key(cost)), ("max_iter", _key(max_iter)),
            ("tol", _key(tol)), ("check_every", _key(check_every)), ("update", _key(update)),
            ("eps_schedule", _key(eps_schedule)), ("backend", _key(backend)),
            ("precision", _key(precision)), ("mode", _key(mode)))  # fmt: skip
    _agree(group, error, shared, opts)  # (below, every rank raises or none does)
    cost_obj = get_cost(cost)
    eps = check_positive(eps, "eps")
    sizes_t = torch.tensor([x_local.shape[0], y_local.shape[0]], device=x_local.device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(sizes_t) for _ in range(world)]
    dist.all_gather(gathered, sizes_t, group=group)
    sizes = [(int(t[0]), int(t[1])) for t in gathered]
    if mode == "auto":
        mode = _auto_mode(group, sizes, x_local)
    comm = _Comm(group, mode, sizes)
    dtype = compute_dtype(x_local.dtype)
    engine = resolve_backend(backend, x_local.device, precision, dtype)
    (q, alpha, log_a), (k, beta, log_b), diameter = _sides(
        comm, cost_obj, x_local, y_local, a_local, b_local, dtype, engine.rounding
    )
    rows = _Side(q.detach(), alpha.detach(), log_a, 0)
    cols = _Side(k.detach(), beta.detach(), log_b, 1)
    temps = temperatures(eps_schedule, eps, lambda: diameter)
    tol, update = resolve_stopping(tol, update, None, None)
    if max_iter < len(temps):  # (the diameter is global: every rank raises)
        raise ValueError(f"max_iter={max_iter} is shorter than the eps schedule ({len(temps)})")
    f, g, n_iter, _ = _iterate(comm, engine, rows, cols, temps, max_iter, tol,
                                     check_every, update)  # fmt: skip
    # the differentiated final step: local rows (columns) with the other potential fixed
    g_all_h = g.detach()
    f_new = _final(comm, engine, _Side(q, alpha, log_a, 0), cols, g_all_h, eps)
    f_fixed = f_new.detach() if update == "alternating" else f.detach()
    g_new = _final(comm, engine, _Side(k, beta, log_b, 1), rows, f_fixed, eps)
    fd, gd = f_new.detach(), g_new.detach()
    with torch.no_grad():
        lse_r, _ = _transform(comm, engine, rows, cols, gd, eps)
        lse_c, _ = _transform(comm, engine, cols, rows, fd, eps)
        local_err, local_floor = _local_check(rows, cols, fd, gd, lse_r, lse_c, eps)
    local = (log_a.exp() * f_new).sum() + (log_b.exp() * g_new).sum()
    totals = comm.total(torch.stack([local.detach(), local_err, local_floor]).double())
    value = local + (totals[0].to(local.dtype) - local.detach())
    err = float(totals[1])
    if not math.isfinite(err):
        raise FloatingPointError("Sinkhorn produced non-finite potentials; try a larger eps or "
                                 "an eps_schedule")  # fmt: skip
    converged = None if tol is None else _met(tol, err, _floor(comm, fd, totals[2]))
    if converged is False and warn and tol is not None:  # (every rank: each is a caller)
        warn_at_caller("flashot.distributed.sinkhorn: "
                       + describe_miss("max_iter", tol, err, None, n_iter, dtype, update),
                       ConvergenceWarning)  # fmt: skip
    plan = DistributedPlan(comm, rows, cols, fd, gd, eps, engine)
    return DistributedSinkhornResult(f_new, g_new, value, n_iter, converged, err, plan,
                                     comm.mode)  # fmt: skip


def _agree(group, error: str | None, shared: tuple, opts: tuple) -> None:
    """Every rank learns every rank's verdict and raises the same error (no hang)."""
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, (error, shared, tuple(v for _, v in opts)), group=group)
    for r, (err, _, _) in enumerate(got):
        if err is not None:
            raise ValueError(f"flashot.distributed.sinkhorn on rank {r}: {err}")
    for r, (_, sh, opt) in enumerate(got):
        if sh != got[0][1]:
            raise ValueError(f"ranks disagree on the data: rank 0 has (d, dtype, device, "
                             f"uniform a, uniform b) = {got[0][1]}, rank {r} has {sh}")  # fmt: skip
        if opt != got[0][2]:
            diff = [i for i, (u, w) in enumerate(zip(got[0][2], opt, strict=True)) if u != w]
            raise ValueError(f"ranks disagree on the options {[opts[i][0] for i in diff]}: "
                             f"rank 0 has {[got[0][2][i] for i in diff]}, rank {r} has "
                             f"{[opt[i] for i in diff]}")  # fmt: skip


def _final(comm, engine, side: _Side, other: _Side, pot_other, eps: float) -> torch.Tensor:
    """The differentiable soft c-transform of this rank's ``side`` over all of ``other``.

    It gathers the other side in both modes: the backward needs the whole softmax
    average, which one pass gives.
    """
    h = comm.gather(pot_other - other.offset, other.index)
    feat = comm.gather_once(other.feat, other.index)
    log_w = comm.gather_once(other.log_w, other.index)
    form = AttentionForm(side.feat, feat, side.offset, torch.zeros_like(h))
    return soft_c_transform(form, h, log_w, eps, 1.0, engine)


def _local_check(rows: _Side, cols: _Side, f, g, lse_r, lse_c, eps: float):
    """This rank's shares of the L1 marginal error at (f, g) and of the precision floor.

    The floor's share is its sum term (:func:`flashot.solver.stopping.precision_floor`, without
    the log terms).
    """
    r = row_mass(f, lse_r, rows.offset, rows.log_w, eps)
    c = row_mass(g, lse_c, cols.offset, cols.log_w, eps)
    a, b = rows.log_w.exp(), cols.log_w.exp()
    err = (r - a).abs().sum() + (c - b).abs().sum()
    size = (a * (f.abs() + rows.offset.abs())).sum() + (b * (g.abs() + cols.offset.abs())).sum()
    return err, size * (2.0 / eps)


def _floor(comm: _Comm, f: torch.Tensor, size_total) -> float:
    """The global precision floor from the all-reduced size term."""
    n, m = (sum(s[i] for s in comm.sizes) for i in (0, 1))
    return torch.finfo(f.dtype).eps * (float(size_total) + math.log(max(m, 2))
                                       + math.log(max(n, 2)))  # fmt: skip


def _met(tol, error: float, floor: float) -> bool:
    """``tol`` reached: strictly, or for ``tol="auto"`` at the dtype's floor near it."""
    if error <= tol:
        return True
    return isinstance(tol, FloorTolerance) and tol.reached(error, lambda: floor)


def _iterate(comm, engine, rows: _Side, cols: _Side, temps, max_iter, tol, check_every, update):
    """Sinkhorn iterations on the shards.

    GeomLoss' start at the first temperature, then symmetric (averaged Jacobi) or
    alternating updates; the global error every ``check_every`` iterations at the final ε.
    """
    last = len(temps) - 1
    zero_f, zero_g = torch.zeros_like(rows.offset), torch.zeros_like(cols.offset)
    f = -_transform(comm, engine, rows, cols, zero_g, temps[0])[0] + rows.offset
    g = -_transform(comm, engine, cols, rows, zero_f, temps[0])[0] + cols.offset
    error, it = math.inf, 0
    for it in range(1, max_iter + 1):
        eps = temps[min(it - 1, last)]
        check = tol is not None and CheckSchedule(len(temps), check_every).on_grid(it)
        check = check and (update == "symmetric" or it > 1)  # (exact columns from step 2)
        lse_r, _ = _transform(comm, engine, rows, cols, g, eps)
        f_new = rows.offset - lse_r
        f_old, g_old = f, g
        if update == "alternating":
            f = f_new
        lse_c, _ = _transform(comm, engine, cols, rows, f, eps)
        if check:  # at (f_old, g_old); alternating: its columns are exact, lse_c is unused
            # (alternating: exact columns, T(f_old) = g_old)
            lse_c_old = cols.offset - g_old if update == "alternating" else lse_c
            local = torch.stack(_local_check(rows, cols, f_old, g_old, lse_r, lse_c_old, eps))
        g_new = cols.offset - lse_c
        if update == "alternating":
            g = g_new
        else:
            f, g = 0.5 * (f + f_new), 0.5 * (g + g_new)
        if check:
            totals = comm.total(local.double())
            error = float(totals[0])
            if not math.isfinite(error):
                raise FloatingPointError(f"Sinkhorn diverged at iteration {it}; try a larger "
                                         "eps or an eps_schedule")  # fmt: skip
            if _met(tol, error, _floor(comm, f, totals[1])):
                break
    return f, g, it, error
