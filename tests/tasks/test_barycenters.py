"""Free-support barycenters against POT 0.9.7 and the stationarity of the debiased one."""

import warnings

import numpy as np
import pytest
import torch

import flashot
from flashot.tasks.barycenters import free_support_barycenter

ot = pytest.importorskip("ot")

INNER = dict(inner_tol=1e-12, inner_max_iter=100000)


def _clouds(seed):
    rng = np.random.default_rng(seed)
    ys = [rng.normal(size=(14, 2)) + np.array([2.0, 0.0]), rng.normal(size=(11, 2)) * 0.5 - 1.0,
          rng.normal(size=(9, 2))]  # fmt: skip
    ws = [rng.random(len(y)) + 0.1 for y in ys]
    return ys, [w / w.sum() for w in ws], rng.normal(size=(7, 2))


@pytest.mark.parametrize("seed,eps", [(0, 0.3), (1, 1.0)])
def test_the_steps_are_pots(seed, eps):
    ys, ws, x0 = _clouds(seed)
    lambdas = np.array([0.5, 0.3, 0.2])
    b = np.random.default_rng(seed + 9).random(len(x0)) + 0.5
    b /= b.sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, log = ot.bregman.free_support_sinkhorn_barycenter(
            ys, ws, x0, eps, b=b, weights=lambdas, numItermax=12, numInnerItermax=100000,
            stopThr=0.0, log=True)  # fmt: skip
    res = free_support_barycenter(ys, x0, eps=eps, cloud_weights=ws, lambdas=lambdas, b=b,
                                  max_iter=12, tol=0.0, warn=False, **INNER)  # fmt: skip
    assert res.n_iter == 12 and not res.converged
    np.testing.assert_allclose(res.points.numpy(), ref, rtol=0, atol=1e-7)
    np.testing.assert_allclose(res.displacements, log["displacement_square_norms"], rtol=1e-5)


def test_the_debiased_barycenter_is_a_stationary_point_of_the_divergences():
    ys, ws, x0 = _clouds(2)
    res = free_support_barycenter(ys, x0, eps=1.0, cloud_weights=ws, debias=True,
                                  max_iter=400, tol=1e-6, warn=False, **INNER)  # fmt: skip
    x = res.points.clone().requires_grad_(True)
    total = sum(flashot.sinkhorn_divergence(x, torch.tensor(y), res.weights, torch.tensor(w),
                                            eps=1.0, tol=1e-12, max_iter=100000)
                for y, w in zip(ys, ws, strict=True)) / 3  # fmt: skip
    (grad,) = torch.autograd.grad(total, x)
    assert float(grad.abs().max()) < 1e-5
    # (the plain one is not: its entropic bias pulls the points inward)
    plain = free_support_barycenter(ys, x0, eps=1.0, cloud_weights=ws, max_iter=30,
                                    tol=1e-8, warn=False, **INNER)  # fmt: skip
    x = plain.points.clone().requires_grad_(True)
    total = sum(flashot.sinkhorn_divergence(x, torch.tensor(y), plain.weights,
                                            torch.tensor(w), eps=1.0, tol=1e-12)
                for y, w in zip(ys, ws, strict=True)) / 3  # fmt: skip
    assert float(torch.autograd.grad(total, x)[0].abs().max()) > 1e-3


def test_one_cloud_is_its_own_debiased_barycenter():
    ys, ws, _ = _clouds(3)
    res = free_support_barycenter(ys[:1], ys[0], eps=0.4, cloud_weights=ws[:1], b=ws[0],
                                  debias=True, max_iter=5, tol=1e-10, **INNER)  # fmt: skip
    assert res.converged
    np.testing.assert_allclose(res.points.numpy(), ys[0], atol=1e-8)


def test_a_missed_tolerance_warns():
    ys, _, x0 = _clouds(4)
    with pytest.warns(flashot.ConvergenceWarning, match="max_iter=2"):
        res = free_support_barycenter(ys, x0, eps=0.5, max_iter=2, tol=0.0)
    assert res.n_iter == 2 and len(res.displacements) == 2


@pytest.mark.parametrize("kw,match", [
    (dict(eps=-1.0), "eps"), (dict(eps=0.1, max_iter=0), "max_iter"),
    (dict(eps=0.1, tol=-1.0), "tol"), (dict(eps=0.1, lambdas=[1.0]), "lambdas must have shape"),
    (dict(eps=0.1, b=np.ones(3)), "b must have shape"),
    (dict(eps=0.1, cloud_weights=[None]), "one array per cloud"),
    (dict(eps=0.1, cloud_weights=[-np.ones(14), None, None]), "non-negative"),
])  # fmt: skip
def test_misuse_is_named(kw, match):
    ys, _, x0 = _clouds(5)
    with pytest.raises(ValueError, match=match):
        free_support_barycenter(ys, x0, **kw)


def test_clouds_must_match_the_support():
    ys, _, x0 = _clouds(5)
    with pytest.raises(ValueError, match=r"clouds\[1\] must be"):
        free_support_barycenter([ys[0], ys[1][:, :1]], x0, eps=0.1)
    with pytest.raises(TypeError, match="clouds must be"):
        free_support_barycenter([], x0, eps=0.1)
    with pytest.raises(ValueError, match="non-finite"):
        free_support_barycenter(ys, np.full_like(x0, np.nan), eps=0.1)
