"""torch.func over flashot's losses (flashot.autodiff.functional): one level of reverse
mode equals torch.autograd on the same call; anything else is a clear error."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from tests.conftest import clouds as draw_clouds
from tests.conftest import rel, weights


def clouds(seed, n=9, m=7, d=2):
    gen = torch.Generator().manual_seed(seed)
    x, y = draw_clouds(gen, n, m, d, shift=0.3)
    return x, y, weights(gen, n, floor=0.2), weights(gen, m, floor=0.2)


def ot(x, y, a, b, rho):
    return flashot.sinkhorn(x, y, a, b, eps=0.3, rho=rho, tol=1e-10).cost


def divergence(x, y, a, b, rho):
    return flashot.sinkhorn_divergence(x, y, a, b, eps=0.3, rho=rho, tol=1e-10)


def samples_loss(x, y, a, b, rho):
    return flashot.SamplesLoss(blur=0.4, reach=rho)(a, x, b, y)


LOSSES = {"sinkhorn": ot, "divergence": divergence, "SamplesLoss": samples_loss}


def autograd_grads(loss, args, rho, wrt):
    leaves = [t.clone().requires_grad_() if i in wrt else t for i, t in enumerate(args)]
    value = loss(*leaves, rho)
    return value, torch.autograd.grad(value, [leaves[i] for i in wrt])


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(LOSSES)), seed=st.integers(0, 2**31 - 1),
       rho=st.sampled_from([None, 1.0]),
       wrt=st.sampled_from([(0,), (1,), (0, 1), (0, 2), (0, 1, 2, 3)]))  # fmt: skip
def test_func_grad_equals_autograd(name, seed, rho, wrt):
    """torch.func.grad over any argument subset (points and weights, balanced or not)
    gives torch.autograd.grad's gradients, and the value is the plain call's."""
    loss, args = LOSSES[name], clouds(seed)
    value, want = autograd_grads(loss, args, rho, wrt)

    def f(*tracked):
        full = list(args)
        for i, t in zip(wrt, tracked, strict=True):
            full[i] = t
        out = loss(*full, rho)
        return out, out

    got, val = torch.func.grad(f, argnums=tuple(range(len(wrt))), has_aux=True)(
        *(args[i] for i in wrt)
    )
    assert float(val) == pytest.approx(float(value), rel=1e-12, abs=1e-14)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and rel(g, w) < 1e-10


def test_func_vjp_and_jacrev_equal_autograd():
    x, y, a, b = clouds(3)
    f = lambda x: flashot.sinkhorn(x, y, a, b, eps=0.3, tol=1e-10).cost  # noqa: E731
    _, (want,) = autograd_grads(lambda x, y, a, b, rho: f(x), (x, y, a, b), None, (0,))
    _, pullback = torch.func.vjp(f, x)
    (g,) = pullback(torch.tensor(2.0, dtype=x.dtype))
    assert rel(g, 2.0 * want) < 1e-10
    assert rel(torch.func.jacrev(f)(x), want) < 1e-10


def test_func_grad_keeps_the_result_fields():
    """``sinkhorn`` under torch.func.grad still returns the whole result (potentials,
    iterations, plan); only ``cost`` carries the transform."""
    x, y, a, b = clouds(4)
    seen = {}

    def f(x):
        res = flashot.sinkhorn(x, y, a, b, eps=0.3, tol=1e-10)
        seen["res"] = res
        return res.cost

    torch.func.grad(f)(x)
    plain = flashot.sinkhorn(x, y, a, b, eps=0.3, tol=1e-10)
    res = seen["res"]
    assert res.n_iter == plain.n_iter and rel(res.f.detach(), plain.f) < 1e-12
    assert res.converged and rel(res.plan @ y, plain.plan @ y) < 1e-12


@pytest.mark.parametrize("transform", ["hessian", "jacrev(grad)", "jacfwd", "jvp", "vmap"])
def test_unsupported_transforms_are_a_clear_error(transform):
    """Nested or forward-mode transforms would see the saved gradients as constants
    (a silently zero Hessian): they raise and say what to use instead."""
    x, y, *_ = clouds(5)
    f = lambda x: flashot.sinkhorn(x, y, eps=0.3).cost  # noqa: E731
    calls = {
        "hessian": lambda: torch.func.hessian(f)(x),
        "jacrev(grad)": lambda: torch.func.jacrev(torch.func.grad(f))(x),
        "jacfwd": lambda: torch.func.jacfwd(f)(x),
        "jvp": lambda: torch.func.jvp(f, (x,), (x,)),
        "vmap": lambda: torch.func.vmap(f)(x[None]),
    }
    with pytest.raises(RuntimeError, match=r"create_graph=True\) or flashot\.hvp"):
        calls[transform]()


def test_non_scalar_values_are_a_clear_error():
    x, y, *_ = clouds(6)
    loss = flashot.SamplesLoss(blur=0.4)
    with pytest.raises(RuntimeError, match=r"a value of shape \(2,\)"):
        torch.func.grad(lambda x: loss(x, torch.stack([y, y])).sum())(torch.stack([x, x]))


@pytest.mark.skipif("triton" not in available_backends(), reason="needs triton")
def test_func_grad_through_the_triton_kernels():
    x, y, a, b = (t.float() for t in clouds(7))
    f = lambda x: flashot.sinkhorn(x, y, a, b, eps=0.3, backend="triton").cost  # noqa: E731
    _, (want,) = autograd_grads(lambda x, y, a, b, rho: f(x), (x, y, a, b), None, (0,))
    assert rel(torch.func.grad(f)(x), want) < 1e-6
