import pytest
import torch

import flashot
from tests.conftest import clouds, rel, weights
from tests.references import entropic_ot

F64 = torch.float64


def test_divergence_is_debiased_ot(gen):
    x, y = clouds(gen, 20, 15, 2)
    a, b = weights(gen, 20), weights(gen, 15)
    s = flashot.sinkhorn_divergence(x, y, a, b, eps=0.3, tol=1e-12, max_iter=20000)
    ref = (
        entropic_ot(x, y, a, b, 0.3)
        - 0.5 * entropic_ot(x, x, a, a, 0.3)
        - 0.5 * entropic_ot(y, y, b, b, 0.3)
    )
    assert rel(s, ref) < 1e-9


def test_unbalanced_divergence_is_sejourne(gen):
    x, y = clouds(gen, 15, 12, 2)
    a, b = 1.5 * weights(gen, 15), 0.7 * weights(gen, 12)
    rho, eps = 0.6, 0.3
    s = flashot.sinkhorn_divergence(x, y, a, b, eps=eps, rho=rho, tol=1e-12, max_iter=50000)
    r = (rho, rho)
    ref = (
        entropic_ot(x, y, a, b, eps, rho=r)
        - 0.5 * entropic_ot(x, x, a, a, eps, rho=r)
        - 0.5 * entropic_ot(y, y, b, b, eps, rho=r)
        + eps / 2 * (a.sum() - b.sum()) ** 2
    )
    assert rel(s, ref) < 1e-9


def test_zero_on_identical_measures_and_positive_otherwise(gen):
    x, y = clouds(gen, 25, 25, 3)
    assert abs(flashot.sinkhorn_divergence(x, x.clone(), eps=0.2, tol=1e-11).item()) < 1e-10
    assert flashot.sinkhorn_divergence(x, y, eps=0.2, tol=1e-9).item() > 0.1


@pytest.mark.parametrize("rho", [None, 0.8])
def test_gradcheck(gen, rho):
    x, y = clouds(gen, 5, 4, 2)
    a, b = weights(gen, 5), weights(gen, 4)
    inputs = [t.clone().requires_grad_() for t in (x, y, a, b)]

    def fn(x, y, a, b):
        return flashot.sinkhorn_divergence(x, y, a, b, eps=0.5, rho=rho, tol=1e-14, max_iter=100000)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_flow_decreases_divergence(gen):
    x, y = clouds(gen, 30, 30, 2)
    x.requires_grad_()
    s0 = flashot.sinkhorn_divergence(x, y, eps=0.1, tol=1e-6)
    (gx,) = torch.autograd.grad(s0, x)
    x1 = (x - 0.5 * 30 * gx).detach()  # gradient step, scaled by 1/a_i
    assert flashot.sinkhorn_divergence(x1, y, eps=0.1, tol=1e-6) < 0.5 * s0


def test_asymmetric_rho_combines_three_relaxed_solves_like_the_dense_reference(gen):
    """rho=(ρ_x, ρ_y): OT(a, b) − ½ OT(a, a) − ½ OT(b, b) + ε/2 (m(a) − m(b))², each OT
    relaxed with (ρ_x, ρ_y), against the float64 dense primal values; S(a, a) = 0; the
    formula with ρ_x = ρ_y is the symmetric divergence."""
    from tests.references import entropic_ot

    x, y = clouds(gen, 12, 9, 2)
    a = torch.rand(12, generator=gen, dtype=torch.float64) + 0.1
    b = 2.0 * (torch.rand(9, generator=gen, dtype=torch.float64) + 0.1)
    eps, rho = 0.4, (1.5, 0.7)
    kw = dict(eps=eps, tol=1e-12, max_iter=50_000, backend="torch")
    got = flashot.sinkhorn_divergence(x, y, a, b, rho=rho, **kw)
    ref = (entropic_ot(x, y, a, b, eps, rho=rho) - 0.5 * entropic_ot(x, x, a, a, eps, rho=rho)
           - 0.5 * entropic_ot(y, y, b, b, eps, rho=rho)
           + 0.5 * eps * (a.sum() - b.sum()) ** 2)  # fmt: skip
    assert float(got) == pytest.approx(float(ref), rel=1e-8)
    assert abs(float(flashot.sinkhorn_divergence(x, x, a, a, rho=rho, **kw))) < 1e-10
    sym = flashot.sinkhorn_divergence(x, y, a, b, rho=1.5, **kw)
    both = (entropic_ot(x, y, a, b, eps, rho=(1.5, 1.5))
            - 0.5 * entropic_ot(x, x, a, a, eps, rho=(1.5, 1.5))
            - 0.5 * entropic_ot(y, y, b, b, eps, rho=(1.5, 1.5))
            + 0.5 * eps * (a.sum() - b.sum()) ** 2)  # fmt: skip
    assert float(sym) == pytest.approx(float(both), rel=1e-8)


def test_warm_start_reaches_the_same_divergence_in_fewer_iterations():
    """init=(f, g) of OT(a, b) from an earlier solve (POT/OTT warm starts)."""
    import warnings

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(40, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(30, 2, generator=gen, dtype=torch.float64) + 1.0
    kw = dict(eps=0.05, tol=1e-9, backend="torch", update="alternating", max_iter=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cold solve misses tol in 200 iterations
        cold = flashot.sinkhorn_divergence(x, y, **kw)
    ref = flashot.sinkhorn(x, y, eps=0.05, tol=1e-11, max_iter=20000, backend="torch")
    warm = flashot.sinkhorn_divergence(x, y, init=(ref.f, ref.g), **kw)  # no warning
    exact = flashot.sinkhorn_divergence(x, y, eps=0.05, tol=1e-11, max_iter=20000,
                                        backend="torch")  # fmt: skip
    assert float(warm) == pytest.approx(float(exact), rel=1e-8)
    assert abs(float(cold) - float(exact)) > abs(float(warm) - float(exact))
    with pytest.raises(ValueError, match=r"init\[0\] \(f\) must have shape \(40,\)"):
        flashot.sinkhorn_divergence(x, y, init=(ref.g, ref.g), **kw)
