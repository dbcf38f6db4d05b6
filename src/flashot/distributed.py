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

The iterations are flashot's one Sinkhorn loop (:func:`flashot.solver.loop.solve`) on
a :class:`~flashot.backends.sharded.ShardedBackend`, whose row passes reduce over the
ranks: unbalanced sides (``rho``), ε schedules, ``min_iter``, momentum and ``history``
work as in :func:`flashot.sinkhorn`, with the same warnings.

Failures do not hang: inputs and options are checked on each rank, then every rank
learns every rank's verdict (one collective) and raises the same error. Collectives
otherwise wait for at most the process group's timeout (``init_process_group(timeout=)``).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashot.autodiff.functions import relaxed_side, soft_c_transform
from flashot.backends import entry_point, resolve_backend
from flashot.backends.dual import Potentials, marginal_error, phi_sum, row_mass
from flashot.backends.sharded import Comm, ShardedBackend
from flashot.caller import warn_at_caller
from flashot.geometry.costs import (
    AttentionForm,
    Cost,
    _centered,
    box_cost_bound,
    column_box,
    column_sum,
    get_cost,
)
from flashot.problem import check_eps_range, check_positive, compute_dtype, parse_rho
from flashot.result import SolveHistory
from flashot.solver.loop import solve, temperatures
from flashot.solver.momentum import check_momentum
from flashot.solver.stopping import (
    ConvergenceWarning,
    _check_iterations,
    final_verdict,
    precision_floor,
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
        cause: why ``tol`` was missed (as :attr:`flashot.SinkhornResult.cause`), or None.
        history: the error at each check (``history=True``), or None.
    """

    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    n_iter: int
    converged: bool | None
    marginal_error: float
    plan: DistributedPlan
    mode: str = "gather"
    cause: str | None = None
    history: SolveHistory | None = None


class DistributedPlan:
    """The sharded plan: ``plan @ V_local`` gives this rank's rows of ``P V``.

    ``V_local`` (m_local, p) or (m_local,) are this rank's rows of V; every rank must
    call the product (it is a collective). ``plan.T @ U_local`` likewise.
    """

    def __init__(self, backend: ShardedBackend, form: AttentionForm, f, g, log_a, log_b,
                 eps: float):  # fmt: skip
        self._backend, self._form = backend, form
        self._f, self._g, self._log_a, self._log_b, self._eps = f, g, log_a, log_b, eps

    @property
    def T(self) -> DistributedPlan:
        """The transposed plan."""
        return DistributedPlan(self._backend, self._form.T, self._g, self._f, self._log_b,
                               self._log_a, self._eps)  # fmt: skip

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        m_local = self._form.k.shape[0]
        if not isinstance(v, torch.Tensor) or v.dim() not in (1, 2):
            raise ValueError("V_local must be a (m_local, p) or (m_local,) tensor")
        if v.shape[0] != m_local:
            raise ValueError(f"V_local must have {m_local} rows (this rank's columns), got "
                             f"{v.shape[0]}")  # fmt: skip
        vv = v.detach().to(self._f.dtype).reshape(v.shape[0], -1)
        form, eps = self._form, self._eps
        with torch.no_grad():
            lse, avg = self._backend.row_attend(form, self._g - form.beta, eps, vv, self._log_b)
            out = row_mass(self._f, lse, form.alpha, self._log_a, eps)[:, None] * avg
        return out.reshape((len(out), *v.shape[1:])).to(v.dtype)


def _key(value) -> str:
    """An option's value as compared across ranks (``repr``: NaN-safe, exact floats)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return repr(value)


def _option_error(x, eps, cost, rho, max_iter, tol, check_every, update, eps_schedule, backend,
                  precision, min_iter, momentum, history) -> str | None:  # fmt: skip
    """The first invalid option's message, found on this rank without raising."""
    checks = (
        lambda: check_positive(eps, "eps"),
        lambda: get_cost(cost),
        lambda: parse_rho(rho),
        lambda: _check_iterations(max_iter, 0, None, check_every, min_iter),
        lambda: (
            resolve_stopping(tol, "auto")
            if isinstance(tol, str)
            else _check_iterations(1, 0, tol, 1)
        ),
        lambda: _check_update(update),
        lambda: check_momentum(
            momentum,
            resolve_stopping(tol if tol != "auto" else 1.0, update, None, momentum)[1],
            tol,
        ),
        lambda: _check_flag(history, "history"),
        lambda: temperatures(eps_schedule, check_positive(eps, "eps"), lambda: 1.0),
        lambda: resolve_backend(backend, x.device, precision, compute_dtype(x.dtype)),
    )
    for check in checks:
        try:
            check()
        except (ValueError, TypeError, RuntimeError, ImportError) as err:
            return str(err)
    return None


def _check_flag(flag, name: str) -> None:
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be True or False, got {flag!r}")


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


def _sides(comm: Comm, cost: Cost, x, y, a, b, dtype, rounding, normalize: bool):
    """Both local sides in attention form around the global center.

    Returns ``(q, α, a), (k, β, b), diameter, bound``: the weights (uniform 1/n over all
    ranks when None; normalized by their global sums when ``normalize``), the global
    bounding-box diagonal (for ε schedules) and the cost's bound (the near-uniform rule).
    """
    u, v = cost.embed(x.to(dtype)), cost.embed(y.to(dtype))
    with torch.no_grad():
        sums = comm.total(torch.cat([column_sum(u.detach()), column_sum(v.detach())]))
        count = sum(n + m for n, m in comm.sizes)
        d = u.shape[1]
        center = (sums[:d] + sums[d:]) / count
        boxes = []
        for t in (u, v, x, y):
            box = column_box(t.detach())
            boxes.append(torch.stack([comm.total(box[0], dist.ReduceOp.MIN),
                                      comm.total(box[1], dist.ReduceOp.MAX)]))  # fmt: skip
        lo, hi = torch.minimum(boxes[0][0], boxes[1][0]), torch.maximum(boxes[0][1], boxes[1][1])
        diameter = float(torch.linalg.vector_norm((hi - lo).double()))
        bound = float(box_cost_bound(cost, boxes[2], boxes[3]))
    q, alpha = _centered(u, center, rounding, 2.0 * cost.scale, cost.scale)
    k, beta = _centered(v, center, rounding, 1.0, cost.scale)
    weights = []
    for w, t, side in ((a, x, 0), (b, y, 1)):
        total = comm.total_size(side)
        if w is None:
            weights.append(torch.full((t.shape[0],), 1.0 / total, dtype=dtype, device=t.device))
            continue
        w = w.to(dtype)
        mass = comm.total(w.sum())  # (the same on every rank: all raise or none)
        if not bool(mass > 0):
            raise ValueError(f"{('a_local', 'b_local')[side]}: the weights sum to zero over "
                             "all ranks; give at least one point a positive weight")  # fmt: skip
        weights.append(w / mass if normalize else w)
    return (q, alpha, weights[0]), (k, beta, weights[1]), diameter, bound


@entry_point
def sinkhorn(
    x_local, y_local, a_local=None, b_local=None, *, eps: float, group=None,
    cost: str = "sqeuclidean", rho=None, max_iter: int = 1000, tol: float | str | None = "auto",
    check_every: int = 10, update: str = "auto", eps_schedule=None, backend="auto",
    precision: str = "auto", mode: str = "auto", min_iter: int = 0,
    momentum: float | str | None = None, history: bool = False, warn: bool = True,
) -> DistributedSinkhornResult:  # fmt: skip
    """Entropic OT between clouds sharded by rows over a process group.

    Call it on every rank of ``group`` (default: the world) with that rank's slices;
    see the module for the communication. Options are those of :func:`flashot.sinkhorn`
    and must be equal on every rank (checked); the solve is its loop, on every rank.

    Args:
        x_local: (n_r, d) this rank's source points.  y_local: (m_r, d) its target points.
        a_local: (n_r,) its source weights or None (uniform over all n points).
        b_local: (m_r,) its target weights or None.
        eps: ε > 0.  group: a process group, None for the default one.
        cost, rho, max_iter, tol: as in :func:`flashot.sinkhorn` (``tol`` is checked on
            the global error; balanced weights are normalized by their sum over all
            ranks, relaxed ones kept).
        check_every, update, eps_schedule, backend, precision: as in :func:`flashot.sinkhorn`.
        min_iter, momentum, history: as in :func:`flashot.sinkhorn`.
        mode: ``"gather"`` (all-gather both clouds' features once per solve),
            ``"ring"`` (pass the shards around at every row pass), ``"auto"`` (gather
            when the gathered clouds take at most :data:`GATHER_SHARE` of every rank's
            free memory, else ring; decided collectively).
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
        error = _option_error(x_local, eps, cost, rho, max_iter, tol, check_every, update,
                              eps_schedule, backend, precision, min_iter, momentum,
                              history)  # fmt: skip
    named = dict(eps=eps, cost=cost, rho=rho, max_iter=max_iter, tol=tol,
                 check_every=check_every, update=update, eps_schedule=eps_schedule,
                 backend=backend, precision=precision, mode=mode, min_iter=min_iter,
                 momentum=momentum, history=history)  # fmt: skip
    _agree(group, error, shared, tuple((k, _key(v)) for k, v in named.items()))
    # (below, every rank raises or none does: the options are equal and valid)
    cost_obj, eps, rhos = get_cost(cost), check_positive(eps, "eps"), parse_rho(rho)
    sizes_t = torch.tensor([x_local.shape[0], y_local.shape[0]], device=x_local.device)
    gathered = [torch.empty_like(sizes_t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, sizes_t, group=group)
    sizes = [(int(t[0]), int(t[1])) for t in gathered]
    comm = Comm(group, _auto_mode(group, sizes, x_local) if mode == "auto" else mode, sizes)
    dtype = compute_dtype(x_local.dtype)
    engine = resolve_backend(backend, x_local.device, precision, dtype)
    balanced = rhos == (None, None)
    (q, alpha, a), (k, beta, b), diameter, bound = _sides(
        comm, cost_obj, x_local, y_local, a_local, b_local, dtype, engine.rounding, balanced
    )
    check_eps_range(eps, bound, dtype, "eps")
    log_a, log_b = torch.log(a), torch.log(b)
    form = AttentionForm(q.detach(), k.detach(), alpha.detach(), beta.detach(), cost_bound=bound)
    sharded = ShardedBackend(engine, comm, form.q, form.k)
    temps = temperatures(eps_schedule, eps, lambda: diameter)
    tol, update = resolve_stopping(tol, update, None, momentum)

    def damping(e: float) -> tuple[float, float]:
        return tuple(1.0 if r is None else r / (r + e) for r in rhos)  # type: ignore[return-value]

    out = solve(form, log_a, log_b, temps, damping, rhos, sharded, max_iter=max_iter, tol=tol,
                check_every=check_every, update=update, record=history, min_iter=min_iter,
                momentum=momentum)  # fmt: skip
    # the differentiated final step: local rows (columns) with the other potential fixed
    lam_x, lam_y = damping(eps)
    f_new = _final(comm, engine, (q, alpha), (form.k, form.beta, log_b, 1), out.g, eps, lam_x)
    f_fixed = f_new.detach() if update == "alternating" else out.f
    g_new = _final(comm, engine, (k, beta), (form.q, form.alpha, log_a, 0), f_fixed, eps, lam_y)
    fd, gd = f_new.detach(), g_new.detach()
    with torch.no_grad():  # the global error, plan mass and value at the final potentials
        lse_r, _ = sharded.row_attend(form, gd - form.beta, eps, log_w=log_b)
        lse_c, _ = sharded.row_attend(form.T, fd - form.alpha, eps, log_w=log_a)
        r, c = (
            row_mass(fd, lse_r, form.alpha, log_a, eps),
            row_mass(gd, lse_c, form.beta, log_b, eps),
        )
        err = marginal_error(fd, r, log_a, rhos[0]) + marginal_error(gd, c, log_b, rhos[1])
        # (the shards' float64 sum, finite exactly when every potential is: one verdict
        # for every rank, in the read the reduction makes anyway)
        spread = fd.sum(dtype=torch.float64) + gd.sum(dtype=torch.float64)
        local = torch.stack([(phi_sum(fd, a, rhos[0]) + phi_sum(gd, b, rhos[1])).double(),
                             err.double(), r.sum().double(), a.sum().double(),
                             b.sum().double(), spread])  # fmt: skip
        value_t, err_t, mass_p, m_a, m_b, spread_t = sharded.reduce(local).tolist()
    if balanced:  # ⟨a, f⟩ + ⟨b, g⟩, envelope gradients through the final step
        grads = (a * f_new).sum() + (b * g_new).sum()
    else:  # the dual objective (as flashot.sinkhorn), with ε (m(P) − m(a) m(b))
        grads = relaxed_side(f_new, a, eps, rhos[0]) + relaxed_side(g_new, b, eps, rhos[1])
        value_t -= eps * (mass_p - m_a * m_b)
    value = grads + (torch.tensor(value_t, dtype=grads.dtype, device=grads.device) - grads.detach())
    if not (math.isfinite(err_t) and math.isfinite(spread_t)):
        raise FloatingPointError("Sinkhorn produced non-finite potentials; try a larger eps or "
                                 "an eps_schedule")  # fmt: skip
    floor_now = functools.cache(
        lambda: precision_floor(Potentials(form, fd, gd, log_a, log_b, eps), backend=sharded)
    )
    converged, cause, why = final_verdict(tol, err_t if tol is not None else None, out,
                                          floor_now, dtype, update,
                                          None if bound is None else bound / eps)  # fmt: skip
    if why is not None and warn:  # (every rank: each is a caller)
        warn_at_caller("flashot.distributed.sinkhorn: " + why, ConvergenceWarning)
    record = None
    if history:
        checks = out.checks or ()
        record = SolveHistory([c[0] for c in checks], [c[1] for c in checks],
                              [c[2] for c in checks], [float(t) for t in temps])  # fmt: skip
    plan = DistributedPlan(sharded, form, fd, gd, log_a, log_b, eps)
    return DistributedSinkhornResult(f_new, g_new, value, out.n_iter, converged, err_t, plan,
                                     comm.mode, cause, record)  # fmt: skip


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


def _final(comm: Comm, engine, own, other, pot_other, eps: float, lam: float) -> torch.Tensor:
    """``λ T(pot_other)``: the differentiable soft c-transform of this rank's side.

    ``own = (features, offsets)`` with their autograd history; ``other = (features,
    offsets, log weights, side)`` this rank's shard of the other side (detached). The
    other side is gathered in both modes: the backward needs the whole softmax average,
    which one pass gives.
    """
    feat, offset, log_w, side = other
    h = comm.gather(pot_other - offset, side)
    form = AttentionForm(own[0], comm.gather_once(feat, side), own[1], torch.zeros_like(h))
    return soft_c_transform(form, h, comm.gather_once(log_w, side), eps, lam, engine)
