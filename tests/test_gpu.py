"""GPU suite (``pytest -m gpu``): the Triton kernels on CUDA against the float64 torch
backend on the same GPU, at sizes the interpreter cannot reach."""

import pytest
import torch

import flashot
from flashot.backends.triton import TritonBackend
from tests.conftest import rel

pytestmark = pytest.mark.gpu

# mode: (cost rel. error, potential rel. error) vs float64 after a converged solve
TOLERANCES = {
    "fp32": (1e-5, 1e-5),
    "tf32": (2e-3, 2e-3),
    "bf16": (1e-2, 1e-2),
    "fp16": (2e-3, 2e-3),
}


def data(n, m, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g)
    y = torch.randn(m, d, device="cuda", generator=g) + 0.5
    return x, y


@pytest.mark.parametrize("precision", sorted(TOLERANCES))
@pytest.mark.parametrize("n,m,d", [(3000, 2500, 3), (2048, 3000, 64), (1000, 1100, 700)])
def test_converged_solve_matches_float64(precision, n, m, d):
    x, y = data(n, m, d)
    eps = 0.1 * d
    ref = flashot.sinkhorn(x.double(), y.double(), eps=eps, tol=1e-9, backend="torch")
    res = flashot.sinkhorn(x, y, eps=eps, tol=1e-5, backend=TritonBackend(precision))
    tol_cost, tol_f = TOLERANCES[precision]
    shift = (res.f.double() - ref.f).mean()
    assert rel(res.cost, ref.cost) < tol_cost
    assert rel(res.f.double() - shift, ref.f) < tol_f


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_gradient_matches_float64(precision):
    x, y = data(4000, 3000, 32)
    grads = []
    for xx, yy, be in ((x.double(), y.double(), "torch"), (x, y, TritonBackend(precision))):
        xg, yg = xx.clone().requires_grad_(), yy.clone().requires_grad_()
        cost = flashot.sinkhorn(xg, yg, eps=2.0, tol=1e-5, backend=be).cost
        grads.append(torch.autograd.grad(cost, [xg, yg]))
    for g_ours, g_ref in zip(grads[1], grads[0], strict=True):
        assert rel(g_ours.double(), g_ref) < (1e-4 if precision == "fp32" else 3e-3)


def test_plan_products_match_float64():
    x, y = data(3000, 2000, 16)
    v = torch.randn(2000, 5, device="cuda")
    ref = flashot.sinkhorn(x.double(), y.double(), eps=1.0, tol=1e-9, backend="torch")
    res = flashot.sinkhorn(x, y, eps=1.0, tol=1e-5, backend="triton")
    assert rel((res.plan @ v).double(), ref.plan @ v.double()) < 1e-4
    assert rel(res.plan.barycentric_map().double(), ref.plan.barycentric_map()) < 1e-4
    assert rel(res.transport_cost.double(), ref.transport_cost) < 1e-4


def test_auto_picks_triton_on_cuda():
    x, y = data(100, 100, 3)
    assert flashot.sinkhorn(x, y, eps=1.0).plan._backend.name == "triton"
    assert flashot.sinkhorn(x.double(), y.double(), eps=1.0).plan._backend.name == "torch"


def test_forward_memory_is_inputs_plus_little():
    x, y = data(50_000, 50_000, 64)
    a = torch.full((50_000,), 1 / 50_000, device="cuda")
    fn = lambda: flashot.sinkhorn(x, y, a, a, eps=0.1, max_iter=10, tol=None)  # noqa: E731
    with torch.no_grad():
        fn()  # compile and tune outside the measurement
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        extra = (torch.cuda.max_memory_allocated() - base) / 1e6
    assert extra < 32, f"{extra:.1f} MB beyond the inputs"
