"""flashot.compat.pot's matrix calls (sinkhorn, sinkhorn2) against POT 0.9.7 on the same M."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.compat import pot as fp

ot = pytest.importorskip("ot")

TIGHT = 1e-12


def _problem(seed, n=19, m=13, mass=1.0, uniform=False):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, 2)), rng.normal(size=(m, 2)) + 0.3
    M = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    if uniform:
        return None, None, M
    a, b = rng.random(n) + 0.05, rng.random(m) + 0.05
    return mass * a / a.sum(), mass * b / b.sum(), M


def _pot(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10**6), reg=st.sampled_from([0.05, 0.3, 3.0]),
       uniform=st.booleans(), mass=st.sampled_from([1.0, 3.0]))  # fmt: skip
def test_plan_value_and_log_are_pots(seed, reg, uniform, mass):
    a, b, M = _problem(seed, mass=mass, uniform=uniform)
    kw = dict(numItermax=200000, stopThr=TIGHT)
    pa, pb = ([], []) if uniform else (a, b)
    ref_plan, ref_log = _pot(ot.sinkhorn, pa, pb, M, reg, method="sinkhorn_log", log=True, **kw)
    plan, log = fp.sinkhorn(pa, pb, M, reg, log=True, **kw)
    assert isinstance(plan, np.ndarray) and plan.shape == M.shape
    np.testing.assert_allclose(plan, ref_plan, rtol=1e-7, atol=1e-13)
    assert log["converged"] and log["err"][-1] <= TIGHT
    du = ref_log["log_u"] - log["log_u"]  # (POT's scalings, up to a constant moved between them)
    dv = ref_log["log_v"] - log["log_v"]
    assert np.ptp(du) < 1e-6 and np.ptp(dv) < 1e-6 and abs(du.mean() + dv.mean()) < 1e-6
    np.testing.assert_allclose(log["u"][:, None] * np.exp(-M / reg) * log["v"][None, :], plan,
                               rtol=1e-10, atol=1e-250)  # fmt: skip
    value = fp.sinkhorn2(pa, pb, M, reg, **kw)
    assert value == pytest.approx(_pot(ot.sinkhorn2, pa, pb, M, reg, method="sinkhorn_log",
                                       **kw), rel=1e-9)  # fmt: skip
    assert value == pytest.approx(float((plan * M).sum()), rel=1e-12)


def test_marginals_hold_to_the_threshold_in_float32():
    a, b, M = _problem(3)
    plan = fp.sinkhorn(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32),
                       torch.tensor(M, dtype=torch.float32), 0.5)  # fmt: skip
    assert plan.dtype == torch.float32
    err = (plan.sum(1) - torch.tensor(a)).abs().sum() + (plan.sum(0) - torch.tensor(b)).abs().sum()
    assert float(err) <= 1e-5


def test_torch_gradients_are_pots_autodiff():
    a, b, M = _problem(5)
    Mt = [torch.tensor(M, requires_grad=True) for _ in range(2)]
    at = [torch.tensor(a, requires_grad=True) for _ in range(2)]
    ref = _pot(ot.sinkhorn2, at[0], torch.tensor(b), Mt[0], 0.4, stopThr=TIGHT, numItermax=5000)
    got = fp.sinkhorn2(at[1], torch.tensor(b), Mt[1], 0.4, stopThr=TIGHT, numItermax=5000)
    assert isinstance(got, torch.Tensor)
    ref.backward()
    got.backward()
    torch.testing.assert_close(Mt[1].grad, Mt[0].grad, rtol=1e-6, atol=1e-9)
    ga, gr = at[1].grad, at[0].grad  # (defined up to a constant: the masses are tied)
    torch.testing.assert_close(ga - ga.mean(), gr - gr.mean(), rtol=1e-6, atol=1e-9)


def test_warmstart_from_a_solution_converges_at_once():
    a, b, M = _problem(7)
    _, log = fp.sinkhorn(a, b, M, 0.2, log=True, stopThr=TIGHT, numItermax=100000)
    _, again = fp.sinkhorn(a, b, M, 0.2, log=True, stopThr=1e-10,
                           warmstart=(log["log_u"], log["log_v"]))  # fmt: skip
    assert again["niter"] == 10


def test_a_missed_threshold_warns():
    a, b, M = _problem(9)
    with pytest.warns(flashot.ConvergenceWarning, match="numItermax=3"):
        _, log = fp.sinkhorn(a, b, M, 0.01, numItermax=3, log=True)
    assert not log["converged"] and log["niter"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp.sinkhorn2(a, b, M, 0.01, numItermax=3, warn=False)


@pytest.mark.parametrize("call,match", [
    (lambda a, b, M: fp.sinkhorn(a, b, M, -1.0), "reg"),
    (lambda a, b, M: fp.sinkhorn(a, b, M, 0.1, numItermax=0), "numItermax"),
    (lambda a, b, M: fp.sinkhorn(a, b, M, 0.1, stopThr=-1), "stopThr"),
    (lambda a, b, M: fp.sinkhorn(a[:-1], b, M, 0.1), "a must have shape"),
    (lambda a, b, M: fp.sinkhorn(a, 2 * b, M, 0.1), "same total mass"),
    (lambda a, b, M: fp.sinkhorn(a, np.stack([b, b], 1), M, 0.1), "several columns"),
    (lambda a, b, M: fp.sinkhorn(a, b, M[0], 0.1), "M must be"),
    (lambda a, b, M: fp.sinkhorn(a, b, np.where(M > 1, np.inf, M), 0.1), "M must be finite"),
    (lambda a, b, M: fp.sinkhorn(-a, b, M, 0.1), "non-negative"),
    (lambda a, b, M: fp.sinkhorn(a, b, M, 0.1, method="greenkhorn"), "greenkhorn"),
    (lambda a, b, M: fp.sinkhorn2(a, b, M, 0.1, numIterMax=5), "numIterMax"),
])  # fmt: skip
def test_misuse_is_named(call, match):
    a, b, M = _problem(11)
    with pytest.raises((ValueError, TypeError), match=match):
        call(a, b, M)
