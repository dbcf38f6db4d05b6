"""The multiscale fine phase's work, counted on the CPU (issue 52; no GPU needed).

Two spheres of N points (radius 0.5, the second shifted by 0.05), ``SamplesLoss(p=2,
blur=BLUR, scaling=0.5, cluster_scale=CS)`` on the torch backend; every fine soft-minimum's
block-sparse layout is recorded and reported as shares of the dense n·m pairs:

* kept: the pairs of the cluster pairs the truncation keeps;
* block work: rows × the columns of their block's intervals (the torch path's work);
* tile work: rows × the intervals padded to BN-column tiles (the fused kernel's work),
  for the layout as built and with its intervals merged across gaps of up to G columns.

Env: N (20000), CS (0.02), BLUR (0.01), ORDER (``morton`` or ``lex``: the clusters' order),
GAP (the layout's own merge gap; the CPU path builds with 0 unless set), BN (64).
"""

import os
import time

import torch

import flashot
from flashot.backends import kernel_sums
from flashot.solver import multiscale as ms

N, CS = int(os.environ.get("N", "20000")), float(os.environ.get("CS", "0.02"))
BLUR, BN = float(os.environ.get("BLUR", "0.01")), int(os.environ.get("BN", "64"))
ms.CELL_ORDER = os.environ.get("ORDER", "morton")
GAP = os.environ.get("GAP")
GAPS = (0, 16, 32, 64, 128)
gen = torch.Generator().manual_seed(0)


def sphere(n):
    v = torch.randn(n, 3, generator=gen)
    return 0.5 * v / v.norm(dim=1, keepdim=True)


def tile_work(iv, owner, bm, gap, cells):
    """(share of the dense pairs, intervals) after merging a block's runs ≤ gap apart."""
    a, b = iv[:, 0].long(), iv[:, 1].long()
    new = torch.ones(len(a), dtype=torch.bool)
    new[1:] = (owner[1:] != owner[:-1]) | (a[1:] - b[:-1] > gap)
    group = torch.cumsum(new.long(), 0) - 1
    ends = torch.zeros(int(new.sum()), dtype=torch.long).scatter_reduce_(
        0, group, b, "amax", include_self=False
    )
    tiles = (ends - a[new] + BN - 1) // BN
    return float(bm * BN * tiles.sum()) / cells, int(new.sum())


stats = []
real = kernel_sums.block_intervals


def recording(row_starts, col_starts, pairs, bm=kernel_sums.SPARSE_BLOCK, gap=None):
    ptr, iv, bm = real(row_starts, col_starts, pairs, bm, int(GAP) if GAP else gap)
    kr, kc = len(row_starts) - 1, len(col_starts) - 1
    if len(pairs[0]) < kr * kc:  # (not an initialization over every pair)
        nr, nc = int(row_starts[-1]), int(col_starts[-1])
        blocks = len(ptr) - 1
        rows = torch.full((blocks,), bm, dtype=torch.long)
        rows[-1] = nr - bm * (blocks - 1)
        owner = torch.repeat_interleave(torch.arange(blocks), (ptr[1:] - ptr[:-1]).long())
        widths = torch.zeros(blocks, dtype=torch.long).index_add_(
            0, owner, (iv[:, 1] - iv[:, 0]).long()
        )
        size_r, size_c = row_starts.diff(), col_starts.diff()
        kept = float((size_r[pairs[0]] * size_c[pairs[1]]).sum()) / (nr * nc)
        block = float((rows * widths).sum()) / (nr * nc)
        stats.append((kept, block, len(iv), [tile_work(iv, owner, bm, g, nr * nc) for g in GAPS]))
    return ptr, iv, bm


ms.block_intervals = recording
x, y = sphere(N), sphere(N) + torch.tensor([0.05, 0.0, 0.0])
start = time.perf_counter()
loss = flashot.SamplesLoss(p=2, blur=BLUR, scaling=0.5, cluster_scale=CS, backend="torch")
value = float(loss(x, y))
seconds = time.perf_counter() - start


def mean(values):
    values = list(values)
    return sum(values) / len(values)


print(f"N={N} cluster_scale={CS} blur={BLUR} order={ms.CELL_ORDER} gap={GAP or 'default'}: "
      f"value {value:.10e}, {len(stats)} fine soft-minima, {seconds:.1f} s on the CPU")  # fmt: skip
kept, block, count = (mean(s[i] for s in stats) for i in range(3))
print(f"kept {100 * kept:.2f} %, block work {100 * block:.2f} %, intervals {count:.0f}")
for i, gap in enumerate(GAPS):
    work, count = mean(s[3][i][0] for s in stats), mean(s[3][i][1] for s in stats)
    print(f"  merged across ≤ {gap:3d} columns: tile work ({BN} columns) {100 * work:.2f} %, "
          f"intervals {count:.0f}")  # fmt: skip
