"""Shuffled regression: the generator, the loss's curvature, and the saddle escape."""

from __future__ import annotations

import warnings

import pytest
import torch

import flashot
from flashot.tasks.shuffled import (
    make_shuffled_regression,
    shuffled_regression,
    smallest_hessian_eigenvalue,
)

SOLVE = dict(backend="torch", tol=1e-7, max_iter=5000)


def test_generator_hides_a_permutation_of_a_linear_map():
    prob = make_shuffled_regression(50, 3, 2, noise=0.0, generator=torch.Generator().manual_seed(1))
    assert prob.X.shape == (50, 3) and prob.Y.shape == (50, 2) and prob.W.shape == (3, 2)
    torch.testing.assert_close(prob.Y, prob.X[prob.perm] @ prob.W)
    torch.testing.assert_close(prob.X.mean(0), torch.zeros(3, dtype=prob.X.dtype))
    assert sorted(prob.perm.tolist()) == list(range(50))
    assert prob.relative_error(prob.W) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(eps=0.0), "eps"),
        (dict(eps=0.1, method="sgd"), "method"),
        (dict(eps=0.1, max_steps=0), "max_steps"),
        (dict(eps=0.1, W0=torch.zeros(3, 3, dtype=torch.float64)), "W0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    prob = make_shuffled_regression(20, 1, 2)
    with pytest.raises(ValueError, match=match):
        shuffled_regression(prob.X, prob.Y, **kwargs)


def test_bad_data_is_named():
    prob = make_shuffled_regression(20, 1, 2)
    with pytest.raises(ValueError, match="Y must be a 2-D"):
        shuffled_regression(prob.X, prob.Y[:, 0], eps=0.1)
    with pytest.raises(ValueError, match="share dtype"):
        shuffled_regression(prob.X, prob.Y.float(), eps=0.1)


def test_smallest_eigenvalue_matches_the_dense_hessian():
    """Lanczos on double-backward HVPs against eigvalsh of the Hessian assembled by autograd."""
    prob = make_shuffled_regression(40, 2, 2, generator=torch.Generator().manual_seed(3))

    def loss(w):
        return flashot.sinkhorn(prob.X @ w, prob.Y, eps=0.1, **SOLVE).cost

    W = 0.3 * prob.W
    dense = torch.autograd.functional.hessian(lambda w: loss(w.view(2, 2)), W.reshape(-1))
    want = float(torch.linalg.eigvalsh((dense + dense.T) / 2)[0])
    assert abs(smallest_hessian_eigenvalue(loss, W) - want) <= 1e-6 * max(1.0, abs(want))


def test_zero_is_a_saddle_of_the_generated_problem():
    prob = make_shuffled_regression(40, 1, 2, generator=torch.Generator().manual_seed(1))
    W = torch.zeros(1, 2, dtype=prob.X.dtype, requires_grad=True)
    (grad,) = torch.autograd.grad(flashot.sinkhorn(prob.X @ W, prob.Y, eps=0.05, **SOLVE).cost, W)
    assert float(grad.norm()) < 1e-12

    def loss(w):
        return flashot.sinkhorn(prob.X @ w, prob.Y, eps=0.05, **SOLVE).cost

    assert smallest_hessian_eigenvalue(loss, W) < -0.1


@pytest.mark.slow
def test_the_hybrid_escapes_the_saddle_where_adam_stops():
    """From W = 0 (a saddle, gradient ~1e-17) Adam's first-order test stops at once; the
    hybrid finds the negative curvature, picks the side of W*, and recovers it to 5 %."""
    prob = make_shuffled_regression(100, 1, 2, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flashot.ConvergenceWarning)
        kw = dict(SOLVE, eps=0.05, eps_schedule="geomloss", momentum="auto")
        adam = shuffled_regression(prob.X, prob.Y, method="adam", max_steps=50, **kw)
        hybrid = shuffled_regression(prob.X, prob.Y, max_steps=50, **kw)
    assert adam.history[-1]["step"] == "converged" and prob.relative_error(adam.W) == 1.0
    steps = [e["step"] for e in hybrid.history]
    assert "negative_curvature" in steps and hybrid.converged
    assert hybrid.history[-1]["lambda_min"] > 0
    assert prob.relative_error(hybrid.W) < 0.05
