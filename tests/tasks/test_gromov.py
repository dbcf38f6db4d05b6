"""Streamed entropic Gromov–Wasserstein against POT 0.9.7 and the dense definition."""

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.tasks.gromov import gromov_wasserstein

ot = pytest.importorskip("ot")

TIGHT = dict(tol=1e-11, inner_tol=1e-11, inner_max_iter=100000, max_iter=3000)


def _clouds(seed, n, m, d, e):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, d)) * 0.5, rng.normal(size=(m, e)) * 0.4 + 3.0
    a, b = rng.random(n) + 0.2, rng.random(m) + 0.2
    return x, y, a / a.sum(), b / b.sum()


def _pot(x, y, a, b, eps, metric="sqeuclidean"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ot.gromov.entropic_gromov_wasserstein(
            ot.dist(x, x, metric=metric), ot.dist(y, y, metric=metric), a, b, "square_loss",
            epsilon=eps, log=True, max_iter=3000, tol=1e-13, stopThr=1e-13,
            numItermax=100000)  # fmt: skip


def _pot_log(x, y, a, b, eps):
    """POT's entropic GW steps (its init_matrix, gwggrad, gwloss) with a log-domain inner
    Sinkhorn: ``entropic_gromov_wasserstein`` fixes ``method="sinkhorn"``, whose kernel
    underflows once the linearized cost spans ≳ 600 ε (seed 49396, n = m = 4, ε = 0.05: its
    plan is 0.065 from a fixed point of the exact iteration, which flashot's reaches)."""
    cx, cy = ot.dist(x, x), ot.dist(y, y)
    const, h1, h2 = ot.gromov.init_matrix(cx, cy, a, b, "square_loss")
    plan = np.outer(a, b)
    for _ in range(3000):
        tens = ot.gromov.gwggrad(const, h1, h2, plan)
        new = ot.sinkhorn(a, b, tens, eps, method="sinkhorn_log", stopThr=1e-13,
                          numItermax=100000)  # fmt: skip
        done = np.abs(new - plan).max() < 1e-14
        plan = new
        if done:
            break
    return plan, float(ot.gromov.gwloss(const, h1, h2, plan))


def _dense_gw(x, y, plan):
    cx, cy = ot.dist(x, x), ot.dist(y, y)
    diff = (cx[:, None, :, None] - cy[None, :, None, :]) ** 2  # (i, j, k, l)
    return float((diff * plan[:, :, None, None] * plan[None, None, :, :]).sum())


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(4, 13), m=st.integers(4, 13),
       d=st.integers(1, 4), e=st.integers(1, 4), eps=st.sampled_from([0.05, 0.2, 1.0]))  # fmt: skip
def test_plan_and_cost_are_pots(seed, n, m, d, e, eps):
    x, y, a, b = _clouds(seed, n, m, d, e)
    plan, gw = _pot_log(x, y, a, b, eps)
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=eps, **TIGHT)
    assert res.converged
    dense = res.plan.dense().numpy()
    np.testing.assert_allclose(dense, plan, rtol=1e-5, atol=1e-9)
    assert float(res.cost) == pytest.approx(gw, rel=1e-6, abs=1e-10)
    # the streamed value is the definition Σ (C^x_ik − C^y_jl)² T_ij T_kl at the plan
    assert float(res.cost) == pytest.approx(_dense_gw(x, y, dense), rel=1e-9)


def test_pots_own_call_agrees_where_its_kernel_does_not_underflow():
    x, y, a, b = _clouds(12, 15, 11, 3, 2)
    plan, log = _pot(x, y, a, b, 0.5)
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=0.5, **TIGHT)
    np.testing.assert_allclose(res.plan.dense().numpy(), plan, rtol=1e-5, atol=1e-9)
    assert float(res.cost) == pytest.approx(float(log["gw_dist"]), rel=1e-6)


@pytest.mark.parametrize("eps", [0.01, 0.05])
def test_the_cosine_inner_cost_is_pots(eps):
    x, y, a, b = _clouds(11, 14, 12, 3, 4)
    plan, log = _pot(x, y, a, b, eps, metric="cosine")
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=eps, cost="cosine",
                             **TIGHT)  # fmt: skip
    assert res.converged
    np.testing.assert_allclose(res.plan.dense().numpy(), plan, rtol=1e-5, atol=1e-9)
    assert float(res.cost) == pytest.approx(float(log["gw_dist"]), rel=1e-6, abs=1e-10)
    with pytest.raises(ValueError, match="zero point"):
        gromov_wasserstein(torch.zeros(3, 2), torch.tensor(y), eps=eps, cost="cosine")
    with pytest.raises(ValueError, match="cost must be one of"):
        gromov_wasserstein(torch.tensor(x), torch.tensor(y), eps=eps, cost="euclidean")


def test_isometries_of_either_space_change_nothing():
    x, y, a, b = _clouds(3, 15, 12, 3, 2)
    q, _ = np.linalg.qr(np.random.default_rng(4).normal(size=(3, 3)))
    base = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=0.2, **TIGHT)
    moved = gromov_wasserstein(torch.tensor(x @ q.T + 7.0), torch.tensor(y - 2.0), a, b,
                               eps=0.2, **TIGHT)  # fmt: skip
    assert float(moved.cost) == pytest.approx(float(base.cost), rel=1e-9)
    torch.testing.assert_close(moved.plan.dense(), base.plan.dense(), rtol=1e-6, atol=1e-10)


def test_relative_eps_scales_by_the_mean_linearized_cost_at_the_product_plan():
    x, y, a, b = _clouds(7, 9, 8, 2, 3)
    cx, cy = ot.dist(x, x), ot.dist(y, y)
    two_l = 2 * np.einsum("ikjl,k,l->ij", (cx[:, :, None, None] - cy[None, None]) ** 2, a, b)
    mean = float(a @ two_l @ b)
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=0.1, relative_eps=True,
                             max_iter=2, tol=0.0, warn=False)  # fmt: skip
    assert res.eps == pytest.approx(0.1 * mean, rel=1e-10)
    same = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=res.eps, max_iter=2,
                              tol=0.0, warn=False)  # fmt: skip
    torch.testing.assert_close(same.cost, res.cost)


def test_float32_agrees_with_float64():
    x, y, a, b = _clouds(5, 25, 20, 3, 3)
    ref = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=0.2, **TIGHT)
    got = gromov_wasserstein(torch.tensor(x, dtype=torch.float32),
                             torch.tensor(y, dtype=torch.float32), a, b, eps=0.2)  # fmt: skip
    assert got.cost.dtype == torch.float32
    assert float(got.cost) == pytest.approx(float(ref.cost), rel=1e-3)


def test_a_missed_tolerance_warns_and_says_so():
    x, y, _, _ = _clouds(6, 10, 9, 2, 2)
    with pytest.warns(flashot.ConvergenceWarning, match="max_iter=1"):
        res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), eps=0.1, max_iter=1, tol=0)
    assert not res.converged and res.n_iter == 1 and len(res.errors) == 1
    assert math.isfinite(float(res.cost))


@pytest.mark.parametrize("kw,match", [
    (dict(eps=0.0), "eps"), (dict(eps=float("nan")), "eps"),
    (dict(eps=0.1, max_iter=0), "max_iter"), (dict(eps=0.1, tol=-1.0), "tol"),
    (dict(eps=0.1, a=np.ones(3)), "a must have shape"),
    (dict(eps=0.1, b=-np.ones(6)), "non-negative"), (dict(eps=0.1, inner_max_iter=0), "inner_max"),
    (dict(eps=0.1, inner_tol=-1e-6), "inner_tol"), (dict(eps=0.1, inner_tol=math.nan), "inner_tol"),
])  # fmt: skip
def test_misuse_is_named(kw, match):
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        gromov_wasserstein(x, y, **kw)


def test_an_inner_tol_that_is_no_number_is_named():
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="inner_tol"):
        gromov_wasserstein(x, y, eps=0.1, inner_tol="tight")


def test_clouds_must_be_finite_and_alike():
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        gromov_wasserstein(x.index_fill(0, torch.tensor([1]), math.nan), y, eps=0.1)
    with pytest.raises(ValueError, match="share dtype"):
        gromov_wasserstein(x, y.float(), eps=0.1)
    with pytest.raises(ValueError, match="x must be"):
        gromov_wasserstein(x[0], y, eps=0.1)


def test_the_plan_answers_in_the_clouds_own_spaces():
    x, y, a, b = _clouds(8, 12, 9, 3, 2)
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), a, b, eps=0.3, **TIGHT)
    dense = res.plan.dense()
    yt = torch.tensor(y)
    torch.testing.assert_close(res.plan.barycentric_map(), (dense @ yt) / dense.sum(1)[:, None])
    torch.testing.assert_close(res.plan.T.barycentric_map(),
                               (dense.T @ torch.tensor(x)) / dense.sum(0)[:, None])  # fmt: skip
    torch.testing.assert_close(res.plan.row_sums(), torch.tensor(a), rtol=0, atol=1e-10)
    torch.testing.assert_close(res.plan @ yt, dense @ yt)
    assert res.plan.shape == (12, 9) and not hasattr(res.plan, "transport_cost")


# ---- unbalanced GW (rho): POT's fused_unbalanced_gromov_wasserstein with alpha = 0 ----
def _pot_ugw(x, y, a, b, eps, rho, metric="sqeuclidean"):
    cx, cy = ot.dist(x, x, metric=metric), ot.dist(y, y, metric=metric)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, _, log = ot.gromov.fused_unbalanced_gromov_wasserstein(
            cx, cy, a, b, reg_marginals=rho, epsilon=eps, divergence="kl",
            unbalanced_solver="sinkhorn", alpha=0, max_iter=3000, tol=1e-13,
            max_iter_ot=100000, tol_ot=1e-14, log=True)  # fmt: skip
    return plan, log["fugw_cost"]


def _masses(seed, n, m):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 1.5, n) / n, rng.uniform(0.5, 1.5, m) * 1.3 / m


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(4, 14), m=st.integers(4, 14),
       d=st.integers(1, 3), e=st.integers(1, 3), eps=st.sampled_from([0.2, 0.5]),
       rho=st.sampled_from([0.5, 2.0, (1.0, None), (None, 3.0)]))  # fmt: skip
def test_unbalanced_plan_and_cost_are_pots(seed, n, m, d, e, eps, rho):
    """UGW (Séjourné et al.): the plan, its mass and the objective equal POT's, weights of
    any mass (not normalized), ρ on both sides or one side balanced."""
    x, y, _, _ = _clouds(seed, n, m, d, e)
    a, b = _masses(seed, n, m)
    pot_rho = tuple(math.inf if r is None else r for r in rho) if isinstance(rho, tuple) else rho
    plan, cost = _pot_ugw(x, y, a, b, eps, pot_rho)
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), torch.tensor(a), torch.tensor(b),
                             eps=eps, rho=rho, tol=1e-12, inner_tol=1e-12,
                             inner_max_iter=100000, max_iter=3000, warn=False)  # fmt: skip
    dense = res.plan.dense().numpy()
    assert np.abs(dense - plan).sum() <= 1e-7 * plan.sum()
    assert float(res.cost) == pytest.approx(cost, rel=1e-7)
    assert res.rho == ((rho, rho) if not isinstance(rho, tuple) else rho)
    if isinstance(rho, tuple):  # a balanced side keeps its marginal
        side, w = (res.plan.row_sums(), a) if rho[0] is None else (res.plan.col_sums(), b)
        np.testing.assert_allclose(side.numpy(), w, rtol=1e-7)


def test_unbalanced_cosine_inner_cost_is_pots():
    x, y, _, _ = _clouds(3, 11, 9, 3, 2)
    a, b = _masses(3, 11, 9)
    plan, cost = _pot_ugw(x, y, a, b, 0.05, 1.0, metric="cosine")
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), torch.tensor(a), torch.tensor(b),
                             eps=0.05, rho=1.0, cost="cosine", tol=1e-12, inner_tol=1e-12,
                             inner_max_iter=100000, max_iter=3000, warn=False)  # fmt: skip
    assert np.abs(res.plan.dense().numpy() - plan).sum() <= 1e-7 * plan.sum()
    assert float(res.cost) == pytest.approx(cost, rel=1e-7)


def test_unbalanced_plan_products_carry_its_scale_and_large_rho_tends_to_balanced():
    """The plan's products, sums and dense form agree (the last solve's plan rescaled);
    as ρ grows the marginals approach a and b (mass m(a) = m(b) here)."""
    x, y, a, b = _clouds(4, 10, 8, 2, 2)
    res = gromov_wasserstein(torch.tensor(x), torch.tensor(y), torch.tensor(a), torch.tensor(b),
                             eps=0.3, rho=1.0, warn=False)  # fmt: skip
    dense, yt = res.plan.dense(), torch.tensor(y)
    torch.testing.assert_close(res.plan @ yt, dense @ yt)
    torch.testing.assert_close(res.plan.T @ torch.tensor(x), dense.T @ torch.tensor(x))
    torch.testing.assert_close(res.plan.row_sums(), dense.sum(1))
    gaps = []
    for rho in (1.0, 1e2, 1e4):
        r = gromov_wasserstein(torch.tensor(x), torch.tensor(y), torch.tensor(a), torch.tensor(b),
                               eps=0.3, rho=rho, warn=False)  # fmt: skip
        gaps.append(float((r.plan.row_sums() - torch.tensor(a)).abs().sum()))
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3


@pytest.mark.parametrize("rho", [0.0, -1.0, (None, None), (1.0, 2.0, 3.0), float("nan")])
def test_unbalanced_misuse_is_named(rho):
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="rho"):
        gromov_wasserstein(x, y, eps=0.1, rho=rho)


def test_unbalanced_weights_beyond_the_dtype_raise_naming_rho():
    """ρ far below the linearized cost's spread folds offsets into weights beyond float32:
    a FloatingPointError naming rho and the dtype, not a NaN or a failed input check."""
    torch.manual_seed(3)
    x, y = torch.randn(60, 3), torch.randn(50, 3)
    with pytest.raises(FloatingPointError, match=r"rho .*float32|float32.*rho"):
        gromov_wasserstein(x, y, eps=0.05, rho=1.0, relative_eps=True)
    res = gromov_wasserstein(x.double(), y.double(), eps=0.05, rho=1.0, relative_eps=True,
                             warn=False)  # fmt: skip
    assert math.isfinite(float(res.cost)) and float(res.plan.row_sums().sum()) > 0


@pytest.mark.parametrize("rho", [None, 2.0])
def test_early_steps_solve_loosely_and_the_last_to_inner_tol(rho, monkeypatch):
    from flashot.tasks import gromov

    x, y, a, b = (torch.as_tensor(t) for t in _clouds(7, 14, 11, 3, 2))
    asked = 1e-10
    tols = []
    solve = flashot.sinkhorn

    def recording(*args, **kwargs):
        tols.append(kwargs["tol"])
        return solve(*args, **kwargs)

    monkeypatch.setattr(flashot, "sinkhorn", recording)
    kw = dict(eps=0.05, relative_eps=True, rho=rho, tol=1e-8, inner_tol=asked)
    res = gromov_wasserstein(x, y, a, b, **kw)
    assert res.converged and tols[-1] == asked and tols[0] == gromov.INEXACT_MAX
    loose = [t for t in tols if t != asked]
    assert loose and all(asked < t <= gromov.INEXACT_MAX for t in loose)
    # every step at inner_tol: the same fixed point, in more inner iterations
    monkeypatch.setattr(gromov, "INEXACT_MAX", 0.0)
    exact = gromov_wasserstein(x, y, a, b, **kw)
    assert set(tols[len(res.inner_iterations) :]) == {asked}
    assert float(res.cost) == pytest.approx(float(exact.cost), rel=1e-7)
    assert sum(res.inner_iterations) < sum(exact.inner_iterations)
