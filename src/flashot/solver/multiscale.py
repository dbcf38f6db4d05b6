r"""Block-sparse multiscale solves for low-dimensional clouds (GeomLoss' ``cluster_scale``).

For shapes in 2-D or 3-D at a small blur, most pairs of far-apart points carry no
mass: :math:`P_{ij} = a_i b_j \exp((f_i + g_j - C_{ij})/\varepsilon)` is below any
float's resolution. This loop (after Schmitzer 2016 and Feydy 2020) skips them:

1. **Clusters.** Each cloud is cut by one grid of cells of side ``scale``; a cluster
   keeps its weighted centroid, its weight and its radius (the farthest member).
2. **Coarse phase.** While ε > scale^p, GeomLoss' symmetric ε-scaling steps run on the
   centroids, a problem of K ≪ n points.
3. **Jump.** At the last coarse ε the potentials move from the centroids to the points
   as the same iterate, not one more step: a point i of cluster I takes

   .. math::

       f_i = T_\varepsilon(g)(x_i) + \big(f_I - T_\varepsilon(g)(c_I)\big),

   the soft-minimum ``T`` over the centroids evaluated at the point, plus what the
   averaged steps left between the cluster's potential and that soft-minimum at its
   centroid. With one point a cluster this is the coarse iterate itself, so the fine
   phase continues the dense call's trajectory; a plain extrapolation (GeomLoss') adds
   an unaveraged half-step, which moved the returned gradient by 2.4e-2 at 5 000
   points. ``T`` at a point runs over the centroids J whose terms may reach
   ``e^{−τ} W_J`` of its sum (:func:`jump_pairs`; the centroids of a shape's far side
   are most of them).
4. **Fine phase.** Every soft-minimum runs over the cluster pairs (I, J) that the
   truncation keeps,

   .. math::

       \max_{i \in I} f_i + \max_{j \in J} g_j - C_{\min}(I, J) \ge -\tau \varepsilon,
       \qquad \tau = \text{truncate}^2 / 2,

   with :math:`C_{\min}` the cost at the clusters' smallest possible distance
   :math:`\max(0, |c_I - c_J| - r_I - r_J)`, and the potentials of the step before.
   A dropped pair's plan entry is at most :math:`e^{-\tau} a_i b_j`, so every dropped
   row or column mass is at most :math:`e^{-\tau}` of its marginal (3.7e-6 at GeomLoss'
   ``truncate=5``), to the extent the potentials moved little since the last step.
5. The final extrapolation, differentiated as :mod:`flashot.solver.tiled_loop`'s.

Both clouds are sorted by cluster (:mod:`flashot.solver.clusters`: cells along a Z-order curve), and
each block of sorted rows reduces over the column intervals its clusters keep, on the
GPU runs at most :data:`~flashot.backends.kernel_sums.SPARSE_GAP` columns apart merged
(:func:`flashot.backends.kernel_sums.block_sparse_softmin`: one launch of the fused
pair-cost kernel on CUDA float32, PyTorch blocks otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from flashot.backends.kernel_sums import (
    block_intervals,
    block_sparse_softmin,
    window_step,
    window_transforms,
)
from flashot.solver.clusters import Clusters, centroid_clusters, grid_clusters
from flashot.solver.tiled_loop import GeomLossPotentials, damping, dense_softmin, symmetric_steps

__all__ = ["TooManyPairsError", "all_pairs", "jump_pairs", "multiscale_potentials",
           "truncation_mask"]  # fmt: skip

#: whether the fine steps and the final extrapolation take block-sparse window passes
#: (:meth:`_SparseSoftMin.both`): H100, v58, 1M spheres, value and gradient, three rounds
#: off / on: 383.5 / 308.1, 371.0 / 296.4, 365.1 / 303.8 ms; 100k a tie (HISTORY.md)
WINDOW = True


#: entries of one chunk of the cluster-pair bound (rows × all columns)
CHUNK = 1 << 22
#: the most cluster pairs a mask may keep: ~1 GB of int64 keys and their sort. Past it
#: the clusters are too small or too close to prune (v55, H100: a Gaussian in 8-D at
#: cluster_scale 0.2 asked 7.4 GB for one mask, 67 GB in use, and ran out of memory)
MAX_PAIRS = 1 << 25


class TooManyPairsError(RuntimeError):
    """A truncation mask would keep more than :data:`MAX_PAIRS` cluster pairs."""


def _count(found: list[torch.Tensor], kr: int, kc: int) -> None:
    """Raise :class:`TooManyPairsError` once the ``(2, k)`` pair lists in ``found`` pass the cap."""
    kept = sum(t.shape[1] for t in found)
    if kept > MAX_PAIRS:
        raise TooManyPairsError(
            f"the truncation keeps more than {MAX_PAIRS} of the {kr} × {kc} cluster pairs: "
            f"the clusters are too small or too close, at this cluster_scale, blur and "
            f"dimension, for block-sparse soft-minima to prune"
        )


def _cluster_max(values: torch.Tensor, cl: Clusters) -> torch.Tensor:
    """(K,) the largest value of each cluster's members."""
    out = torch.full((len(cl.starts) - 1,), -torch.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, cl.label, values, "amax", include_self=True)


def truncation_mask(rows: Clusters, cols: Clusters, f, g, eps: float, tau: float, p: int):
    """``(I, J)``: the cluster pairs whose plan entries may reach ``e^{−τ}``, sorted by I, J.

    The bound ``max f + max g − C_min ≥ −τ ε``, and each cluster's best partner whatever
    the bound (no empty sum). Past :data:`CHUNK` pairs in two levels: groups of
    :data:`GROUP` clusters consecutive on the Z-order curve, each a ball around its
    members' balls with its largest potential, bound the pairs of their members from
    above; only the members of group pairs that pass are bounded one by one. A cluster
    with a pair that passes has its best partner among them; the others (few) are
    scanned over every partner. The same pairs as :func:`_flat_mask` up to the rounding of
    the distances at the bound's edge (differences here, ``cdist`` there: in float32 7 of
    941 014 pairs at 1M points a sphere); on the VM 1.6–2× faster at 11k and 43k
    clusters (cluster_scale 0.02 and 0.01 on 1M points).

    Args:
        rows: clusters of the rows.  cols: of the columns.
        f: (n,) row potentials.  g: (m,) column potentials (the step before's).
        eps: ε.  tau: τ.  p: the cost ``|x − y|^p / p``.
    """
    r, c = _Balls(rows.centroids, rows.radius, _cluster_max(f, rows)), \
        _Balls(cols.centroids, cols.radius, _cluster_max(g, cols))  # fmt: skip
    return _ball_mask(r, c, -tau * eps, p)


def _ball_mask(r: _Balls, c: _Balls, floor: float, p: int):
    """:func:`truncation_mask` on balls: pairs with ``top_I + top_J − C_min ≥ floor``."""
    kr, kc = len(r.top), len(c.top)
    if kr * kc <= CHUNK:
        return _flat_mask(r, c, floor, p)
    s, t = _flat_mask(_groups(r), _groups(c), floor, p, row_best=False, col_best=False)
    found = []
    dev = r.top.device
    span = torch.arange(GROUP, device=dev)
    per = max(1, CHUNK // GROUP**2)
    for k0 in range(0, len(s), per):  # (kept group pairs → their members' pairs, in chunks)
        i = (s[k0 : k0 + per, None, None] * GROUP + span[None, :, None]).expand(-1, -1, GROUP)
        j = (t[k0 : k0 + per, None, None] * GROUP + span[None, None, :]).expand(-1, GROUP, -1)
        i, j = i.reshape(-1), j.reshape(-1)
        # (the last group's padding bounded at a real cluster and dropped: one wait a chunk)
        ic, jc = i.clamp(max=kr - 1), j.clamp(max=kc - 1)
        gap = (r.centers[ic] - c.centers[jc]).norm(dim=1) - r.radius[ic] - c.radius[jc]
        keep = (r.top[ic] + c.top[jc] - gap.clamp_min(0) ** p / p >= floor) & (i < kr) & (j < kc)
        at = torch.nonzero(keep).flatten()
        found.append(torch.stack([i[at], j[at]]))
        _count(found, kr, kc)
    i, j = torch.cat(found, 1) if found else r.top.new_zeros(2, 0, dtype=torch.long)
    lonely_r = torch.ones(kr, dtype=torch.bool, device=dev)
    lonely_r[i] = False
    lonely_c = torch.ones(kc, dtype=torch.bool, device=dev)
    lonely_c[j] = False
    alone_r, alone_c = torch.stack([lonely_r.sum(), lonely_c.sum()]).tolist()  # (one wait)
    extra = [torch.stack([i, j])]
    if alone_r:  # (rows whose every pair fails: their best partner over all columns)
        r_idx = _first_true(lonely_r, alone_r)
        ri, rj = _flat_mask(r.take(r_idx), c, math.inf, p, col_best=False)
        extra.append(torch.stack([r_idx[ri], rj]))
    if alone_c:
        c_idx = _first_true(lonely_c, alone_c)
        cj, ci = _flat_mask(c.take(c_idx), r, math.inf, p, col_best=False)
        extra.append(torch.stack([ci, c_idx[cj]]))
    i, j = torch.cat(extra, 1)
    key = torch.unique(i * kc + j)
    return key // kc, key % kc


def _first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of ``mask``'s ``count`` True entries, ascending (``count`` read already)."""
    return torch.argsort(mask.logical_not().to(torch.int8), stable=True)[:count]


#: clusters per group of :func:`truncation_mask`'s first level (4: the fewest member
#: pairs bounded one by one, 3 % of K² at cluster_scale 0.02 on 1M points, against 10 % at
#: 16; more levels would cut the first level's (K/4)² further)
GROUP = 4


class _Balls(NamedTuple):
    """What the truncation bound reads of K clusters (or groups of them).

    ``centers``: (K, d); ``radius``: (K,) balls holding their members; ``top``: (K,) the
    members' largest potential.
    """

    centers: torch.Tensor
    radius: torch.Tensor
    top: torch.Tensor

    def take(self, idx: torch.Tensor) -> _Balls:
        """The balls ``idx``."""
        return _Balls(self.centers[idx], self.radius[idx], self.top[idx])


def _groups(balls: _Balls) -> _Balls:
    """Groups of :data:`GROUP` consecutive balls (the last padded with its last ball).

    Centred at their members' mean, each a ball holding its members' balls (slack 1e-5:
    rounding never drops a pair), with their largest potential.
    """
    k, d = balls.centers.shape
    pad = -k % GROUP
    c, r, top = (torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) for t in balls)
    c, r = c.view(-1, GROUP, d), r.view(-1, GROUP)
    center = c.mean(1)
    radius = ((c - center[:, None]).norm(dim=2) + r).amax(1) * (1 + 1e-5)
    return _Balls(center, radius, top.view(-1, GROUP).amax(1))


def _flat_mask(rows: _Balls, cols: _Balls, floor: float, p: int, row_best: bool = True,
               col_best: bool = True):  # fmt: skip
    """The bound on every pair, in chunks of rows (the K_r × K_c table never whole).

    ``(I, J)`` of the pairs at or above ``floor``, and with ``row_best`` / ``col_best``
    each row's / column's best partner.
    """
    kr, kc = len(rows.top), len(cols.top)
    step = max(1, CHUNK // max(1, kc))
    found, best, arg = [], None, None
    for r0 in range(0, kr, step):
        sl = slice(r0, min(kr, r0 + step))
        gap = (torch.cdist(rows.centers[sl], cols.centers) - rows.radius[sl, None]
               - cols.radius[None])  # fmt: skip
        bound = rows.top[sl, None] + cols.top[None, :] - gap.clamp_min(0) ** p / p
        keep = bound >= floor
        if row_best:
            keep[torch.arange(len(bound)), bound.argmax(1)] = True
        if col_best:
            top, at = bound.max(0)
            if best is None or arg is None:
                best, arg = top, at + r0
            else:
                better = top > best
                best = torch.where(better, top, best)
                arg = torch.where(better, at + r0, arg)
        i, j = torch.nonzero(keep, as_tuple=True)
        found.append(torch.stack([i + r0, j]))
        _count(found, kr, kc)
    if arg is not None:
        found.append(torch.stack([arg, torch.arange(kc, device=arg.device)]))
    i, j = torch.cat(found, 1)
    key = torch.unique(i * kc + j)
    return key // kc, key % kc


class _Masks:
    """:func:`truncation_mask` per soft-minimum, a step's ``yx`` mask the transpose of its ``xy``.

    The bound is symmetric in the sides (``max f + max g − C_min``, each cluster's best
    partner kept on both sides), so the columns' problem at the same potentials keeps
    the transposed pairs: one K_r × K_c evaluation for both.
    """

    def __init__(self, clusters: dict, tau: float, p: int):
        self.clusters, self.tau, self.p = clusters, tau, p
        self.last: tuple | None = None  # (f, g, eps, (I, J)) of the last "xy" mask

    def __call__(self, side: str, pot_rows, pot_cols, eps: float):
        last = self.last
        if side == "yx" and last is not None and last[0] is pot_cols and last[1] is pot_rows \
                and last[2] == eps:  # fmt: skip
            i, j = last[3]
            key = torch.sort(j * self.clusters["x"].count + i).values
            return key // self.clusters["x"].count, key % self.clusters["x"].count
        rows, cols = self.clusters[side[0]], self.clusters[side[1]]
        pairs = truncation_mask(rows, cols, pot_rows, pot_cols, eps, self.tau, self.p)
        if side == "xy":
            self.last = (pot_rows, pot_cols, eps, pairs)
        return pairs


def jump_pairs(rows: Clusters, cols: Clusters, g: torch.Tensor, eps: float, tau: float, p: int):
    r"""``(I, J)``: the column centroids whose terms may reach ``e^{−τ} W_J`` of a soft-minimum.

    The jump's soft-minimum over the centroids (weights W_J),
    ``s_i = −ε log Σ_J e^{h_J − C(x_i, c_J)/ε}`` with ``h_J = log W_J + g_J/ε``, has its
    term J at ``W_J e^{(s_i + g_J − C(x_i, c_J))/ε}`` of the sum. No potential of the
    rows is known yet, so the bound takes, for the members of row cluster I (ball of
    centre c_I, radius r_I), ``s_i ≤ S_I = −ε log Σ_J e^{h_J − C_max(I, J)/ε}`` with
    ``C_max`` the cost at ``|c_I − c_J| + r_I``, and keeps J where
    ``S_I + g_J − C_min(I, J) ≥ −τ ε`` (each row cluster's best centroid whatever the
    bound). The dropped terms then add up to less than ``e^{−τ} M`` of the sum for
    columns of mass ``M = Σ_J W_J`` (the fine steps' guarantee): ``s_i`` moves by at most
    ``−ε log(1 − e^{−τ} M)``, 3.7e-6 ε at GeomLoss' ``truncate=5`` and unit mass.

    Args:
        rows: clusters of the rows.  cols: the centroids as single clusters
            (:func:`centroid_clusters`).  g: (K_c,) the centroids' potentials.
        eps: ε.  tau: τ.  p: the cost ``|x − y|^p / p``.
    """
    kc = cols.count
    h = torch.log(cols.weights) + g / eps
    # (|c_I − c_J|² as cdist forms it past 25 points, the norms formed once and the
    # chunk's terms in place: one chunk-sized tensor alive where cdist's path held three,
    # so chunks twice as large for about the same peak; 15 a jump at 11k clusters a side)
    step = max(1, 2 * CHUNK // max(1, kc))
    tops = []
    cr, cc = rows.centroids, cols.centroids
    sq_r, sq_c = (cr * cr).sum(1, keepdim=True), (cc * cc).sum(1)
    for r0 in range(0, rows.count, step):  # (S_I in chunks of row clusters)
        sl = slice(r0, r0 + step)
        dist = torch.addmm(sq_c[None, :], cr[sl], cc.T, alpha=-2).add_(sq_r[sl]).clamp_min_(0)
        reach = dist.sqrt_().add_(rows.radius[sl, None]).pow_(p).mul_(-1.0 / (p * eps))
        tops.append(-eps * torch.logsumexp(reach.add_(h[None, :]), dim=1))
    r = _Balls(rows.centroids, rows.radius, torch.cat(tops))
    top = torch.where(cols.weights > 0, g, -math.inf)  # (an empty centroid takes no term)
    return _ball_mask(r, _Balls(cols.centroids, cols.radius, top), -tau * eps, p)


def all_pairs(kr: int, kc: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every cluster pair, sorted."""
    key = torch.arange(kr * kc, device=device)
    return key // kc, key % kc


def _sparse_softmin(xs, rows: Clusters, ys, cols: Clusters, log_w, eps, cost, pairs, backend):
    """``softmin`` of every row over the column clusters its block keeps (n,), rows' order.

    By :func:`~flashot.backends.kernel_sums.block_sparse_softmin`; ``xs``, ``ys``: the
    clouds already in cluster order; ``log_w`` (m,) in the columns' own order.
    """
    # (merged runs pay on the GPU, where the kernel pads intervals to tiles; the CPU's
    # PyTorch blocks have no padding and do ~12 % more work with them: v50, 20k spheres)
    layout = block_intervals(rows.starts, cols.starts, pairs, gap=None if xs.is_cuda else 0,
                             n_rows=len(xs))  # fmt: skip
    out = block_sparse_softmin(xs, ys, log_w[cols.order], eps, cost, layout, backend)
    return out[rows.inverse]


class _SparseSoftMin:
    """The fine phase's :data:`~flashot.solver.tiled_loop.SoftMin`: the kept cluster pairs.

    Every pair at an initialization (no potentials yet), else :class:`_Masks`' pairs at
    the current potentials. With :data:`WINDOW`, where the fused kernels run
    (:func:`~flashot.backends.kernel_sums.window_step`), a step's two sides come from one
    window pass over the mask's two layouts (:meth:`both`) and a self problem's side from
    half of one; otherwise exact block-sparse soft-minima.
    """

    def __init__(self, srt: dict, cl: dict, masks: _Masks, cost, rho, backend: str):
        self.srt, self.cl, self.masks = srt, cl, masks
        self.cost, self.rho, self.backend = cost, rho, backend

    def __call__(self, side, log_w, pot_rows, pot_cols, eps):
        """The damped soft-minimum of ``side``'s rows (see the class)."""
        rc, cc = self.cl[side[0]], self.cl[side[1]]
        if pot_rows is None or pot_cols is None:
            keep = all_pairs(rc.count, cc.count, rc.starts.device)
            return damping(eps, self.rho) * self._exact(side, log_w, keep, eps)
        if side[0] == side[1] and pot_rows is pot_cols:  # a self problem: half a pass
            return self._self(side, log_w, pot_rows, eps)
        keep = self.masks(side, pot_rows, pot_cols, eps)
        return damping(eps, self.rho) * self._exact(side, log_w + pot_cols / eps, keep, eps)

    def both(self, la, lb, f, g, eps):
        """``(self("xy", lb, f, g, eps), self("yx", la, g, f, eps))``, from one pass."""
        if f is None or g is None:
            return self("xy", lb, f, g, eps), self("yx", la, g, f, eps)
        return self._pair(la, lb, f, g, eps)

    def extrapolate(self, clouds: dict, la, lb, pots: tuple, eps) -> GeomLossPotentials:
        """GeomLoss' final extrapolation from ``pots = (f_ba, g_ab, f_aa, g_bb)``.

        Differentiable in the first cloud of each soft-minimum only (``clouds``: the
        callers' x and y); a pair's two sides from one window pass where it runs.
        """
        f_ba, g_ab, f_aa, g_bb = pots
        f_new, g_new = self._pair(la, lb, f_ba, g_ab, eps, clouds)
        selves = [None if pot is None else self._self(side, lw, pot, eps, clouds)
                  for side, lw, pot in (("xx", la, f_aa), ("yy", lb, g_bb))]  # fmt: skip
        return GeomLossPotentials(f_new, g_new, *selves)

    def _pair(self, la, lb, f, g, eps, clouds=None):
        """Both sides of the cross problem (damped): one window pass, else two exact ones.

        ``clouds``: the callers' x and y, each side differentiable in its row cloud.
        """
        keep, keep_t = self.masks("xy", f, g, eps), self.masks("yx", g, f, eps)
        got = self._window("xy", la, lb, f, g, eps, keep, keep_t, clouds)
        if got is None:
            rows = (None, None) if clouds is None else (clouds["x"], clouds["y"])
            got = (self._exact("xy", lb + g / eps, keep, eps, rows[0]),
                   self._exact("yx", la + f / eps, keep_t, eps, rows[1]))  # fmt: skip
        lam = damping(eps, self.rho)
        return lam * got[0], lam * got[1]

    def _self(self, side, log_w, pot, eps, clouds=None):
        """A self problem's side (damped): half a window pass, else an exact one."""
        keep = self.masks(side, pot, pot, eps)
        got = self._window(side, log_w, log_w, pot, pot, eps, keep, keep, clouds)
        if got is None:
            rows = None if clouds is None else clouds[side[0]]
            got = (self._exact(side, log_w + pot / eps, keep, eps, rows),)
        return damping(eps, self.rho) * got[0]

    def _exact(self, side, h, keep, eps, rows=None):
        """The exact block-sparse soft-minimum of ``side`` with log-weights ``h``.

        ``rows``: the row cloud (unsorted, maybe differentiable) instead of the sorted one.
        """
        rc, cc, srt = self.cl[side[0]], self.cl[side[1]], self.srt
        xs = srt[side[0]] if rows is None else rows[rc.order]
        return _sparse_softmin(xs, rc, srt[side[1]], cc, h, eps, self.cost, keep, self.backend)

    def _window(self, side, la, lb, f, g, eps, keep, keep_t, clouds=None):
        """:func:`window_step` over the layouts of ``keep`` and ``keep_t`` (its transpose).

        In the clouds' sorted order, results in the callers'; None where it does not run.
        With ``clouds`` (the callers' x and y) :func:`window_transforms` of them instead,
        differentiable in each side's row cloud.
        """
        if not WINDOW:
            return None
        rc, cc = self.cl[side[0]], self.cl[side[1]]
        x, y = self.srt[side[0]], self.srt[side[1]]
        run = window_step
        if clouds is not None:
            x, y, run = clouds[side[0]][rc.order], clouds[side[1]][cc.order], window_transforms
        gap = None if x.is_cuda else 0
        rows = block_intervals(rc.starts, cc.starts, keep, gap=gap, n_rows=len(x))
        if side[0] == side[1]:  # (a symmetric mask: one layout, the same sorted tensors)
            ls, fs = la[rc.order], f[rc.order]
            got = run(x, x, ls, ls, fs, fs, eps, self.cost, self.backend, (rows, rows))
            return None if got is None else (got[0][rc.inverse],)
        cols = block_intervals(cc.starts, rc.starts, keep_t, gap=gap, n_rows=len(y))
        got = run(x, y, la[rc.order], lb[cc.order], f[rc.order], g[cc.order], eps, self.cost,
                  self.backend, (rows, cols))  # fmt: skip
        return None if got is None else (got[0][rc.inverse], got[1][cc.inverse])


def multiscale_potentials(
    a: torch.Tensor,
    x: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    cost: Callable,
    temps: list[float],
    debias: bool,
    scale: float,
    truncate: float,
    p: int,
    rho: float | None = None,
    backend: str = "auto",
) -> GeomLossPotentials:
    r"""GeomLoss' loop, coarse on the clusters while ε > scale^p, then block-sparse.

    Args:
        a: (n,) weights of x.  x: (n, d) points, d ≤ :data:`MAX_DIM`.
        b: (m,) weights of y.  y: (m, d) points.
        cost: ``cost(x_block, y_block)`` → (r, c) tile of ``|x − y|^p / p``.
        temps: the temperatures, ending at the final ε.
        debias: also solve the self problems.
        scale: the clusters' side > 0.  truncate: τ = truncate²/2 (see the module).
        p: 1 or 2.  rho: ρ of the KL-relaxed marginals, or None.
        backend: the soft-minima's engine.

    Returns:
        The extrapolated potentials of :func:`~flashot.solver.tiled_loop.geomloss_potentials`.
    """
    tau = 0.5 * truncate**2
    pts = {"x": x.detach(), "y": y.detach()}
    origin = torch.minimum(pts["x"].min(0).values, pts["y"].min(0).values)
    cl = {
        "x": grid_clusters(pts["x"], a, scale, origin),
        "y": grid_clusters(pts["y"], b, scale, origin),
    }
    srt = {k: pts[k][c.order] for k, c in cl.items()}  # (sorted once, for every step)
    la, lb = torch.log(a).detach(), torch.log(b).detach()
    coarse = [e for e in temps if e > scale**p]
    fine = temps[len(coarse) :]
    masks = _Masks(cl, tau, p)
    sparse = _SparseSoftMin(srt, cl, masks, cost, rho, backend)

    start = None
    if coarse:  # GeomLoss' steps on the centroids (their weights summed), then the jump
        cen = {k: c.centroids for k, c in cl.items()}
        singles = {k: centroid_clusters(c) for k, c in cl.items()}
        lw = {"x": torch.log(cl["x"].weights), "y": torch.log(cl["y"].weights)}
        dense = dense_softmin(cen, cost, rho, backend)
        pots = symmetric_steps(dense, lw["x"], lw["y"], coarse, debias)
        eps = coarse[-1]
        with torch.no_grad():  # the coarse iterate carried to the points (module, step 3)

            def jump(side, own, pot):
                h = lw[side[1]] + pot / eps
                rows, cols = cl[side[0]], singles[side[1]]
                keep = jump_pairs(rows, cols, pot, eps, tau, p)
                at_points = damping(eps, rho) * _sparse_softmin(
                    srt[side[0]], rows, cen[side[1]], cols, h, eps, cost, keep, backend
                )
                left = own - dense(side, lw[side[1]], own, pot, eps)  # (K,) at the centroids
                return at_points + left[rows.label]

            start = (
                jump("xy", pots[0], pots[1]),
                jump("yx", pots[1], pots[0]),
                jump("xx", pots[2], pots[2]) if debias else None,
                jump("yy", pots[3], pots[3]) if debias else None,
            )
    pots = symmetric_steps(sparse, la, lb, fine, debias, start)
    return sparse.extrapolate({"x": x, "y": y}, la, lb, pots, temps[-1])
