"""Over-relaxed alternating updates (flashot.solver.momentum, ``sinkhorn(momentum=...)``)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.solver.momentum import RATE_CAP, Relaxation
from tests.conftest import clouds, rel, weights
from tests.references import dense_cost, entropic_ot, plan_dense


def problem(seed, n=40, m=30, d=2):
    gen = torch.Generator().manual_seed(seed)
    x, y = clouds(gen, n, m, d, shift=0.5)
    return x, y, weights(gen, n), weights(gen, m)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), eps=st.sampled_from([0.05, 0.3, 2.0]),
       rho=st.sampled_from([None, 1.0]), momentum=st.sampled_from(["auto", 1.3, 1.7]))  # fmt: skip
def test_relaxed_solve_converges_to_the_dense_solution(seed, eps, rho, momentum):
    """Any ω in (0, 2) has Sinkhorn's fixed point: the value is the dense float64
    reference's, and the returned plan meets both marginal conditions to ~tol."""
    x, y, a, b = problem(seed)
    res = flashot.sinkhorn(x, y, a, b, eps=eps, rho=rho, tol=1e-9, max_iter=20_000,
                           momentum=momentum)  # fmt: skip
    assert res.converged
    want = entropic_ot(x, y, a, b, eps, rho=(rho, rho))
    assert rel(res.cost, want) < 1e-7
    if rho is None:
        P = plan_dense(dense_cost(x, y), a, b, res.f.detach(), res.g.detach(), eps)
        assert (P.sum(1) - a).abs().sum() + (P.sum(0) - b).abs().sum() < 1e-7


@pytest.mark.parametrize("eps", [0.01, 0.05])
def test_auto_momentum_needs_far_fewer_iterations_at_small_eps(eps):
    """Measured on the README's clouds (benchmarks/NOTES.md): 3.4–4.6× fewer; asserted 2×."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(250, 3, generator=gen, dtype=torch.float64)
    kw = dict(eps=eps, tol=1e-6, max_iter=20_000, update="alternating")
    plain = flashot.sinkhorn(x, y, **kw)
    fast = flashot.sinkhorn(x, y, momentum="auto", **kw)
    assert plain.converged and fast.converged
    assert fast.n_iter * 2 <= plain.n_iter
    assert rel(fast.cost, plain.cost) < 1e-8


def test_divergence_takes_momentum():
    x, y, a, b = problem(3)
    kw = dict(eps=0.05, tol=1e-9, max_iter=20_000)
    plain = flashot.sinkhorn_divergence(x, y, a, b, **kw)
    assert rel(flashot.sinkhorn_divergence(x, y, a, b, momentum="auto", **kw), plain) < 1e-7


def test_relaxation_sets_the_sor_optimum_from_the_measured_rate():
    relax = Relaxation("auto")
    relax.observe(10, 1e-2)
    assert relax.omega == 1.0  # one check measures no rate
    relax.observe(20, 1e-3)  # rate 0.1^(1/10) per iteration
    r = 0.1**0.1
    assert relax.omega == pytest.approx(2.0 / (1.0 + math.sqrt(1.0 - r)))
    relax.observe(30, 2e-3)  # the error grew: plain updates for good
    assert relax.omega == 1.0
    relax.observe(40, 1e-4)
    assert relax.omega == 1.0
    slow = Relaxation("auto")
    slow.observe(10, 1.0)
    slow.observe(20, 0.9999999)
    assert slow.omega == pytest.approx(2.0 / (1.0 + math.sqrt(1.0 - RATE_CAP)))
    fixed = Relaxation(1.4)
    fixed.observe(10, 1e-2)
    fixed.observe(20, 1e-4)
    assert fixed.omega == 1.4


@pytest.mark.parametrize("momentum,kw,match", [
    (2.0, {}, r"in \(0, 2\)"), (0.0, {}, r"in \(0, 2\)"), (float("nan"), {}, r"in \(0, 2\)"),
    ("fast", {}, "'auto'"), ("auto", {"tol": None}, "give a tol"),
    (1.5, {"update": "symmetric"}, "update='symmetric'"),
])  # fmt: skip
def test_bad_momentum_is_a_clear_error(momentum, kw, match):
    x, y, *_ = problem(1, n=5, m=4)
    with pytest.raises(ValueError, match=match):
        flashot.sinkhorn(x, y, eps=0.5, momentum=momentum, **kw)


@pytest.mark.parametrize("momentum", [True, [1.5]])
def test_momentum_of_the_wrong_type_is_a_type_error(momentum):
    x, y, *_ = problem(1, n=5, m=4)
    with pytest.raises(TypeError, match="momentum"):
        flashot.sinkhorn(x, y, eps=0.5, momentum=momentum)


def test_fixed_momentum_replays_with_tol_none():
    """A float ω needs no check: a fixed-iteration solve (the replayed path) relaxes too
    and lands on the plain solve's fixed point."""
    x, y, a, b = problem(2)
    kw = dict(eps=0.3, tol=None, max_iter=400, update="alternating")
    plain = flashot.sinkhorn(x, y, a, b, **kw)
    assert rel(flashot.sinkhorn(x, y, a, b, momentum=1.5, **kw).cost, plain.cost) < 1e-10
