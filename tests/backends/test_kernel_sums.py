"""The tiled kernel products and soft-minima against dense float64 formulas."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends.kernel_sums import KERNELS, cost_of, distance, kernel_matvec, softmin


def _cloud(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), m=st.integers(1, 40),
       d=st.integers(1, 5), budget=st.sampled_from([7, 64, 1 << 20]),
       name=st.sampled_from(sorted(KERNELS)), blur=st.sampled_from([0.1, 1.0]))  # fmt: skip
def test_tiles_sum_to_the_dense_product(seed, n, m, d, budget, name, blur):
    x, y = _cloud(seed, n, d), _cloud(seed + 1, m, d)
    w = torch.rand(m, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    r = torch.cdist(x, y)
    dense = {"gaussian": torch.exp(-0.5 * r**2 / blur**2), "laplacian": torch.exp(-r / blur),
             "energy": -r}[name]  # fmt: skip
    got = kernel_matvec(x, y, w, functools.partial(KERNELS[name], blur=blur), budget=budget)
    torch.testing.assert_close(got, dense @ w, rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30), m=st.integers(1, 30),
       d=st.integers(1, 4), budget=st.sampled_from([5, 100, 1 << 20]), p=st.sampled_from([1, 2]),
       eps=st.sampled_from([0.01, 0.3, 5.0]))  # fmt: skip
def test_softmin_is_the_dense_log_sum_exp(seed, n, m, d, budget, p, eps):
    x, y = _cloud(seed, n, d), _cloud(seed + 1, m, d)
    w = torch.rand(m, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) + 0.01
    c = torch.cdist(x, y) ** p / p
    dense = -eps * torch.logsumexp(torch.log(w)[None, :] - c / eps, dim=1)
    got = softmin(x, y, torch.log(w), eps, cost_of(p), budget=budget)
    torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)


def test_gradients_twice_match_the_dense_formula():
    x = _cloud(0, 9, 3).requires_grad_(True)
    y = _cloud(1, 7, 3).requires_grad_(True)
    w = torch.rand(7, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 3, dtype=torch.float64)

    def dense(x, y, w):  # (cdist has no double backward)
        r = (x[:, None, :] - y[None, :, :]).square().sum(-1).sqrt()
        return (torch.exp(-r / 0.7) @ w).square().sum()

    def tiled(x, y, w):
        k = functools.partial(KERNELS["laplacian"], blur=0.7)
        return kernel_matvec(x, y, w, k, budget=10).square().sum()

    for fn in (dense, tiled):
        (g,) = torch.autograd.grad(fn(x, y, w), x, create_graph=True)
        hv = torch.autograd.grad((g * v).sum(), (x, y, w))
        if fn is dense:
            ref = (g.detach(), hv)
        else:
            torch.testing.assert_close(g, ref[0], rtol=1e-10, atol=1e-12)
            for got, want in zip(hv, ref[1], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_coincident_points_are_at_distance_zero_with_a_zero_derivative():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]], dtype=torch.float64,
                     requires_grad=True)  # fmt: skip
    r = distance(x, x)
    assert float(r[0, 1]) == 0.0 and float(r[0, 0]) == 0.0
    (g,) = torch.autograd.grad(r.sum(), x)
    assert bool(torch.isfinite(g).all())
    torch.testing.assert_close(g[0], g[1])  # only the third point pulls them


def test_without_autograd_nothing_is_recorded():
    x, y = _cloud(2, 5, 2), _cloud(3, 4, 2)
    with torch.inference_mode():
        out = softmin(x, y, torch.full((4,), -1.4, dtype=torch.float64), 0.5, cost_of(2))
    assert not out.requires_grad


def test_cost_of_names_p():
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        cost_of(3)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), kr=st.integers(1, 12), kc=st.integers(1, 12),
       bm=st.sampled_from([1, 2, 3, 16]), density=st.sampled_from([0.0, 0.3, 1.0]),
       gap=st.sampled_from([0, 1, 4, 32]), twice=st.booleans(), told=st.booleans())  # fmt: skip
def test_block_intervals_cover_the_clusters_a_block_keeps(seed, kr, kc, bm, density, gap, twice,
                                                          told):  # fmt: skip
    """Every kept column, in disjoint sorted intervals that start and end on kept columns;
    an unkept run inside an interval is at most ``gap`` long, and intervals of a block
    lie more than ``gap`` apart (gap 0: exactly the kept columns). Pairs given twice
    (``twice``) change nothing; nor does the rows' count given (``told``)."""
    from flashot.backends.kernel_sums import block_intervals

    g = torch.Generator().manual_seed(seed)
    sizes_r, sizes_c = (torch.randint(1, 6, (k,), generator=g) for k in (kr, kc))
    row_starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes_r.cumsum(0)])
    col_starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes_c.cumsum(0)])
    keep = torch.rand(kr, kc, generator=g) < density
    pairs = torch.nonzero(keep, as_tuple=True)
    n = int(row_starts[-1])
    if twice:  # (each pair repeated, still sorted by I then J)
        pairs = tuple(torch.repeat_interleave(t, 2) for t in pairs)
    ptr, iv, block = block_intervals(row_starts, col_starts, pairs, bm, gap, n if told else None)
    assert block == bm and len(ptr) == -(-n // bm) + 1
    assert ptr.dtype == iv.dtype == torch.int32 and int(ptr[0]) == 0 and int(ptr[-1]) == len(iv)
    row_cluster = torch.repeat_interleave(torch.arange(kr), sizes_r)
    col_cluster = torch.repeat_interleave(torch.arange(kc), sizes_c)
    for b in range(len(ptr) - 1):
        got = torch.zeros(int(col_starts[-1]), dtype=torch.bool)
        clusters = row_cluster[b * bm : (b + 1) * bm].unique()
        want = keep[clusters].any(0)[col_cluster]
        last_end = None
        for c0, c1 in iv[ptr[b] : ptr[b + 1]].tolist():
            assert c0 < c1 and not bool(got[c0:c1].any())  # (disjoint, non-empty)
            assert bool(want[c0]) and bool(want[c1 - 1])  # (kept columns at both ends)
            assert last_end is None or c0 - last_end > gap  # (sorted, more than gap apart)
            unkept = (~want[c0:c1]).int().tolist()
            run = 0
            for u in unkept:
                run = run + 1 if u else 0
                assert run <= gap
            got[c0:c1] = True
            last_end = c1
        assert not bool((want & ~got).any())  # every kept column
        if gap == 0:
            assert torch.equal(got, want)


def test_block_intervals_wait_for_the_device_twice():
    """A layout reads the device twice (the pairs its blocks meet, then its intervals'
    count) where the rows' count is given, three times otherwise: a fine step of the
    multiscale loop builds four (v61: eight waits each, ~280 at 20k points a call)."""
    from flashot.backends.kernel_sums import block_intervals
    from tests.device_waits import DeviceWaits

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 9, (40,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    pairs = torch.nonzero(torch.rand(40, 40, generator=g) < 0.2, as_tuple=True)
    n = int(starts[-1])
    for told, most in ((True, 2), (False, 3)):
        with DeviceWaits() as seen:
            block_intervals(starts, starts, pairs, 16, 4, n if told else None)
        assert len(seen.waits) == most, seen.waits
