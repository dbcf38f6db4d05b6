"""The multiscale loop: grid clusters, a truncation that never drops a live pair, the
block-sparse loop against the dense one, SamplesLoss' cluster_scale against the dense
call and both against the converged divergence."""

import math
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends.kernel_sums import cost_of
from flashot.solver import multiscale
from flashot.solver.clusters import centroid_clusters, grid_clusters
from flashot.solver.multiscale import jump_pairs, multiscale_potentials, truncation_mask
from flashot.solver.tiled_loop import geomloss_potentials


def _clouds(seed, n, m, d):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64)
    y = 0.8 * torch.rand(m, d, generator=g, dtype=torch.float64) + 0.3
    return x, y, g


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 50),
    m=st.integers(1, 50),
    d=st.integers(1, 3),
    p=st.sampled_from([1, 2]),
    eps=st.sampled_from([1e-3, 1e-2, 0.1]),
    scale=st.sampled_from([0.05, 0.2]),
)
def test_the_truncation_drops_only_pairs_below_its_bound(seed, n, m, d, p, eps, scale):
    """Every pair in a dropped cluster pair has f_i + g_j − C_ij < −τ ε (dense check)."""
    x, y, g = _clouds(seed, n, m, d)
    f, gg = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(m, generator=g, dtype=torch.float64),
    )
    origin = torch.zeros(d, dtype=torch.float64)
    cx = grid_clusters(x, torch.ones(n, dtype=torch.float64), scale, origin)
    cy = grid_clusters(y, torch.ones(m, dtype=torch.float64), scale, origin)
    rows, cols = truncation_mask(cx, cy, 0.1 * f, 0.1 * gg, eps, 12.5, p)
    keep = torch.zeros(len(cx.members), len(cy.members), dtype=torch.bool)
    keep[rows, cols] = True
    key = rows * len(cy.members) + cols
    assert torch.equal(key, torch.sort(key).values)  # (sorted by row, then column)
    c = torch.cdist(x, y) ** p / p
    slack = 0.1 * f[:, None] + 0.1 * gg[None, :] - c + 12.5 * eps
    for i, ri in enumerate(cx.members):
        for j, cj in enumerate(cy.members):
            if not keep[i, j]:
                assert float(slack[ri][:, cj].max()) < 1e-12


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 80),
    m=st.integers(1, 80),
    d=st.integers(1, 3),
    p=st.sampled_from([1, 2]),
    eps=st.sampled_from([1e-3, 1e-2, 0.1]),
    scale=st.sampled_from([0.05, 0.2, 0.5]),
    tau=st.sampled_from([3.0, 12.5]),
)
def test_the_jump_drops_only_centroids_below_its_bound(seed, n, m, d, p, eps, scale, tau):
    """Every dropped centroid's term is below e^{−τ} W_J of its row's soft-minimum sum
    (dense float64 check of every point), so the jump moves each potential by at most
    −ε log(1 − e^{−τ} M) for columns of mass M."""
    x, y, g = _clouds(seed, n, m, d)
    origin = torch.zeros(d, dtype=torch.float64)
    cx = grid_clusters(x, torch.ones(n, dtype=torch.float64), scale, origin)
    w = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    cy = grid_clusters(y, w / w.sum(), scale, origin)  # (probability weights: mass 1)
    cols = centroid_clusters(cy)
    pot = eps * torch.randn(cy.count, generator=g, dtype=torch.float64)
    h = torch.log(cy.weights) + pot / eps
    rows, kept = jump_pairs(cx, cols, pot, eps, tau, p)
    keep = torch.zeros(cx.count, cy.count, dtype=torch.bool)
    keep[rows, kept] = True
    assert keep.any(1).all()
    logits = h[None, :] - torch.cdist(x, cy.centroids) ** p / (p * eps)  # (n, K)
    s = -eps * torch.logsumexp(logits, dim=1)
    share = logits + s[:, None] / eps  # (log of each term's share of its row's sum)
    dropped = ~keep[cx.label]
    below = share - torch.log(cy.weights)[None, :]
    assert float(below.masked_fill(~dropped, -math.inf).max()) < -tau + 1e-9
    truncated = -eps * torch.logsumexp(logits.masked_fill(dropped, -math.inf), dim=1)
    mass = float(cy.weights.sum())
    assert torch.all(truncated - s <= -eps * math.log1p(-math.exp(-tau) * mass) + 1e-12)


@pytest.mark.parametrize("p,debias,rho", [(2, True, None), (1, False, None), (2, True, 0.3)])
def test_without_coarse_steps_the_loop_differs_from_the_dense_one_by_the_truncation(p, debias, rho):
    """A schedule that starts below scale^p runs the fine loop from the start: with
    truncate=None it is the dense loop (1e-12); with truncate=5 it differs by
    e^{−12.5}-sized terms."""
    x, y, _ = _clouds(0, 300, 280, 2)
    a, b = (
        torch.full((300,), 1 / 300, dtype=torch.float64),
        torch.full((280,), 1 / 280, dtype=torch.float64),
    )
    temps = [0.04**p, 0.02**p, 0.01**p]
    cost = cost_of(p)
    dense = geomloss_potentials(a, x, b, y, cost, temps, debias, rho)
    for truncate, tol in ((math.inf, 1e-12), (5.0, 1e-5)):
        sparse = multiscale_potentials(a, x, b, y, cost, temps, debias, 0.1, truncate, p, rho)
        for got, ref in zip(
            (sparse.f_ba, sparse.g_ab, sparse.f_aa, sparse.g_bb),
            (dense.f_ba, dense.g_ab, dense.f_aa, dense.g_bb),
            strict=True,
        ):
            if ref is not None:
                assert float((got - ref).abs().max()) <= tol * float(ref.abs().max())
    x0, y0, _ = _clouds(0, 300, 280, 2)
    origin = torch.zeros(2, dtype=torch.float64)
    cx, cy = grid_clusters(x0, a, 0.1, origin), grid_clusters(y0, b, 0.1, origin)
    rows, _ = truncation_mask(cx, cy, dense.f_ba.detach(), dense.g_ab.detach(), temps[-1], 12.5, p)
    assert len(rows) < len(cx.members) * len(cy.members)  # (the truncation was at work)


@pytest.mark.parametrize("p", [1, 2])
def test_cluster_scale_stays_within_the_schedules_own_error(p):
    """SamplesLoss(cluster_scale=...) against the dense call: their difference (value and
    gradient) is below the dense call's own distance to the converged divergence."""
    x, y, _ = _clouds(1, 600, 500, 3)
    blur = 0.05
    out = []
    for kw in ({}, {"cluster_scale": 0.1}):
        xs = x.clone().requires_grad_()
        value = flashot.SamplesLoss(p=p, blur=blur, scaling=0.7, **kw)(xs, y)
        out.append((float(value), torch.autograd.grad(value, xs)[0]))
    (dense, g_dense), (multi, g_multi) = out
    xs = x.clone().requires_grad_()
    # the converged divergence of the same problem, as a long schedule's limit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = flashot.SamplesLoss(p=p, blur=blur, scaling=0.995)(xs, y)
    g_conv = torch.autograd.grad(conv, xs)[0]
    assert abs(multi - dense) <= abs(dense - float(conv))
    assert float((g_multi - g_dense).norm()) <= float((g_dense - g_conv).norm())


def test_multiscale_refuses_wide_clouds_and_serves_batches_and_potentials():
    g = torch.Generator().manual_seed(3)
    x, y = (torch.rand(2, k, 3, generator=g, dtype=torch.float64) for k in (40, 30))
    loss = flashot.SamplesLoss(blur=0.1, cluster_scale=0.2, potentials=True)
    f, g = loss(x, y)
    assert f.shape == (2, 40) and g.shape == (2, 30)
    f0, _ = loss(x[0], y[0])  # (a batch: its items one by one)
    torch.testing.assert_close(f[0], f0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g[1], loss(x[1], y[1])[1], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="at most 8 dimensions"):
        flashot.SamplesLoss(cluster_scale=0.2)(torch.rand(10, 9), torch.rand(10, 9))
    value = flashot.SamplesLoss(backend="multiscale")(x[0], y[0])  # (a default cell side)
    assert float(value) == pytest.approx(float(flashot.SamplesLoss()(x[0], y[0])), rel=0.05)


def test_the_mask_in_chunks_is_the_mask_whole(monkeypatch):
    """Rows in chunks of a few clusters (the column-best partners merged across chunks)."""
    from flashot.solver import multiscale

    x, y, g = _clouds(5, 200, 150, 2)
    origin = torch.zeros(2, dtype=torch.float64)
    cx = grid_clusters(x, torch.ones(200, dtype=torch.float64), 0.1, origin)
    cy = grid_clusters(y, torch.ones(150, dtype=torch.float64), 0.1, origin)
    f, gg = (
        0.05 * torch.randn(200, generator=g, dtype=torch.float64),
        torch.zeros(150, dtype=torch.float64),
    )
    whole = truncation_mask(cx, cy, f, gg, 1e-3, 12.5, 2)
    monkeypatch.setattr(multiscale, "CHUNK", 3 * len(cy.members))
    chunked = truncation_mask(cx, cy, f, gg, 1e-3, 12.5, 2)
    assert all(torch.equal(u, v) for u, v in zip(whole, chunked, strict=True))
    assert len(whole[0]) < len(cx.members) * len(cy.members)


def test_the_two_level_mask_waits_for_the_device_once_a_chunk(monkeypatch):
    """The members of kept group pairs are bounded in chunks, each read back once (its
    kept pairs), and the clusters left without a pair are counted with one read for both
    sides: a mask at 1M points runs a dozen chunks (v61: two reads a chunk, two more for
    the lonely clusters)."""
    from flashot.solver import multiscale
    from tests.device_waits import DeviceWaits

    x, y, _ = _clouds(3, 400, 300, 2)
    origin = torch.zeros(2, dtype=torch.float64)
    cx = grid_clusters(x, torch.ones(400, dtype=torch.float64), 0.05, origin)
    cy = grid_clusters(y, torch.ones(300, dtype=torch.float64), 0.05, origin)
    f, gg = torch.zeros(400, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    monkeypatch.setattr(multiscale, "CHUNK", 1024)
    monkeypatch.setattr(multiscale, "GROUP", 4)
    groups = [multiscale._groups(multiscale._Balls(c.centroids, c.radius, c.weights * 0))
              for c in (cx, cy)]  # fmt: skip
    kept_groups = len(multiscale._flat_mask(*groups, -12.5 * 1e-2, 2, False, False)[0])
    flat_chunks = -(-len(groups[0].top) // max(1, 1024 // len(groups[1].top)))
    chunks = -(-kept_groups // (1024 // 16))
    assert chunks >= 3  # (the case exercises several chunks)
    with DeviceWaits() as seen:
        truncation_mask(cx, cy, f, gg, 1e-2, 12.5, 2)
    # the groups' flat mask (a read a chunk, one for its pairs' sort), the members' chunks,
    # the lonely count, the pairs' sort; lonely clusters (none here: every centroid is
    # within reach at eps 1e-2) would add their own flat masks
    assert len(seen.waits) == flat_chunks + 1 + chunks + 1 + 1, seen.waits


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(5, 120), m=st.integers(5, 120),
       d=st.integers(1, 3), eps=st.sampled_from([1e-3, 1e-2, 0.1]),
       p=st.sampled_from([1, 2]))  # fmt: skip
def test_the_columns_mask_is_the_rows_mask_transposed(seed, n, m, d, eps, p):
    """The truncation of the yx soft-minimum at the same potentials keeps the transposed
    pairs of the xy one (multiscale._Masks serves it without a second evaluation)."""
    from flashot.solver.multiscale import _Masks

    x, y, g = _clouds(seed, n, m, d)
    origin = torch.minimum(x.min(0).values, y.min(0).values)
    cl = {"x": grid_clusters(x, torch.ones(n, dtype=torch.float64), 0.2, origin),
          "y": grid_clusters(y, torch.ones(m, dtype=torch.float64), 0.2, origin)}  # fmt: skip
    f = 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    gg = 0.1 * torch.randn(m, generator=g, dtype=torch.float64)
    masks = _Masks(cl, 12.5, p)
    masks("xy", f, gg, eps)
    with mock.patch("flashot.solver.multiscale.truncation_mask") as direct:
        served = masks("yx", gg, f, eps)
        assert not direct.called
    want = truncation_mask(cl["y"], cl["x"], gg, f, eps, 12.5, p)
    assert all(torch.equal(u, v) for u, v in zip(served, want, strict=True))
    other = masks("yx", gg, f.clone(), eps)  # (other potentials: evaluated)
    assert all(torch.equal(u, v) for u, v in zip(other, want, strict=True))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(30, 400), m=st.integers(30, 400),
       d=st.integers(1, 3), scale=st.sampled_from([0.02, 0.05, 0.1]),
       eps=st.sampled_from([1e-4, 1e-3, 1e-2]), p=st.sampled_from([1, 2]),
       spread=st.sampled_from([0.0, 0.05, 1.0]))  # fmt: skip
def test_the_two_level_mask_keeps_the_pairs_of_the_flat_one(seed, n, m, d, scale, eps, p, spread):
    """Groups of clusters bounding their members' pairs, then members of the group pairs
    that pass, then the best partners of clusters left without one (the two levels of
    multiscale.truncation_mask) keep exactly the flat mask's pairs."""
    x, y, g = _clouds(seed, n, m, d)
    origin = torch.minimum(x.min(0).values, y.min(0).values)
    cx = grid_clusters(x, torch.ones(n, dtype=torch.float64), scale, origin)
    cy = grid_clusters(y, torch.ones(m, dtype=torch.float64), scale, origin)
    f = spread * torch.randn(n, generator=g, dtype=torch.float64)
    gg = spread * torch.randn(m, generator=g, dtype=torch.float64)
    balls = [multiscale._Balls(cl.centroids, cl.radius, multiscale._cluster_max(pot, cl))
             for cl, pot in ((cx, f), (cy, gg))]  # fmt: skip
    flat = multiscale._flat_mask(*balls, -12.5 * eps, p)
    with mock.patch.object(multiscale, "CHUNK", 64), mock.patch.object(multiscale, "GROUP", 4):
        two = truncation_mask(cx, cy, f, gg, eps, 12.5, p)
    assert all(torch.equal(u, v) for u, v in zip(two, flat, strict=True))


def test_a_problem_too_dense_to_prune_is_solved_without_clusters(monkeypatch):
    """Past MAX_PAIRS kept cluster pairs a mask raises (the flat and the two-level bound
    alike), and SamplesLoss warns and returns the dense call's value and gradient: at
    d = 8 such masks ran a GPU out of memory (v55)."""
    x, y, _ = _clouds(7, 60, 50, 3)
    cl_x = grid_clusters(x, torch.ones(60, dtype=torch.float64), 0.1, torch.zeros(3))
    cl_y = grid_clusters(y, torch.ones(50, dtype=torch.float64), 0.1, torch.zeros(3))
    f, g = torch.zeros(60, dtype=torch.float64), torch.zeros(50, dtype=torch.float64)
    kept = len(truncation_mask(cl_x, cl_y, f, g, 1.0, 12.5, 2)[0])
    monkeypatch.setattr(multiscale, "MAX_PAIRS", kept - 1)
    with pytest.raises(multiscale.TooManyPairsError, match="cluster pairs"):
        truncation_mask(cl_x, cl_y, f, g, 1.0, 12.5, 2)
    monkeypatch.setattr(multiscale, "CHUNK", 8)  # (the two-level bound, in chunks)
    with pytest.raises(multiscale.TooManyPairsError):
        truncation_mask(cl_x, cl_y, f, g, 1.0, 12.5, 2)
    monkeypatch.setattr(multiscale, "MAX_PAIRS", 0)
    xs = x.clone().requires_grad_()
    with pytest.warns(UserWarning, match="solved without clusters"):
        value = flashot.SamplesLoss(blur=0.05, cluster_scale=0.1)(xs, y)
    (grad,) = torch.autograd.grad(value, xs)
    xd = x.clone().requires_grad_()
    dense = flashot.SamplesLoss(blur=0.05)(xd, y)
    torch.testing.assert_close(value, dense, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.autograd.grad(dense, xd)[0], rtol=1e-10, atol=1e-14)


@pytest.mark.skipif("triton" not in flashot.backends.available_backends("cpu"),
                    reason="needs triton's interpreter")  # fmt: skip
@pytest.mark.parametrize("p,coarse", [(1, True), (2, False)])
def test_the_fine_steps_take_the_block_sparse_window_pass(monkeypatch, p, coarse):
    """On the fused kernels (float32), with ``multiscale.WINDOW``, each fine step's two
    sides come from one window pass over the mask's two layouts and each self problem's
    from half of one, and so does the final extrapolation; the potentials and their
    gradients in x and y equal the exact block-sparse steps' to float32 accuracy (from an
    initialization and after a coarse phase). Without it no window runs."""
    x0, y0, g = _clouds(2, 150, 130, 2)
    x0, y0 = x0.float(), y0.float()
    a, b = torch.full((150,), 1 / 150), torch.full((130,), 1 / 130)
    u, v = torch.randn(150, generator=g).float(), torch.randn(130, generator=g).float()
    temps = [0.5**p, 0.2**p, 0.08**p, 0.04**p] if coarse else [0.04**p, 0.02**p]
    calls, real, real_t = [], multiscale.window_step, multiscale.window_transforms

    def counted(*args, **kwargs):
        calls.append(args[1] is args[0])
        return real(*args, **kwargs)

    def counted_t(*args, **kwargs):
        calls.append("final")
        return real_t(*args, **kwargs)

    def run():
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        out = multiscale_potentials(a, x, b, y, cost_of(p), temps, True, 0.1, 5.0, p,
                                    backend="triton")  # fmt: skip
        total = (u * (out.f_ba - out.f_aa)).sum() + (v * (out.g_ab - out.g_bb)).sum()
        return (out.f_ba, out.g_ab, out.f_aa, out.g_bb, *torch.autograd.grad(total, (x, y)))

    monkeypatch.setattr(multiscale, "WINDOW", True)  # (the default)
    monkeypatch.setattr(multiscale, "window_step", counted)
    monkeypatch.setattr(multiscale, "window_transforms", counted_t)
    windowed = run()
    monkeypatch.setattr(multiscale, "window_step", lambda *args, **kwargs: None)
    monkeypatch.setattr(multiscale, "window_transforms", lambda *args, **kwargs: None)
    exact = run()
    steps = sum(1 for t in temps if t <= 0.1**p)  # (an initialization streams every pair)
    assert calls.count(False) == steps and calls.count(True) == 2 * steps, calls
    assert calls.count("final") == 3  # (the pair, then each self problem)
    monkeypatch.setattr(multiscale, "WINDOW", False)  # (off: no window pass)
    calls.clear()
    monkeypatch.setattr(multiscale, "window_step", counted)
    monkeypatch.setattr(multiscale, "window_transforms", counted_t)
    run()
    assert calls == []
    for got, ref in zip(windowed, exact, strict=True):
        got, ref = got.detach(), ref.detach()
        size = float(ref.abs().max())
        assert float((got - ref).abs().max()) <= 1e-5 * max(size, 1.0)


def _lattice(g, n, d, shift):
    """n points of a unit lattice, each jittered by at most 0.3 per coordinate (so no
    two share a cell of side 0.2: they are ≥ 0.4 apart along some axis)."""
    side = math.ceil(n ** (1 / d)) + 1
    sites = torch.randperm(side**d, generator=g)[:n]
    grid = torch.stack([(sites // side**k) % side for k in range(d)], 1).double()
    return grid + 0.6 * torch.rand(n, d, generator=g, dtype=torch.float64) - 0.3 + shift


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 40), m=st.integers(2, 40),
       d=st.integers(2, 3), p=st.sampled_from([1, 2]), debias=st.booleans(),
       scaling=st.sampled_from([0.5, 0.7]))  # fmt: skip
def test_clusters_of_one_point_continue_the_dense_trajectory(seed, n, m, d, p, debias,
                                                             scaling):  # fmt: skip
    """Every cluster one point: the coarse phase runs the dense call's steps, and the jump
    must carry its iterate to the points unchanged (a plain extrapolation there, one
    unaveraged half-step more, moved the gradient by ~1e-2). Value and gradient equal the
    dense call's, whatever the fine phase's share of the schedule."""
    g = torch.Generator().manual_seed(seed)
    x, y = _lattice(g, n, d, 0.0), _lattice(g, m, d, 0.15)
    # cells of 0.2 (one point each); blur 0.02: ε below 0.2^p runs the fine phase
    kw = dict(p=p, blur=0.02, scaling=scaling, debias=debias)
    got = []
    for extra in ({}, {"cluster_scale": 0.2}):
        xs = x.clone().requires_grad_()
        value = flashot.SamplesLoss(**kw, **extra)(xs, y)
        got.append((value.detach(), torch.autograd.grad(value, xs)[0]))
    (dense, g_dense), (multi, g_multi) = got
    assert float((multi - dense).abs()) <= 1e-9 * (1 + float(dense.abs()))
    assert float((g_multi - g_dense).norm()) <= 1e-8 * float(g_dense.norm()) + 1e-14
