"""Beyond the attention form on one GPU (issue 52), flashot's defaults, one process.

* ``SamplesLoss(p, blur=0.05, scaling=0.5, debias=True)``, value + gradient, p = 2 (the
  attention form) against p = 1 (the pair-cost kernel), randn clouds (y shifted by 0.5),
  n in SIZES, d in DIMS; p = 1's error against the same call in float64 at n = REF_N.
* The kernel norms (``"energy"``, ``"gaussian"``, ``"laplacian"``, blur 0.5) and
  ``"hausdorff"`` at n = SIZES[0], d = 3, value + gradient.
* Multiscale (``cluster_scale``): two spheres of MS_SIZES points (d = 3, the second
  shifted by 0.05), ``SamplesLoss(blur=0.01, scaling=0.5, debias=True)`` value +
  gradient, with ``cluster_scale`` in SCALES and without (the dense call, where n ≤
  DENSE_MAX): time and the value's and gradient's difference from the dense call.
  ``MS_LAYOUTS`` (default ``new``; ``old,new`` both): v50's layout (clusters in Z-order,
  a block's runs ≤ 32 columns apart merged) or the one before it (lexicographic cells,
  exact intervals), in one process. ``MS_PROFILE=1``: one call at each n and scale under
  torch.profiler, its 15 costliest kernels (v52: at 1M the pair kernel's soft-minima and
  the block-sparse gradient). ``keops`` in PARTS: GeomLoss 0.3.1's own multiscale mode
  (KeOps, ``.keops`` carried) on the same clouds beside it.
* ``multiscale8``: d = 8 (the grid's widest), a flat torus turned into 8-D and a Gaussian,
  MS8_SIZES points, blur 0.05, the default ``cluster_scale`` and MS8_SCALES, against the
  dense call.
* ``gromov_wasserstein(x, y, eps=0.05, relative_eps=True)`` at n = GW_N, d = 3 and 64,
  balanced and unbalanced (``rho=100``, the same relative ε; ρ far below the
  linearized cost's spread overflows float32, v42: ρ = 1 did at 1k points): time, outer and inner
  iterations, and ``torch.cuda.max_memory_allocated`` above the inputs (POT's dense GW
  holds n² floats: 10 GB at 50k). ``GW_AXES="1,0.5,0.25"`` scales the coordinates
  (cycled): clouds with distinct principal axes, as shapes have; isotropic ones (the
  default) have an orbit of near-equal matchings along which the iteration drifts (v52:
  d = 3 at 50k did not converge in 1 000 steps).

* ``layout`` (CPU, not in the default PARTS): the multiscale fine phase's work counted
  (:func:`layout_counts`), no GPU needed.

Prints a short table last. PARTS (default ``p,kernels,multiscale,gw``) picks sections.

    python benchmarks/gpu_beyond.py
    PARTS=layout N=20000 CS=0.02 ORDER=lex python benchmarks/gpu_beyond.py
"""

import math
import os
import time
import warnings

import torch
from triton.testing import do_bench

import flashot
from flashot.backends import kernel_sums
from flashot.solver import clusters, multiscale

warnings.simplefilter("ignore")
SIZES = [int(n) for n in os.environ.get("SIZES", "10000,50000").split(",")]
DIMS = [int(d) for d in os.environ.get("DIMS", "3,64").split(",")]
REF_N = int(os.environ.get("REF_N", "2000"))
GW_N = int(os.environ.get("GW_N", "50000"))
MS_SIZES = [int(n) for n in os.environ.get("MS_SIZES", "100000,1000000").split(",")]
SCALES = [float(c) for c in os.environ.get("SCALES", "0.02,0.05").split(",")]
DENSE_MAX = int(os.environ.get("DENSE_MAX", "100000"))
PARTS = os.environ.get("PARTS", "p,kernels,multiscale,gw").split(",")
MS_LAYOUTS = os.environ.get("MS_LAYOUTS", "new").split(",")
MS8_SIZES = [int(n) for n in os.environ.get("MS8_SIZES", "100000").split(",")]
MS8_SCALES = [float(c) for c in os.environ.get("MS8_SCALES", "0.2,0.1").split(",")]
AXES = [float(a) for a in os.environ["GW_AXES"].split(",")] if os.environ.get("GW_AXES") else []
rows: list[tuple] = []


def value_and_grad(loss, x, y):
    xs = x.detach().requires_grad_()
    value = loss(xs, y)
    return value.detach(), torch.autograd.grad(value, xs)[0]


def timed(what, loss, x, y):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    value, _ = value_and_grad(loss, x, y)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ms = do_bench(lambda: value_and_grad(loss, x, y), warmup=1, rep=200, return_mode="median")
    rows.append((*what, first, ms, float(value)))
    print(rows[-1], flush=True)


def layout_counts():
    """The multiscale fine phase's work, counted on the CPU (no GPU needed).

    Two spheres of N points (radius 0.5, the second shifted by 0.05), ``SamplesLoss(p=2,
    blur=blur, scaling=0.5, cluster_scale=cs)`` on the torch backend; every fine
    soft-minimum's block-sparse layout is recorded and reported as shares of the dense
    n·m pairs: kept (the pairs of the cluster pairs the truncation keeps), block work
    (rows × the columns of their block's intervals: the torch path's work), tile work
    (rows × the intervals padded to BN-column tiles: the fused kernel's), for the layout
    as built and with its intervals merged across gaps of up to G columns. Env: N (20000),
    CS (0.02), BLUR (0.01), ORDER (``morton`` or ``lex``), GAP (the layout's own merge
    gap; the CPU path builds with 0 unless set), BN (64).
    """
    ms = multiscale
    n, cs = int(os.environ.get("N", "20000")), float(os.environ.get("CS", "0.02"))
    blur, bn = float(os.environ.get("BLUR", "0.01")), int(os.environ.get("BN", "64"))
    clusters.CELL_ORDER = os.environ.get("ORDER", "morton")
    gap_env = os.environ.get("GAP")
    gaps = (0, 16, 32, 64, 128)
    gen = torch.Generator().manual_seed(0)

    def sphere(n):
        v = torch.randn(n, 3, generator=gen)
        return 0.5 * v / v.norm(dim=1, keepdim=True)

    def block_rows(ptr, bm, nr):
        """(intervals,) the rows of each interval's block."""
        blocks = len(ptr) - 1
        rows = torch.full((blocks,), bm, dtype=torch.long)
        rows[-1] = nr - bm * (blocks - 1)
        return torch.repeat_interleave(rows, (ptr[1:] - ptr[:-1]).long())

    def tile_work(layout, nr, nc):
        """(share of the dense pairs, intervals): bm × bn tiles, as the kernel runs them
        (a tail block's rows and an interval's last columns padded)."""
        _, iv, bm = layout
        tiles = ((iv[:, 1] - iv[:, 0]).long() + bn - 1) // bn
        return float(bm * bn * tiles.sum()) / (nr * nc), len(iv)

    stats = []
    real = kernel_sums.block_intervals

    def recording(
        row_starts, col_starts, pairs, bm=kernel_sums.SPARSE_BLOCK, gap=None, n_rows=None
    ):
        layout = real(row_starts, col_starts, pairs, bm, int(gap_env) if gap_env else gap, n_rows)
        kr, kc = len(row_starts) - 1, len(col_starts) - 1
        if len(pairs[0]) < kr * kc:  # (not an initialization over every pair)
            ptr, iv, bm = layout
            nr, nc = int(row_starts[-1]), int(col_starts[-1])
            size_r, size_c = row_starts.diff(), col_starts.diff()
            kept = float((size_r[pairs[0]] * size_c[pairs[1]]).sum()) / (nr * nc)
            widths = (iv[:, 1] - iv[:, 0]).long()
            block = float((block_rows(ptr, bm, nr) * widths).sum()) / (nr * nc)
            tiles = [tile_work(real(row_starts, col_starts, pairs, bm, g), nr, nc) for g in gaps]
            stats.append((kept, block, len(iv), tiles))
        return layout

    ms.block_intervals = recording
    x, y = sphere(n), sphere(n) + torch.tensor([0.05, 0.0, 0.0])
    start = time.perf_counter()
    loss = flashot.SamplesLoss(p=2, blur=blur, scaling=0.5, cluster_scale=cs, backend="torch")
    value = float(loss(x, y))
    seconds = time.perf_counter() - start

    def mean(values):
        values = list(values)
        return sum(values) / len(values)

    print(f"N={n} cluster_scale={cs} blur={blur} order={clusters.CELL_ORDER} "
          f"gap={gap_env or 'default'}: value {value:.10e}, {len(stats)} fine soft-minima, "
          f"{seconds:.1f} s on the CPU")  # fmt: skip
    kept, block, count = (mean(s[i] for s in stats) for i in range(3))
    print(f"kept {100 * kept:.2f} %, block work {100 * block:.2f} %, intervals {count:.0f}")
    for i, gap in enumerate(gaps):
        work, count = mean(s[3][i][0] for s in stats), mean(s[3][i][1] for s in stats)
        print(f"  merged across ≤ {gap:3d} columns: tile work ({bn} columns) {100 * work:.2f} %, "
              f"intervals {count:.0f}")  # fmt: skip


if "layout" in PARTS:
    layout_counts()
if not torch.cuda.is_available():
    if set(PARTS) - {"layout"}:
        raise SystemExit("gpu_beyond: these parts need a CUDA GPU (PARTS=layout runs on the CPU)")
    raise SystemExit(0)
print(torch.cuda.get_device_name(), torch.__version__, flashot.__version__, flush=True)
for n in SIZES if "p" in PARTS else ():
    for d in DIMS:
        torch.manual_seed(0)
        x, y = torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda") + 0.5
        for p in (2, 1):
            loss = flashot.SamplesLoss(p=p, blur=0.05, scaling=0.5, debias=True)
            timed((f"sinkhorn p={p}", n, d), loss, x, y)
for d in DIMS if "p" in PARTS else ():
    torch.manual_seed(1)
    x, y = torch.randn(REF_N, d, device="cuda"), torch.randn(REF_N, d, device="cuda") + 0.5
    loss = flashot.SamplesLoss(p=1, blur=0.05, scaling=0.5, debias=True)
    v32, g32 = value_and_grad(loss, x, y)
    v64, g64 = value_and_grad(loss, x.double(), y.double())
    err_v = abs(float(v32 - v64)) / abs(float(v64))
    err_g = float((g32.double() - g64).norm() / g64.norm())
    print(f"p=1 n={REF_N} d={d} against float64: value {err_v:.2e}, gradient {err_g:.2e}")
torch.manual_seed(2)
n = SIZES[0]
x, y = torch.randn(n, 3, device="cuda"), torch.randn(n, 3, device="cuda") + 0.5
for name in ("energy", "gaussian", "laplacian", "hausdorff") if "kernels" in PARTS else ():
    timed((name, n, 3), flashot.SamplesLoss(name, blur=0.5), x, y)


def sphere(n, shift):
    v = torch.randn(n, 3, device="cuda")
    return 0.5 * v / v.norm(dim=1, keepdim=True) + 0.5 + shift


def torus8(n):
    """A flat 2-torus of radius 0.5 turned into 8-D (a 2-D manifold in the grid's d)."""
    t = 2 * math.pi * torch.rand(n, 2, device="cuda")
    flat = 0.5 * torch.cat([torch.cos(t), torch.sin(t)], 1)
    turn = torch.linalg.qr(torch.randn(8, 8, device="cuda"))[0][:4]
    return flat @ turn


def gaussian8(n):
    return 0.3 * torch.randn(n, 8, device="cuda")


def against_dense(got, dense):
    (v, g), (dv, dg) = got, dense
    print(f"  against dense: value {abs(float(v - dv)) / abs(float(dv)):.2e}, "
          f"gradient {float((g - dg).norm() / dg.norm()):.2e}", flush=True)  # fmt: skip


for n in MS_SIZES if "multiscale" in PARTS else ():
    torch.manual_seed(4)
    x, y = sphere(n, 0.0), sphere(n, 0.05)
    dense = None
    if n <= DENSE_MAX:
        dense = value_and_grad(flashot.SamplesLoss(blur=0.01), x, y)
        timed(("multiscale: dense", n, 3), flashot.SamplesLoss(blur=0.01), x, y)
    for scale, layout in ((s, lay) for s in SCALES for lay in MS_LAYOUTS):
        clusters.CELL_ORDER = "lex" if layout == "old" else "morton"
        kernel_sums.SPARSE_GAP = 0 if layout == "old" else 32
        loss = flashot.SamplesLoss(blur=0.01, cluster_scale=scale)
        timed((f"multiscale: cluster_scale={scale} {layout} layout", n, 3), loss, x, y)
        if os.environ.get("MS_PROFILE") == "1":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                value_and_grad(loss, x, y)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                            max_name_column_width=50), flush=True)  # fmt: skip
        if dense is not None:
            against_dense(value_and_grad(loss, x, y), dense)
    if "keops" in PARTS:  # (GeomLoss' own multiscale mode on KeOps, the same call)
        import geomloss

        for scale in SCALES:
            peer = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.01, scaling=0.5, debias=True,
                                        cluster_scale=scale, backend="multiscale")  # fmt: skip
            try:
                timed((f"GeomLoss-KeOps multiscale: cluster_scale={scale}", n, 3), peer, x, y)
            except Exception as err:  # (its JIT or its clustering: report, go on)
                print(f"GeomLoss-KeOps multiscale n={n}: {err!r}"[:300], flush=True)
                continue
            if dense is not None:
                against_dense(value_and_grad(peer, x, y), dense)
for n in MS8_SIZES if "multiscale8" in PARTS else ():  # (d = 8: MAX_DIM, issue 52 asks it)
    torch.manual_seed(5)
    for cloud, make in (("torus", torus8), ("gaussian", gaussian8)):
        x, y = make(n), make(n) + 0.05
        dense = value_and_grad(flashot.SamplesLoss(blur=0.05), x, y)
        timed((f"d=8 {cloud}: dense", n, 8), flashot.SamplesLoss(blur=0.05), x, y)
        for scale in (None, *MS8_SCALES):
            mode = "multiscale" if scale is None else "auto"  # (None: GeomLoss' default side)
            loss = flashot.SamplesLoss(blur=0.05, cluster_scale=scale, backend=mode)
            timed((f"d=8 {cloud}: cluster_scale={scale or 'default'}", n, 8), loss, x, y)
            against_dense(value_and_grad(loss, x, y), dense)
for d in DIMS if "gw" in PARTS else ():
    for rho in (None, 100.0):
        torch.manual_seed(3)
        x, y = torch.randn(GW_N, d, device="cuda"), torch.randn(GW_N, d, device="cuda")
        if AXES:
            x, y = (t * torch.tensor(AXES, device="cuda").repeat(d)[:d] for t in (x, y))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        try:
            r = flashot.gromov_wasserstein(x, y, eps=0.05, rho=rho, relative_eps=True)
        except FloatingPointError as err:
            print(f"GW n={GW_N} d={d} rho={rho}: {err}", flush=True)
            continue
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(
            f"GW n={GW_N} d={d} rho={rho}: {time.perf_counter() - t0:.1f} s, peak {peak:.0f} "
            f"MiB above the inputs, cost {float(r.cost):.5g}, {r.n_iter} outer (converged "
            f"{r.converged}), {sum(r.inner_iterations)} inner",
            flush=True,
        )
print("\n| loss | n | d | first call s | median ms | value |\n|---|---|---|---|---|---|")
for what, n, d, first, ms, value in rows:
    print(f"| {what} | {n} | {d} | {first:.2f} | {ms:.1f} | {value:.6g} |")
