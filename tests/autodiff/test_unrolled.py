"""Second derivatives of fixed-iteration solves (flashot.autodiff.unrolled) and the one
function rule: a double backward is the exact derivative of the gradient a call returns,
and that gradient does not depend on ``create_graph``.

A fixed schedule's gradient (GeomLoss') is not a gradient field: its Jacobian J is not
symmetric, so a double backward ``∇⟨g, v⟩`` is ``Jᵀ v``, checked against the columns of J
by central differences of the dense float64 GeomLoss gradient (tests.references), or of
flashot's own returned gradient for options the dense loop does not have.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashot
from flashot.autodiff.implicit import DualSpec
from flashot.autodiff.unrolled import Transform, dual_partials
from flashot.backends import available_backends
from flashot.backends.torch_backend import TorchBackend
from flashot.solver.loop import geomloss_schedule
from tests.conftest import cuda_clouds, rel
from tests.references import geomloss_gradient, jacobian_fd

F64 = torch.float64
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def problem(seed, n, m, d, shift=0.5, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(m, d, generator=gen, dtype=F64) + shift
    a = torch.rand(n, generator=gen, dtype=F64) + 0.2
    b = torch.rand(m, generator=gen, dtype=F64) + 0.2
    v = torch.randn(n, d, generator=gen, dtype=F64)
    return [t.to(dtype) for t in (x, y, a / a.sum(), b / b.sum(), v)]


def double_backward(loss, x, v):
    """``(∇ loss, ∇⟨∇ loss, v⟩)`` at x, the second by a double backward."""
    xs = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(xs), xs, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    return g.detach(), h


def transposed(J, v):
    return (J.T @ v.reshape(-1)).reshape(v.shape)


@settings(max_examples=15, **SLOW)
@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(1, 6), st.integers(1, 3),
       st.floats(0.05, 3.0))  # fmt: skip
def test_transform_is_the_soft_c_transform_with_its_gradient(seed, n, m, d, eps):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, d, generator=gen, dtype=F64), torch.rand(n, generator=gen, dtype=F64),
             torch.randn(m, d, generator=gen, dtype=F64), torch.rand(m, generator=gen, dtype=F64),
             torch.log(torch.rand(m, generator=gen, dtype=F64) + 0.1),
             torch.randn(m, generator=gen, dtype=F64)]  # fmt: skip
    parts = [p.requires_grad_() for p in parts]
    spec = DualSpec(eps, (None, None), TorchBackend(), None, 1e-10)
    q, alpha, k, beta, log_w, h = parts
    dense = alpha - eps * torch.logsumexp((q @ k.T + h - beta) / eps + log_w, 1)
    # (to the size of its terms: α − ε LSE can cancel)
    scale = float(alpha.abs().max() + (dense - alpha).abs().max())
    assert float((Transform.apply(*parts, spec)[0] - dense).abs().max()) < 1e-13 * scale
    assert torch.autograd.gradcheck(lambda *p: Transform.apply(*p, spec)[0], tuple(parts))


@pytest.mark.parametrize("rho", [None, 0.7])
@pytest.mark.parametrize("kind", ["plain", "geomloss", "dual"])
def test_dual_partials_are_those_of_the_value_terms(kind, rho):
    from flashot.autodiff.functions import dual_term, relaxed_side

    if kind == "plain" and rho is not None:
        return
    f = torch.randn(7, dtype=F64, requires_grad=True)
    w = (torch.rand(7, dtype=F64) + 0.1).requires_grad_()
    term = {"plain": lambda: (w * f).sum(), "geomloss": lambda: dual_term(f, w, 0.3, rho),
            "dual": lambda: relaxed_side(f, w, 0.3, rho)}[kind]()  # fmt: skip
    df, dw = torch.autograd.grad(term, (f, w))
    pf, pw = dual_partials(f, w, 0.3, rho, kind)
    assert rel(pf, df) < 1e-14 and rel(pw, dw) < 1e-14


@settings(max_examples=10, **SLOW)
@given(st.integers(0, 10**6), st.integers(2, 6), st.integers(2, 6), st.integers(1, 3),
       st.floats(0.05, 0.6), st.floats(0.3, 0.8), st.sampled_from([None, 0.7, 2.0]),
       st.booleans())  # fmt: skip
def test_samples_loss_second_derivative_is_the_derivative_of_its_gradient(
    seed, n, m, d, blur, scaling, reach, debias
):
    x, y, a, b, v = problem(seed, n, m, d)
    diameter = 4.0  # (a measured one would move with x: the schedule is a constant)
    loss = flashot.SamplesLoss(blur=blur, reach=reach, scaling=scaling, diameter=diameter,
                               debias=debias)  # fmt: skip
    schedule = geomloss_schedule(diameter, blur**2, scaling)
    rho = None if reach is None else reach**2

    def reference(t):
        return geomloss_gradient(t, y, a, b, schedule, rho=rho, debias=debias)

    g, h = double_backward(lambda t: loss(a, t, b, y), x, v)
    assert rel(g, reference(x)) < 1e-10  # GeomLoss' gradient, create_graph or not
    assert rel(h, transposed(jacobian_fd(reference, x), v)) < 1e-6


@pytest.mark.parametrize("d", [2, 3])
def test_geomloss_defaults_in_float32_within_1e3_of_the_float64_derivative(d):
    x, y, a, b, v = problem(d, 24, 20, d, shift=1.0)
    loss = flashot.SamplesLoss(diameter=8.0)  # blur 0.05, scaling 0.5, debiased
    schedule = geomloss_schedule(8.0, 0.05**2, 0.5)
    _, h = double_backward(lambda t: loss(a.float(), t, b.float(), y.float()), x.float(), v.float())
    J = jacobian_fd(lambda t: geomloss_gradient(t, y, a, b, schedule), x)
    assert h.dtype == torch.float32 and rel(h, transposed(J, v)) < 1e-3
    # far from a gradient field: its Jacobian is not symmetric (no Hessian is its derivative)
    assert rel(J, J.T) > 0.1


OPTIONS = [
    dict(update="symmetric"), dict(update="alternating"),
    dict(update="alternating", momentum=1.4, max_iter=23, check_every=5),
    dict(rho=1.0), dict(rho=(None, 2.0), update="alternating"), dict(cost="cosine"),
    dict(cost="half_sqeuclidean", eps_schedule=[3.0, 1.0]),
    dict(init="warm"),
]  # fmt: skip


@pytest.mark.parametrize("options", OPTIONS,
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))  # fmt: skip
def test_fixed_iteration_sinkhorn_second_derivative(options):
    x, y, a, b, v = problem(3, 7, 5, 2)
    options = {"eps": 0.4, "max_iter": 6, **options}
    if options.get("init") == "warm":
        start = flashot.sinkhorn(x, y, a, b, eps=0.4, max_iter=3, tol=None)
        options["init"] = (start.f.detach() + 0.1, start.g.detach())

    def loss(t):
        return flashot.sinkhorn(t, y, a, b, tol=None, **options).cost

    def grad(t):
        t = t.clone().requires_grad_()
        return torch.autograd.grad(loss(t), t)[0]

    g, h = double_backward(loss, x, v)
    assert torch.equal(g, grad(x))
    assert rel(h, transposed(jacobian_fd(grad, x), v)) < 1e-6


def test_fixed_iteration_divergence_and_mixed_weight_derivatives():
    x, y, a, b, v = problem(4, 6, 5, 2)
    kw = dict(eps=0.3, tol=None, max_iter=5, rho=0.8)
    aa = a.clone().requires_grad_()
    xs = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(flashot.sinkhorn_divergence(xs, y, aa, b, **kw), xs,
                                create_graph=True)  # fmt: skip
    (mixed,) = torch.autograd.grad((gx * v).sum(), aa)  # d/da ⟨∇_x S, v⟩

    def grad_x(w):
        t = x.clone().requires_grad_()
        return torch.autograd.grad(flashot.sinkhorn_divergence(t, y, w, b, **kw), t)[0]

    h = 1e-6
    want = torch.stack([((grad_x(a + h * e) - grad_x(a - h * e)) / (2 * h) * v).sum()
                        for e in torch.eye(len(a), dtype=F64)])  # fmt: skip
    assert rel(mixed, want) < 1e-6


def test_momentum_with_history_refuses_second_derivatives():
    x, y, *_ = problem(5, 6, 5, 2)
    xs = x.clone().requires_grad_()
    res = flashot.sinkhorn(xs, y, eps=0.4, tol=None, max_iter=8, update="alternating",
                           momentum=1.3, history=True)  # fmt: skip
    torch.autograd.grad(res.cost, xs, retain_graph=True)  # first order is fine
    with pytest.raises(RuntimeError, match="history=False"):
        torch.autograd.grad(res.cost, xs, create_graph=True)


ENTRY_POINTS = {
    "sinkhorn": lambda x, y, a, b: flashot.sinkhorn(x, y, a, b, eps=0.3).cost,
    "sinkhorn-fixed": lambda x, y, a, b: flashot.sinkhorn(x, y, a, b, eps=0.3, tol=None,
                                                          max_iter=7).cost,
    "sinkhorn-relaxed": lambda x, y, a, b: flashot.sinkhorn(x, y, a, b, eps=0.3, rho=0.5).cost,
    "divergence": lambda x, y, a, b: flashot.sinkhorn_divergence(x, y, a, b, eps=0.3),
    "samples_loss": lambda x, y, a, b: flashot.SamplesLoss(blur=0.3)(a, x, b, y),
    "samples_loss-reach": lambda x, y, a, b: flashot.SamplesLoss(blur=0.3, reach=0.8,
                                                                 debias=False)(a, x, b, y),
    "samples_loss-cosine": lambda x, y, a, b: flashot.SamplesLoss(blur=0.3, cost="cosine")(
        a, x, b, y),
}  # fmt: skip


@settings(max_examples=20, **SLOW)
@given(st.integers(0, 10**6), st.sampled_from(sorted(ENTRY_POINTS)),
       st.sampled_from([torch.float32, F64]))  # fmt: skip
def test_the_gradient_does_not_depend_on_create_graph(seed, name, dtype):
    x, y, a, b, _ = problem(seed, 9, 7, 2, dtype=dtype)
    fn = ENTRY_POINTS[name]
    grads = []
    for create_graph in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
        out = torch.autograd.grad(fn(*leaves), leaves, create_graph=create_graph)
        grads.append([t.detach() for t in out])
    for plain, carried in zip(*grads, strict=True):
        assert torch.equal(plain, carried)


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
def test_triton_backend_matches_torch():
    """The replay and its adjoint on the kernels, with operands split once per scope
    (presplit=True: the accurate mode's path at large sizes) and per tile."""
    from flashot.backends.triton import TritonBackend

    x, y, a, b, v = problem(6, 8, 6, 2, dtype=torch.float32)
    out = []
    for backend in ("torch", TritonBackend(presplit=False), TritonBackend(presplit=True)):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.5, diameter=4.0, backend=backend)
        out.append(double_backward(lambda t, loss=loss: loss(a, t, b, y), x, v))
    for grad, hvp in out[1:]:
        assert rel(grad, out[0][0]) < 1e-5 and rel(hvp, out[0][1]) < 1e-4


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
@pytest.mark.parametrize("blur,scaling,d", [(0.3, 0.7, 8), (0.05, 0.5, 3), (0.3, 0.7, 100)])
def test_samples_loss_double_backward_on_triton_matches_float64(blur, scaling, d):
    """A fixed schedule's second derivative (the replayed schedule, flashot.autodiff.unrolled)
    on the Triton kernels against the same function in float64 on the torch backend; the
    gradient is the same with and without create_graph. (d = 100: the reverse product's
    tiles past 64 features, which must fit the SM's shared memory.)"""
    x, y = cuda_clouds(1200, 1000, d)
    v = torch.randn_like(x)
    out = []
    for dtype, backend in ((torch.float32, "triton"), (torch.float64, "torch")):
        loss = flashot.SamplesLoss(blur=blur, scaling=scaling, backend=backend)
        xs = x.to(dtype).requires_grad_()
        (plain,) = torch.autograd.grad(loss(xs, y.to(dtype)), xs)
        (again,) = torch.autograd.grad(loss(xs, y.to(dtype)), xs)
        (g,) = torch.autograd.grad(loss(xs, y.to(dtype)), xs, create_graph=True)
        (h,) = torch.autograd.grad((g * v.to(dtype)).sum(), xs)
        # create_graph changes nothing a rerun does not: the kernels' atomic sums round
        # differently from call to call, and small ε amplifies that through the schedule
        assert rel(g.detach(), plain) <= max(1e-6, 4 * rel(again, plain))
        out.append((g.detach(), h))
    assert rel(out[0][0], out[1][0]) < 1e-4 and rel(out[0][1], out[1][1]) < 1e-3


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
def test_replay_converts_each_cloud_once(monkeypatch):
    """The replay's passes and their backward steps share the clouds' split parts
    (``DualSpec.operands``): a double backward converts no cloud again (it converted
    both for every pass before: 62 conversions for the gradient, 62 more for the HVP)."""
    from flashot.backends.triton import TritonBackend
    from flashot.backends.triton._operands import Operands

    calls = []
    split = Operands.split_parts
    monkeypatch.setattr(Operands, "split_parts",
                        lambda self, t: calls.append(t.shape) or split(self, t))  # fmt: skip
    x, y, _, _, v = problem(6, 8, 6, 2, dtype=torch.float32)
    loss = flashot.SamplesLoss(blur=0.3, scaling=0.5, diameter=4.0,
                               backend=TritonBackend(presplit=True))  # fmt: skip
    xs = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(xs, y), xs, create_graph=True)
    first = len(calls)
    torch.autograd.grad((g * v).sum(), xs)
    assert first <= 16 and len(calls) - first <= 4, (first, len(calls) - first)
