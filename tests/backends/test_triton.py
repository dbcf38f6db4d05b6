"""Triton-specific paths (column splits, feature chunks, the one-exp fast path), run in
Triton's interpreter on CPU and natively on a GPU."""

import math

import pytest
import torch

import flashot
from flashot.backends import available_backends
from flashot.costs import attention_form, get_cost
from tests.backends.test_contract import dense_attend, problem
from tests.conftest import clouds, rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def triton_backend(**kw):
    from flashot.backends.triton import TritonBackend

    return TritonBackend(**kw)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize(
    "n,m,d,p", [(1, 37, 3, 1), (40, 300, 5, 20), (9, 50, 37, 3), (3, 20, 1000, 2)]
)
def test_row_attend_splits_chunks_and_value_tiles(gen, splits, n, m, d, p):
    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    v = torch.randn(m, p, generator=gen).to(DEVICE)
    lse, out = triton_backend(splits=splits).row_attend(form, h, 0.4, v)
    ref_lse, ref_out = dense_attend(form, h, 0.4, v)
    assert rel(lse.cpu(), ref_lse.cpu()) < 2e-5 and rel(out.cpu(), ref_out.cpu()) < 2e-5


def test_non_contiguous_inputs(gen):
    form, h = problem(gen, 30, 40, 6, torch.float32, DEVICE)
    qt = form.q.T.contiguous().T  # same values, column-major strides
    kt = torch.stack([form.k, form.k], 2)[..., 0]  # stride (2d, 2)
    strided = type(form)(qt, kt, form.alpha, form.beta)
    assert not kt.is_contiguous()
    lse, _ = triton_backend().row_attend(strided, h, 0.3)
    assert rel(lse.cpu(), dense_attend(form, h, 0.3, None)[0].cpu()) < 2e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_plan_sums_match_dense(gen, splits):
    form, _ = problem(gen, 33, 45, 4, torch.float32, DEVICE)
    f, g = torch.randn(33, generator=gen).to(DEVICE), torch.randn(45, generator=gen).to(DEVICE)
    a, b = torch.rand(33, generator=gen).to(DEVICE), torch.rand(45, generator=gen).to(DEVICE)
    a[3] = 0.0
    r, c = triton_backend(splits=splits).plan_sums(form, f, g, a.log(), b.log(), 0.7)
    E = torch.exp((f.double()[:, None] + g.double()[None] - form.dense().double()) / 0.7)
    assert rel(r.cpu(), (E @ b.double()).cpu()) < 2e-5
    assert rel(c.cpu(), (a.double() @ E).cpu()) < 2e-5


@pytest.mark.parametrize("rho", [(None, None), (0.5, 0.5), (0.5, None)])
def test_fast_jacobi_step_matches_safe_step(gen, rho):
    x, y = clouds(gen, 40, 30, 3, dtype=torch.float32)
    res = flashot.sinkhorn(
        x, y, eps=0.3, tol=1e-3, backend="torch", rho=rho[0] if rho[0] == rho[1] else rho
    )
    form = attention_form(get_cost("sqeuclidean"), x, y).detach()
    la, lb = torch.full((40,), -math.log(40)), torch.full((30,), -math.log(30))
    be, status = triton_backend(), torch.zeros(1, dtype=torch.int32)
    lam = tuple(1.0 if r is None else r / (r + 0.3) for r in rho)
    args = (form, res.f, res.g, la, lb, 0.3, lam, rho)
    safe = be.jacobi_step(*args, check=True)
    fast = be.jacobi_step(*args, check=True, fast=True, status=status)
    assert int(status) == 0
    assert rel(fast[0], safe[0]) < 1e-5 and rel(fast[1], safe[1]) < 1e-5
    # the error is a sum of small differences: compare it absolutely (float32 rounding)
    assert abs(float(fast[2]) - float(safe[2])) < 1e-6 < float(safe[2])


def test_fast_step_flags_overflow(gen):
    x, y = clouds(gen, 20, 20, 3, dtype=torch.float32)
    form = attention_form(get_cost("sqeuclidean"), x, y).detach()
    la = torch.full((20,), -math.log(20))
    status = torch.zeros(1, dtype=torch.int32)
    f, g = torch.full((20,), 50.0), torch.full((20,), 50.0)  # far from the fixed point at eps=0.1
    triton_backend().jacobi_step(
        form, f, g, la, la, 0.1, (1, 1), (None, None), fast=True, status=status
    )
    assert int(status) == 1


@pytest.mark.parametrize("update", ["symmetric", "alternating"])
@pytest.mark.parametrize("rho", [None, 0.7])
def test_solver_on_triton_matches_torch(gen, update, rho):
    x, y = clouds(gen, 30, 24, 3, dtype=torch.float32)
    kw = dict(eps=0.5, tol=1e-4, rho=rho, update=update, max_iter=2000)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), backend="triton", **kw)
    assert res.converged and rel(res.cost.cpu(), ref.cost) < 1e-5


def test_speculation_recovers_from_failed_fast_steps(gen, monkeypatch):
    """A warm start far from the fixed point makes the first fast steps overflow: the
    solver must notice at the next check and replay those iterations safely."""
    from flashot.backends.triton import TritonBackend

    calls = {True: 0, False: 0}
    step = TritonBackend.jacobi_step

    def counted(self, *args, **kw):
        calls[kw.get("fast", False)] += 1
        return step(self, *args, **kw)

    monkeypatch.setattr(TritonBackend, "jacobi_step", counted)
    x, y = clouds(gen, 20, 20, 2, dtype=torch.float32)
    init = (torch.full((20,), 40.0), torch.full((20,), 40.0))
    kw = dict(eps=0.5, tol=1e-4, check_every=5, init=init)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), backend="triton", **kw)
    assert calls[False] >= 1 and calls[True] > 5  # replayed exactly, then fast again
    assert res.converged and rel(res.cost.cpu(), ref.cost) < 1e-5


def test_gradients_on_triton_match_torch(gen):
    x, y = clouds(gen, 25, 20, 4, dtype=torch.float32)
    grads = []
    for backend, dev in (("torch", "cpu"), ("triton", DEVICE)):
        xs, ys = x.to(dev).requires_grad_(), y.to(dev).requires_grad_()
        cost = flashot.sinkhorn(xs, ys, eps=0.3, tol=1e-5, backend=backend).cost
        grads.append([t.cpu() for t in torch.autograd.grad(cost, [xs, ys])])
    for g_t, g_r in zip(grads[1], grads[0], strict=True):
        assert rel(g_t, g_r) < 1e-4


def test_samples_loss_on_triton_matches_torch(gen):
    x, y = clouds(gen, 40, 30, 3, dtype=torch.float32)
    ref = flashot.SamplesLoss(blur=0.1, backend="torch")(x, y)
    out = flashot.SamplesLoss(blur=0.1, backend="triton")(x.to(DEVICE), y.to(DEVICE))
    assert rel(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("precision,lo,hi", [("bf16", 1e-4, 3e-2), ("fp16", 1e-5, 5e-3)])
def test_half_precision_modes(gen, precision, lo, hi):
    form, h = problem(gen, 40, 50, 8, torch.float32, DEVICE)
    lse, _ = triton_backend(precision=precision).row_attend(form, h, 1.0)
    err = rel(lse.cpu(), dense_attend(form, h, 1.0, None)[0].cpu())
    assert lo < err < hi


def test_float64_is_refused_with_a_clear_error(gen):
    x, y = clouds(gen, 5, 5, 2)
    with pytest.raises(ValueError, match="float64"):
        flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), eps=0.5, backend="triton")
