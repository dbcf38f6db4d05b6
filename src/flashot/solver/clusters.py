"""Grid clusters of low-dimensional clouds, the multiscale solve's coarse level.

A cloud is cut by one grid of cells of side ``scale``; each non-empty cell is a cluster
with its weighted centroid, its weight and its radius (the farthest member), and the
cloud's rows are sorted by cluster, cells along a Z-order curve (:data:`CELL_ORDER`), so
that a block of sorted rows is a compact patch (:mod:`flashot.solver.multiscale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CELL_ORDER", "MAX_DIM", "Clusters", "centroid_clusters", "default_scale",
           "grid_clusters", "morton_keys"]  # fmt: skip

#: widest feature size the grid clustering accepts (cells multiply as scale^-d)
MAX_DIM = 8
#: how clusters are ordered: "morton" (cells along a Z-order curve: a block of sorted rows
#: is a compact patch, its kept columns few intervals) or "lex" (cells by coordinates)
CELL_ORDER = "morton"


@dataclass(frozen=True)
class Clusters:
    """A cloud cut into grid cells.

    Attributes:
        label: (n,) each point's cluster.
        order: (n,) the cloud's rows sorted by cluster.
        inverse: (n,) each row's place in that order (``order``'s inverse).
        starts: (K + 1,) each cluster's offset in that order.
        centroids: (K, d) weighted centroids (plain means where a cluster's weight is 0).
        weights: (K,) summed weights.
        radius: (K,) the largest distance from a centroid to its members.
    """

    label: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    starts: torch.Tensor
    centroids: torch.Tensor
    weights: torch.Tensor
    radius: torch.Tensor

    @property
    def count(self) -> int:
        """K, the number of clusters."""
        return len(self.starts) - 1

    @property
    def members(self) -> list[torch.Tensor]:
        """One (k_I,) index tensor per cluster, into the cloud's rows."""
        return list(torch.split(self.order, (self.starts[1:] - self.starts[:-1]).tolist()))


def grid_clusters(x: torch.Tensor, w: torch.Tensor, scale: float, origin: torch.Tensor) -> Clusters:
    """The non-empty cells of side ``scale`` (corner ``origin``) holding the points of x.

    Args:
        x: (n, d) points.  w: (n,) weights ≥ 0.  scale: the cells' side > 0.
        origin: (d,) the grid's corner (shared by the clouds of one problem).
    """
    xd, wd = x.detach(), w.detach()
    cells = torch.floor((xd - origin) / scale).long()
    key = morton_keys(cells) if CELL_ORDER == "morton" else None
    if key is None:
        _, label = torch.unique(cells, dim=0, return_inverse=True)
    else:
        _, label = torch.unique(key, return_inverse=True)
    k = int(label.max()) + 1
    order = torch.argsort(label, stable=True)
    counts = torch.bincount(label, minlength=k)
    starts = torch.zeros(k + 1, dtype=torch.long, device=xd.device)
    starts[1:] = torch.cumsum(counts, 0)
    weights = torch.zeros(k, dtype=xd.dtype, device=xd.device).index_add_(0, label, wd)
    sums = torch.zeros(k, xd.shape[1], dtype=xd.dtype, device=xd.device)
    plain = sums.index_add(0, label, xd) / counts[:, None].to(xd.dtype)
    weighted = sums.index_add(0, label, wd[:, None] * xd) / weights.clamp_min(1e-300)[:, None]
    centroids = torch.where((weights > 0)[:, None], weighted, plain)
    dist = (xd - centroids[label]).norm(dim=1)
    radius = torch.zeros(k, dtype=xd.dtype, device=xd.device).scatter_reduce_(
        0, label, dist, "amax", include_self=True
    )
    return Clusters(label, order, torch.argsort(order), starts, centroids, weights, radius)


def morton_keys(cells: torch.Tensor) -> torch.Tensor | None:
    """(n,) Z-order keys of grid cells ``cells`` (n, d), or None past 62 bits or below 0.

    The bits of the d coordinates interleaved, lowest first: cells close on the curve are
    close in space, so a run of sorted cells is a compact patch rather than a line.
    """
    n, d = cells.shape
    low, high = (int(t) for t in torch.aminmax(cells)) if n else (0, 0)  # (one host wait)
    if low < 0:  # (a corner above some point: keys must stay injective)
        return None
    bits = max(1, high.bit_length())
    if bits * d > 62:
        return None
    key = torch.zeros(n, dtype=torch.long, device=cells.device)
    for b in range(bits):
        for k in range(d):
            key |= ((cells[:, k] >> b) & 1) << (b * d + k)
    return key


def centroid_clusters(cl: Clusters) -> Clusters:
    """The K centroids of ``cl`` as K clusters of one point each (the jump's columns)."""
    k, dev = cl.count, cl.starts.device
    idx = torch.arange(k, device=dev)
    return Clusters(idx, idx, idx, torch.arange(k + 1, device=dev), cl.centroids, cl.weights,
                    torch.zeros_like(cl.weights))  # fmt: skip


def default_scale(diameter: float, d: int) -> float:
    """A cell side giving about 2 000 cells across the bounding box.

    GeomLoss' rule: ``diameter / (√d · 2000^{1/d})``.
    """
    return diameter / (math.sqrt(d) * 2000 ** (1.0 / d))
