"""flashot.compat.pot against POT itself (dense, float64) on the same inputs."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.compat import pot as fp

ot = pytest.importorskip("ot")

TIGHT = 1e-11  # both libraries to convergence: what remains is the solutions' agreement


def _data(seed, n=23, m=17, d=3, mass=1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = rng.normal(size=(m, d)) * 0.8 + 0.5
    a, b = rng.random(n) + 0.1, rng.random(m) + 0.1
    return x, y, mass * a / a.sum(), mass * b / b.sum()


def _pot(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (POT warns at its own numIterMax)
        return fn(*args, **kw)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), reg=st.sampled_from([0.2, 0.5, 2.0]),
       metric=st.sampled_from(["sqeuclidean", "cosine"]), uniform=st.booleans(),
       mass=st.sampled_from([1.0, 2.5]))  # fmt: skip
def test_the_values_are_pots(seed, reg, metric, uniform, mass):
    x, y, a, b = _data(seed, mass=mass)
    a, b = (None, None) if uniform else (a, b)
    if uniform and mass != 1.0:
        return
    opts = dict(metric=metric, stopThr=TIGHT, numIterMax=20000)
    ref = _pot(ot.bregman.empirical_sinkhorn2, x, y, reg, a, b, **opts)
    got = fp.empirical_sinkhorn2(x, y, reg, a, b, **opts)
    assert isinstance(got, np.floating | float)
    assert got == pytest.approx(ref, rel=1e-8, abs=1e-10)
    div = fp.empirical_sinkhorn_divergence(x, y, reg, a, b, **opts)
    # (POT's alternating iterations stall on the self problems (X_s, X_s): marginal error
    # ~1e-7 after 20 000 iterations at reg = 0.2, where flashot's symmetric ones reach
    # 1e-14 in 30; the 1e-6 is POT's)
    assert div == pytest.approx(_pot(ot.bregman.empirical_sinkhorn_divergence, x, y, reg, a,
                                     b, **opts), rel=1e-6, abs=1e-9)  # fmt: skip
    for reg_type in ("KL", "entropy"):
        kw = dict(a=a, b=b, metric=metric, reg=reg, reg_type=reg_type, tol=TIGHT,
                  max_iter=20000)  # fmt: skip
        r, q = _pot(ot.solve_sample, x, y, **kw), fp.solve_sample(x, y, **kw)
        assert q.value == pytest.approx(r.value, rel=1e-8, abs=1e-10)
        assert q.value_linear == pytest.approx(r.value_linear, rel=1e-8, abs=1e-10)
    assert np.allclose(q.plan.dense().numpy(), r.plan, rtol=1e-7, atol=1e-12)
    assert np.allclose(q.marginal_a, r.marginal_a, atol=1e-10)
    assert np.allclose(q.marginal_b, r.marginal_b, atol=1e-10)
    # (log u, log v) up to the constant moved between them
    du, dv = r.potentials[0] - q.potentials[0], r.potentials[1] - q.potentials[1]
    assert np.ptp(du) < 1e-6 and np.ptp(dv) < 1e-6 and abs(du.mean() + dv.mean()) < 1e-6


def test_debiased_solve_sample_is_pots():
    x, y, a, b = _data(1)
    kw = dict(a=a, b=b, reg=0.4, tol=TIGHT, max_iter=20000, debias=True)
    r, q = _pot(ot.solve_sample, x, y, **kw), fp.solve_sample(x, y, **kw)
    assert q.value == pytest.approx(r.value, rel=1e-8)
    assert q.value_linear == pytest.approx(r.value_linear, rel=1e-8)
    assert set(q.log) == {"res_ab", "res_aa", "res_bb"}


def test_torch_gradients_are_pots_autodiff_at_convergence():
    x, y, _, _ = _data(2)
    xs = [torch.tensor(x, requires_grad=True) for _ in range(4)]
    yt = torch.tensor(y)
    ref = _pot(ot.bregman.empirical_sinkhorn2, xs[0], yt, 0.5, stopThr=TIGHT, numIterMax=5000)
    got = fp.empirical_sinkhorn2(xs[1], yt, 0.5, stopThr=TIGHT)
    assert isinstance(got, torch.Tensor)
    (g_ref,), (g_got,) = torch.autograd.grad(ref, xs[0]), torch.autograd.grad(got, xs[1])
    assert torch.allclose(g_got, g_ref, atol=1e-8)
    ref = _pot(ot.solve_sample, xs[2], yt, reg=0.5, tol=TIGHT, max_iter=5000).value
    got = fp.solve_sample(xs[3], yt, reg=0.5, tol=TIGHT).value
    (g_ref,), (g_got,) = torch.autograd.grad(ref, xs[2]), torch.autograd.grad(got, xs[3])
    assert torch.allclose(g_got, g_ref, atol=1e-8)
    detached = fp.solve_sample(xs[3], yt, reg=0.5, grad="detach")
    assert not detached.value.requires_grad


def test_log_warmstart_and_result_attributes():
    x, y, a, b = _data(3, mass=2.0)
    _, log = fp.empirical_sinkhorn2(x, y, 0.3, a, b, log=True)
    assert {"niter", "err", "log_u", "log_v", "u", "v", "f", "g", "converged"} <= set(log)
    assert log["converged"] and log["err"][-1] <= 1e-9
    _, again = fp.empirical_sinkhorn2(x, y, 0.3, a, b, log=True,
                                      warmstart=(log["log_u"], log["log_v"]))  # fmt: skip
    assert again["niter"] < log["niter"] // 2  # (a solved start stops at the first checks)
    res = fp.solve_sample(x, y, a, b, reg=0.3)
    dense = res.plan.dense().numpy()
    assert dense.sum() == pytest.approx(2.0)  # POT's mass, not flashot's 1
    v = np.linspace(0, 1, len(y))
    assert np.allclose((res.plan @ torch.tensor(v)).numpy(), dense @ v)
    bary = dense @ y / dense.sum(1, keepdims=True)
    assert np.allclose(res.a_to_b, bary - x, atol=1e-9)
    assert res.status == "converged" and isinstance(res.potential_a, np.ndarray)
    with pytest.raises(NotImplementedError):
        _ = res.sparse_plan


def test_float32_stops_at_its_floor_not_at_numItermax():
    x, y, _, _ = _data(4, n=60, m=50)
    ref = _pot(ot.bregman.empirical_sinkhorn2, x, y, 0.1, stopThr=TIGHT, numIterMax=20000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", flashot.ConvergenceWarning)
        got, log = fp.empirical_sinkhorn2(x.astype(np.float32), y.astype(np.float32), 0.1,
                                          log=True)  # fmt: skip
    assert log["niter"] < 2000 and got.dtype == np.float32
    assert got == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("call,match", [
    (lambda x, y: fp.empirical_sinkhorn2(x, y, 0.1, metric="euclidean"), "metric='euclidean'"),
    (lambda x, y: fp.empirical_sinkhorn2(x, y, -1.0), "reg must be finite and > 0"),
    (lambda x, y: fp.empirical_sinkhorn2(x, y, 0.1, method="greenkhorn"), "method='greenkhorn'"),
    (lambda x, y: fp.empirical_sinkhorn2(x, y, 0.1, np.ones(len(x)), np.ones(len(y))),
     "same total mass"),
    (lambda x, y: fp.empirical_sinkhorn2(x, y, 0.1, np.ones(3)), r"a must have shape \(23,\)"),
    (lambda x, y: fp.solve_sample(x, y), "reg must be > 0"),
    (lambda x, y: fp.solve_sample(x, y, reg=0.1, unbalanced=1.0), "unbalanced.*rho"),
    (lambda x, y: fp.solve_sample(x, y, reg=0.1, debias="split"), "debias='split'"),
    (lambda x, y: fp.solve_sample(x, y, reg=0.1, reg_type="L2"), "reg_type"),
    (lambda x, y: fp.empirical_sinkhorn2(x, y, 0.1, stopThr=float("nan")), "stopThr"),
])  # fmt: skip
def test_misuse_is_named(call, match):
    x, y, _, _ = _data(5)
    with pytest.raises(ValueError, match=match):
        call(x, y)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        fp.empirical_sinkhorn2(x, y, 0.1, numItermax=10)  # (POT spells it numIterMax here)
