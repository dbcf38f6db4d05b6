"""Grid clusters: a partition of the cloud, ordered along the cells' Z-order curve."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.solver import clusters
from flashot.solver.clusters import grid_clusters


def _cloud(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, d, generator=g, dtype=torch.float64), g


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 60), d=st.integers(1, 3),
       scale=st.sampled_from([0.05, 0.2, 0.5, 2.0]))  # fmt: skip
def test_grid_clusters_partition_the_cloud(seed, n, d, scale):
    x, g = _cloud(seed, n, d)
    w = torch.rand(n, generator=g, dtype=torch.float64)
    w[0] = 0.0
    cl = grid_clusters(x, w, scale, torch.zeros(d, dtype=torch.float64))
    everyone = torch.sort(torch.cat(cl.members)).values
    assert torch.equal(everyone, torch.arange(n))
    for k, idx in enumerate(cl.members):
        cells = torch.floor(x[idx] / scale)
        assert bool((cells == cells[0]).all())  # one cell per cluster
        assert float(cl.weights[k]) == pytest.approx(float(w[idx].sum()), rel=1e-14)
        dist = (x[idx] - cl.centroids[k]).norm(dim=1)
        assert float(cl.radius[k]) == pytest.approx(float(dist.max()), abs=1e-12)
        if cl.weights[k] > 0:
            mean = (w[idx, None] * x[idx]).sum(0) / w[idx].sum()
            torch.testing.assert_close(cl.centroids[k], mean)


def _z_order(cell: list[int]) -> int:
    """The Z-order key of one cell, bit by bit (coordinate k's bit b at b·d + k)."""
    d = len(cell)
    return sum(((c >> b) & 1) << (b * d + k) for k, c in enumerate(cell) for b in range(63))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 80), d=st.integers(1, 8),
       log_cells=st.integers(0, 12), order=st.sampled_from(["morton", "lex"]))  # fmt: skip
def test_clusters_follow_the_cell_order(seed, n, d, log_cells, order):
    """One cluster per distinct cell, in Z-order (lexicographic where the interleaved key
    would pass 62 bits, or when asked)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64) * 2.0**log_cells
    with mock.patch.object(clusters, "CELL_ORDER", order):
        cl = grid_clusters(x, torch.ones(n, dtype=torch.float64), 1.0,
                           torch.zeros(d, dtype=torch.float64))  # fmt: skip
    cells = [tuple(int(c) for c in torch.floor(x[idx[0]])) for idx in cl.members]
    assert len(set(cells)) == len(cells) == len({tuple(r) for r in torch.floor(x).long().tolist()})
    top = int(torch.floor(x).max())
    if order == "morton" and max(1, top.bit_length()) * d <= 62:
        keys = [_z_order(list(c)) for c in cells]
    else:
        keys = cells
    assert keys == sorted(keys)


def test_cells_below_the_corner_fall_back_to_the_lexicographic_order():
    """Negative cells (a corner above some point) would alias under bit interleaving."""
    cells = torch.tensor([[-1, 0], [0, 0], [1, 2]])
    assert clusters.morton_keys(cells) is None
    assert clusters.morton_keys(cells + 1) is not None
