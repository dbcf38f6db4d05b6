"""SamplesLoss' kernel norms against GeomLoss 0.3.1 (tensorized) and its Hausdorff
divergence against the dense formula, values and derivatives."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flashot

geomloss = pytest.importorskip("geomloss")

#: GeomLoss' tensorized distances are sqrt(max(r², 1e-8)): its self terms see 1e-4, not
#: 0, on their diagonals (flashot's see 0); its kernel at that distance, by loss
CLAMPED_ZERO = {"energy": -1e-4, "laplacian": math.exp(-1e-4), "gaussian": 1.0}
AT_ZERO = {"energy": 0.0, "laplacian": 1.0, "gaussian": 1.0}


def _data(seed, n, m, d, uniform):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(m, d, generator=g, dtype=torch.float64) * 0.8 + 0.3
    if uniform:
        return None, x, None, y
    a = torch.rand(n, generator=g, dtype=torch.float64)
    b = torch.rand(m, generator=g, dtype=torch.float64)
    return a + 0.1, x, b + 0.1, y


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 30), m=st.integers(2, 30),
       d=st.integers(1, 4), loss=st.sampled_from(["energy", "gaussian", "laplacian"]),
       blur=st.sampled_from([0.05, 0.5, 2.0]), uniform=st.booleans())  # fmt: skip
def test_kernel_norms_are_geomloss(seed, n, m, d, loss, blur, uniform):
    a, x, b, y = _data(seed, n, m, d, uniform)
    pts = torch.cat([x, y])
    gaps = torch.cdist(pts, pts) + torch.eye(len(pts), dtype=torch.float64)
    assume(float(gaps.min()) > 1e-3)  # (GeomLoss clamps distinct points closer than 1e-4)
    leaves = [t.clone().requires_grad_(True) for t in (x, y)]
    wa = None if a is None else a.clone().requires_grad_(True)
    wb = None if b is None else b.clone().requires_grad_(True)
    args = (leaves[0], leaves[1]) if a is None else (wa, leaves[0], wb, leaves[1])
    ours = flashot.SamplesLoss(loss, blur=blur)(*args)
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, y)]
    ra = None if a is None else a.clone().requires_grad_(True)
    rb = None if b is None else b.clone().requires_grad_(True)
    rargs = (ref_leaves[0], ref_leaves[1]) if a is None else (ra, ref_leaves[0], rb, ref_leaves[1])
    ref = geomloss.SamplesLoss(loss, blur=blur, backend="tensorized")(*rargs)
    pa = torch.full((n,), 1 / n, dtype=torch.float64) if a is None else a
    pb = torch.full((m,), 1 / m, dtype=torch.float64) if b is None else b
    artifact = 0.5 * (CLAMPED_ZERO[loss] - AT_ZERO[loss]) * ((pa**2).sum() + (pb**2).sum())
    assert float(ours) == pytest.approx(float(ref - artifact), rel=1e-10, abs=1e-12)
    wrt = [*leaves] + ([] if a is None else [wa, wb])
    ref_wrt = [*ref_leaves] + ([] if a is None else [ra, rb])
    got = torch.autograd.grad(ours, wrt)
    want = list(torch.autograd.grad(ref, ref_wrt))
    if a is not None:  # (the artifact's derivative in the weights: a_i (k(1e-4) − k(0)))
        want[2] = want[2] - (CLAMPED_ZERO[loss] - AT_ZERO[loss]) * a
        want[3] = want[3] - (CLAMPED_ZERO[loss] - AT_ZERO[loss]) * b
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_kernel_potentials_are_geomloss():
    a, x, b, y = _data(3, 12, 9, 2, False)
    f, g = flashot.SamplesLoss("gaussian", blur=0.7, potentials=True)(a, x, b, y)
    rf, rg = geomloss.SamplesLoss("gaussian", blur=0.7, potentials=True,
                                  backend="tensorized")(a, x, b, y)  # fmt: skip
    # (GeomLoss' legacy kernels return (1, N); flashot's potentials are shaped like the weights)
    torch.testing.assert_close(f, rf.reshape(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, rg.reshape(-1), rtol=1e-12, atol=1e-12)


def _dense_hausdorff(a, x, b, y, blur, p):
    eps = blur**p

    def soft(z, w, pts):
        sq = (z[:, None, :] - pts[None, :, :]).square().sum(-1)
        c = sq / 2 if p == 2 else torch.cdist(z, pts)
        return -eps * torch.logsumexp(torch.log(w)[None, :] - c / eps, dim=1)

    return 0.5 * ((a * (soft(x, b, y) - soft(x, a, x))).sum()
                  + (b * (soft(y, a, x) - soft(y, b, y))).sum())  # fmt: skip


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.sampled_from([1, 2]),
       blur=st.sampled_from([0.05, 0.3, 3.0]))  # fmt: skip
def test_hausdorff_is_its_definition_positive_and_zero_on_the_diagonal(seed, p, blur):
    a, x, b, y = _data(seed, 11, 8, 2, False)
    loss = flashot.SamplesLoss("hausdorff", p=p, blur=blur)
    value = loss(a, x, b, y)
    assert float(value) == pytest.approx(float(_dense_hausdorff(a, x, b, y, blur, p)),
                                         rel=1e-10, abs=1e-13)  # fmt: skip
    assert float(value) > 0
    assert abs(float(loss(a, x, a, x))) < 1e-12


def test_hausdorff_at_small_blur_is_the_chamfer_loss():
    a, x, b, y = _data(5, 10, 12, 3, False)
    a, b = a / a.sum(), b / b.sum()
    r = torch.cdist(x, y)
    chamfer = 0.5 * ((a * r.min(1).values).sum() + (b * r.min(0).values).sum())
    value = flashot.SamplesLoss("hausdorff", p=1, blur=1e-4)(a, x, b, y)
    assert float(value) == pytest.approx(float(chamfer), rel=1e-3)


def test_hausdorff_derivatives_twice_against_the_dense_formula():
    a, x, b, y = _data(8, 7, 6, 2, False)
    v = torch.randn(7, 2, dtype=torch.float64)
    results = []
    for fn in (lambda x: flashot.SamplesLoss("hausdorff", p=2, blur=0.4)(a, x, b, y),
               lambda x: _dense_hausdorff(a, x, b, y, 0.4, 2)):  # fmt: skip
        xl = x.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(fn(xl), xl, create_graph=True)
        (hv,) = torch.autograd.grad((g * v).sum(), xl)
        results.append((g.detach(), hv))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-9, atol=1e-12)


def test_batched_kernel_losses_are_the_items():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 8, 2, generator=g), torch.randn(3, 6, 2, generator=g)
    for name in ("energy", "hausdorff"):
        loss = flashot.SamplesLoss(name, blur=0.5)
        torch.testing.assert_close(loss(x, y), torch.stack([loss(x[i], y[i]) for i in range(3)]))


@pytest.mark.parametrize("kw,match", [
    (dict(loss="mmd"), "loss must be one of"), (dict(loss="energy", p=3), "p must be 1 or 2"),
    (dict(loss="sinkhorn", p=1, cost="cosine"), "cost must be None"),
    (dict(loss="gaussian", reach=1.0), "reach applies"),
    (dict(loss="energy", cost="cosine"), "cost must be None"),
    (dict(loss="hausdorff", potentials=True), "potentials"),
])  # fmt: skip
def test_misuse_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        flashot.SamplesLoss(**kw)


def test_bad_inputs_are_named():
    loss = flashot.SamplesLoss("energy")
    x, y = torch.randn(5, 2), torch.randn(4, 2)
    with pytest.raises(ValueError, match="non-finite"):
        loss(x.index_fill(0, torch.tensor([0]), math.nan), y)
    with pytest.raises(ValueError, match="share dimension"):
        loss(x, torch.randn(4, 3))
    with pytest.raises(ValueError, match="a must hold 5 weights"):
        loss(torch.ones(4), x, torch.ones(4), y)
    with pytest.raises(ValueError, match="non-negative"):
        loss(-torch.ones(5), x, torch.ones(4), y)


def _exact_distances(x, y, use_keops=False):
    """GeomLoss' ``distances`` without its 1e-4 clamp (zero on coincident points)."""
    sq = (x[..., :, None, :] - y[..., None, :, :]).square().sum(-1)
    apart = sq > 0
    return torch.where(apart, torch.where(apart, sq, 1.0).sqrt(), 0.0)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 25), m=st.integers(2, 25),
       d=st.integers(1, 3), blur=st.sampled_from([0.05, 0.5]), debias=st.booleans(),
       scaling=st.sampled_from([0.5, 0.8]))  # fmt: skip
def test_p1_sinkhorn_is_geomloss(seed, n, m, d, blur, debias, scaling):
    a, x, b, y = _data(seed, n, m, d, False)
    a, b = a / a.sum(), b / b.sum()
    # (GeomLoss clamps distances at 1e-4, which its self problems see on their diagonals)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(geomloss._legacy.sinkhorn_samples, "distances", _exact_distances)
        _compare_p1(a, x, b, y, blur, debias, scaling)


def _compare_p1(a, x, b, y, blur, debias, scaling):
    out = []
    for make in (lambda: flashot.SamplesLoss("sinkhorn", p=1, blur=blur, debias=debias,
                                             scaling=scaling),
                 lambda: geomloss.SamplesLoss("sinkhorn", p=1, blur=blur, debias=debias,
                                              scaling=scaling, backend="tensorized")):  # fmt: skip
        leaves = [t.clone().requires_grad_(True) for t in (a, x, b, y)]
        value = make()(*leaves)
        out.append((value.detach(), torch.autograd.grad(value, leaves)))
    assert float(out[0][0]) == pytest.approx(float(out[1][0]), rel=1e-10, abs=1e-13)
    for got, want in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11)


def test_p1_sinkhorn_against_unpatched_geomloss_differs_by_its_clamp_only():
    a, x, b, y = _data(4, 30, 25, 3, False)
    ours = flashot.SamplesLoss("sinkhorn", p=1, blur=0.5)(a, x, b, y)
    theirs = geomloss.SamplesLoss("sinkhorn", p=1, blur=0.5, backend="tensorized")(a, x, b, y)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-3)
    f, g = flashot.SamplesLoss("sinkhorn", p=1, blur=0.5, debias=False, potentials=True)(a, x, b, y)
    rf, rg = geomloss.SamplesLoss("sinkhorn", p=1, blur=0.5, debias=False, potentials=True,
                                  backend="tensorized")(a, x, b, y)  # fmt: skip
    torch.testing.assert_close(f, rf.reshape(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, rg.reshape(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reach", [None, 1.0])
def test_p1_sinkhorn_batches(reach):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 9, 2, generator=g), torch.randn(2, 7, 2, generator=g)
    loss = flashot.SamplesLoss("sinkhorn", p=1, blur=0.3, reach=reach)
    torch.testing.assert_close(loss(x, y), torch.stack([loss(x[i], y[i]) for i in range(2)]))


@pytest.mark.parametrize("debias", [True, False])
def test_p1_relaxed_sinkhorn_is_geomloss_value_with_flashots_gradient(debias):
    a, x, b, y = _data(6, 14, 11, 2, False)
    blur, reach = 0.3, 0.7
    eps, rho = blur, reach
    out = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(geomloss._legacy.sinkhorn_samples, "distances", _exact_distances)
        for make in (flashot.SamplesLoss, lambda *a, **k: geomloss.SamplesLoss(
                *a, **k, backend="tensorized")):  # fmt: skip
            xl = x.clone().requires_grad_(True)
            value = make("sinkhorn", p=1, blur=blur, reach=reach, debias=debias)(a, xl, b, y)
            out.append((value.detach(), torch.autograd.grad(value, xl)[0]))
    assert float(out[0][0]) == pytest.approx(float(out[1][0]), rel=1e-10)
    # GeomLoss 0.3.1 scales its relaxed gradient by (ρ + ε/2)/(ρ + ε) (autodiff.functions.dual_term)
    torch.testing.assert_close(out[0][1] * (rho + eps / 2) / (rho + eps), out[1][1], rtol=1e-8,
                               atol=1e-11)  # fmt: skip


def _log_cost(x, y):
    """``log(1 + |x − y|²)`` on (…, N, D), (…, M, D) blocks: GeomLoss' and flashot's shapes."""
    return torch.log1p((x[..., :, None, :] - y[..., None, :, :]).square().sum(-1))


@pytest.mark.parametrize("debias", [True, False])
def test_a_cost_callable_is_geomloss_tensorized(debias):
    a, x, b, y = _data(9, 13, 10, 2, False)
    a, b = a / a.sum(), b / b.sum()
    out = []
    for make in (flashot.SamplesLoss, lambda *a, **k: geomloss.SamplesLoss(
            *a, **k, backend="tensorized")):  # fmt: skip
        leaves = [t.clone().requires_grad_(True) for t in (a, x, b, y)]
        value = make("sinkhorn", p=2, blur=0.3, cost=_log_cost, debias=debias)(*leaves)
        out.append((value.detach(), torch.autograd.grad(value, leaves)))
    assert float(out[0][0]) == pytest.approx(float(out[1][0]), rel=1e-10)
    for got, want in zip(out[0][1], out[1][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-11)


def test_the_half_square_callable_is_the_streamed_p2_loss():
    a, x, b, y = _data(10, 12, 9, 3, False)
    out = []
    for cost in (None, lambda u, v: 0.5 * torch.cdist(u, v) ** 2):
        xl = x.clone().requires_grad_(True)
        value = flashot.SamplesLoss(blur=0.4, cost=cost, backend="torch")(a, xl, b, y)
        out.append((value.detach(), torch.autograd.grad(value, xl)[0]))
    assert float(out[0][0]) == pytest.approx(float(out[1][0]), rel=1e-10)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-8, atol=1e-11)


def test_a_cost_callable_must_return_its_tile():
    loss = flashot.SamplesLoss(cost=lambda u, v: (u @ v.T).sum())
    with pytest.raises(ValueError, match=r"cost\(x, y\) must return an \(5, 4\) tensor"):
        loss(torch.randn(5, 2), torch.randn(4, 2))
    with pytest.raises(ValueError, match="cost callable applies"):
        flashot.SamplesLoss("energy", cost=_log_cost)
