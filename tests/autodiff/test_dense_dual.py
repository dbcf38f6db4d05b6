"""The small-problem direct dual solve against the streamed CG and finite differences."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.autodiff import dense_dual

F64 = torch.float64
TIGHT = dict(tol=1e-12, max_iter=50_000)


def _clouds(seed, n, m, d):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(m, d, generator=gen, dtype=F64) * 0.8 + 0.4
    a = torch.rand(n, generator=gen, dtype=F64) + 0.1
    b = torch.rand(m, generator=gen, dtype=F64) + 0.1
    v = torch.randn(n, d, generator=gen, dtype=F64)
    return x, y, a, b, v


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 30), m=st.integers(2, 30),
       d=st.integers(1, 4), eps=st.sampled_from([0.05, 0.3, 2.0]),
       rho=st.sampled_from([None, 1.0, (None, 0.5), (2.0, None)]),
       cost=st.sampled_from(["sqeuclidean", "cosine"]))  # fmt: skip
def test_the_direct_solve_is_the_cgs_answer(seed, n, m, d, eps, rho, cost):
    x, y, a, b, v = _clouds(seed, n, m, d)
    if cost == "cosine" and d == 1:
        return
    opts = dict(eps=eps, rho=rho, cost=cost, **TIGHT)
    with flashot.record_dual_solves() as log:
        direct = flashot.hvp(x, y, v, a, b, **opts)
    assert [i.n_iter for i in log] == [0] and log.last.residual < 1e-12
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dense_dual, "DENSE_UP_TO", 0)
        streamed = flashot.hvp(x, y, v, a, b, cg_tol=1e-13, **opts)
    assert torch.allclose(direct, streamed, rtol=1e-8, atol=1e-10 * streamed.abs().max())


def test_packed_batches_and_several_directions(monkeypatch):
    """One factor serves a packed batch (one null vector per problem) and k directions."""
    x = torch.stack([torch.randn(20, 2, dtype=F64), torch.randn(20, 2, dtype=F64)])
    y = torch.stack([torch.randn(15, 2, dtype=F64) + 0.5, torch.randn(15, 2, dtype=F64)])
    xg = x.clone().requires_grad_()
    vx = torch.randn(x.shape, dtype=F64)

    def hv():
        cost = flashot.sinkhorn(xg, y, eps=0.3, **TIGHT).cost.sum()
        (grad,) = torch.autograd.grad(cost, xg, create_graph=True)
        return torch.autograd.grad(grad, xg, vx)[0]

    with flashot.record_dual_solves() as log:
        direct = hv()
    assert log.last.n_iter == 0
    monkeypatch.setattr(dense_dual, "DENSE_UP_TO", 0)
    assert torch.allclose(direct, hv(), rtol=1e-6, atol=1e-9)
    monkeypatch.undo()
    x1, y1, a, b, _ = _clouds(3, 25, 20, 3)
    vs = torch.randn(4, 25, 3, dtype=F64)
    many = flashot.hvp(x1, y1, vs, a, b, eps=0.2, **TIGHT)
    one = torch.stack([flashot.hvp(x1, y1, v, a, b, eps=0.2, **TIGHT) for v in vs])
    assert torch.allclose(many, one, rtol=1e-9, atol=1e-12)


def test_the_factor_is_kept_for_the_same_potentials(monkeypatch):
    x, y, a, b, v = _clouds(4, 30, 20, 2)
    calls = []
    real = dense_dual._factor
    monkeypatch.setattr(dense_dual, "_factor", lambda *args: calls.append(1) or real(*args))
    xg = x.clone().requires_grad_()
    cost = flashot.sinkhorn(xg, y, a, b, eps=0.3, **TIGHT).cost
    (grad,) = torch.autograd.grad(cost, xg, create_graph=True)
    outs = [torch.autograd.grad(grad, xg, w, retain_graph=True)[0] for w in (v, 2 * v, -v)]
    assert len(calls) == 1  # three solves, one factorization
    assert torch.allclose(outs[1], 2 * outs[0]) and torch.allclose(outs[2], -outs[0])
    x.add_(0.0)  # (a new problem on other potentials refactors)
    cost = flashot.sinkhorn(xg.detach() + 0.1, y, a, b, eps=0.3, **TIGHT).cost
    assert len(calls) == 1


@pytest.mark.parametrize("n", [600])
def test_lanczos_on_a_hessian_operator_is_fast(n):
    """Lanczos over repeated HVPs of one solve: direct dual solves, one factor."""
    import time

    x, y, a, b, _ = _clouds(5, n, 500, 3)
    xg = x.clone().requires_grad_()
    cost = flashot.sinkhorn(xg, y, a, b, eps=0.5, **TIGHT).cost
    (grad,) = torch.autograd.grad(cost, xg, create_graph=True)

    def matvec(w):
        return torch.autograd.grad(grad, xg, w.reshape(x.shape), retain_graph=True)[0].reshape(-1)

    start = time.perf_counter()
    res = flashot.linalg.lanczos(matvec, x.numel(), k=1, which="largest")
    assert res.converged and time.perf_counter() - start < 30
