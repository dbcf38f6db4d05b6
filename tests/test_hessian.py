"""Second order: hvp and double backward against central differences of the dense
float64 reference gradient (envelope on the converged dense plan), symmetry, and Lanczos
against the dense Hessian assembled from HVPs."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.hessian import hvp
from flashot.numerics.linalg import lanczos
from tests.conftest import cuda_clouds, rel
from tests.references import dense_gradient, dense_hvp_fd

F64 = torch.float64
TIGHT = dict(tol=1e-13, max_iter=100_000, update="alternating")


def problem(seed, n=9, m=7, d=2, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(m, d, generator=gen, dtype=F64) + 0.5
    a = torch.rand(n, generator=gen, dtype=F64) + 0.2
    b = torch.rand(m, generator=gen, dtype=F64) + 0.2
    vx = torch.randn(n, d, generator=gen, dtype=F64)
    vy = torch.randn(m, d, generator=gen, dtype=F64)
    return [t.to(dtype) for t in (x, y, a, b, vx, vy)]


def rho_pair(rho):
    return rho if isinstance(rho, tuple) else (rho, rho)


@pytest.mark.parametrize("cost", ["sqeuclidean", "half_sqeuclidean", "cosine"])
@pytest.mark.parametrize("rho", [None, 1.0, (None, 2.0)])
def test_hvp_matches_finite_differences_of_the_dense_gradient(cost, rho):
    x, y, a, b, vx, vy = problem(0)
    eps = 0.5
    ref_x, ref_y = dense_hvp_fd(x, y, *reference_weights(a, b, rho), eps, vx, vy, cost=cost,
                                rho=rho_pair(rho))  # fmt: skip
    hx, hy = hvp(x, y, (vx, vy), a, b, wrt="xy", eps=eps, cost=cost, rho=rho, **TIGHT)
    assert rel(hx, ref_x) < 1e-5 and rel(hy, ref_y) < 1e-5
    # single blocks: H_xx v_x and H_yy v_y
    ref_xx, _ = dense_hvp_fd(x, y, *reference_weights(a, b, rho), eps, vx, 0 * vy, cost=cost,
                             rho=rho_pair(rho))  # fmt: skip
    assert rel(hvp(x, y, vx, a, b, eps=eps, cost=cost, rho=rho, **TIGHT), ref_xx) < 1e-5
    _, ref_yy = dense_hvp_fd(x, y, *reference_weights(a, b, rho), eps, 0 * vx, vy, cost=cost,
                             rho=rho_pair(rho))  # fmt: skip
    assert rel(hvp(x, y, vy, a, b, wrt="y", eps=eps, cost=cost, rho=rho, **TIGHT), ref_yy) < 1e-5


def reference_weights(a, b, rho):
    if rho is None:  # balanced problems are between the normalized weights
        return a / a.sum(), b / b.sum()
    return a, b


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(2, 12), st.integers(2, 12), st.integers(1, 3),
       st.floats(0.2, 5.0), st.sampled_from([None, 0.5, 5.0]))  # fmt: skip
def test_hvp_property_float64(seed, n, m, d, eps, rho):
    x, y, a, b, vx, vy = problem(seed, n, m, d)
    ref = dense_hvp_fd(x, y, *reference_weights(a, b, rho), eps, vx, vy, rho=(rho, rho))
    out = hvp(x, y, (vx, vy), a, b, wrt="xy", eps=eps, rho=rho, **TIGHT)
    scale = max(float(ref[0].norm()), float(ref[1].norm()), 1e-3)
    for o, r in zip(out, ref, strict=True):
        assert float((o - r).norm()) <= 1e-5 * scale


def test_hvp_float32_and_batches():
    x, y, a, b, vx, vy = problem(1)
    ref, _ = dense_hvp_fd(x, y, a / a.sum(), b / b.sum(), 0.5, vx, 0 * vy)
    h32 = hvp(x.float(), y.float(), vx.float(), a.float(), b.float(), eps=0.5, tol=1e-7,
              max_iter=20000, update="alternating")  # fmt: skip
    assert h32.dtype == torch.float32 and rel(h32, ref) < 1e-3
    batch = torch.stack([vx, 2 * vx, -vx])
    hb = hvp(x, y, batch, a, b, eps=0.5, **TIGHT)
    assert hb.shape == (3, *x.shape)
    assert rel(hb[1], 2 * ref) < 1e-5 and rel(hb[2], -ref) < 1e-5


def test_hessian_is_symmetric():
    x, y, a, b, u, _ = problem(2)
    v = torch.randn_like(u)
    hu = hvp(x, y, u, a, b, eps=0.3, rho=0.8, **TIGHT)
    hv = hvp(x, y, v, a, b, eps=0.3, rho=0.8, **TIGHT)
    assert abs(float((u * hv).sum() - (v * hu).sum())) <= 1e-8 * float(hu.norm() * v.norm())


def dense_hessian(x, y, a, b, eps, **kw):
    n, d = x.shape
    basis = torch.eye(n * d, dtype=F64).reshape(n * d, n, d)
    cols = hvp(x, y, basis, a, b, eps=eps, **kw)
    return cols.reshape(n * d, n * d)


def test_lanczos_on_a_repeated_ot_hessian_eigenvalue():
    # uniform weights: the top eigenvalue 2/n of the x-Hessian is repeated d times; the
    # single-vector Lanczos gave [0.25, 0.24216] here
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 2, generator=gen, dtype=F64), torch.randn(7, 2, generator=gen, dtype=F64)
    H = dense_hessian(x, y + 0.5, None, None, 0.4, **TIGHT)
    ref = torch.linalg.eigvalsh((H + H.T) / 2).flip(0)[:2]
    assert torch.allclose(ref, torch.full((2,), 0.25, dtype=F64), atol=1e-9)
    res = lanczos(lambda V: hvp(x, y + 0.5, V, eps=0.4, **TIGHT), x, k=2, which="largest",
                  batched=True)  # fmt: skip
    assert res.converged and torch.allclose(res.values, ref, atol=1e-8)


def test_lanczos_on_the_hessian_matches_eigvalsh():
    x, y, a, b, _, _ = problem(3, n=12, m=10, d=3)
    H = dense_hessian(x, y, a, b, 0.4, **TIGHT)
    assert torch.allclose(H, H.T, atol=1e-8 * float(H.abs().max()))
    ref = torch.linalg.eigvalsh((H + H.T) / 2)
    op = lambda v: hvp(x, y, v, a, b, eps=0.4, **TIGHT)  # noqa: E731
    for which, want in (("smallest", ref[:2]), ("largest", ref.flip(0)[:2])):
        vals, vecs = lanczos(op, x, k=2, which=which, tol=1e-10,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert torch.allclose(vals, want, atol=1e-7 * float(ref.abs().max()))
        assert vecs.shape == (2, *x.shape)


@pytest.mark.parametrize("rho", [None, 1.0])
@pytest.mark.parametrize("cost", ["sqeuclidean", "cosine"])
def test_double_backward_of_the_divergence(rho, cost):
    x, y, a, b, vx, vy = problem(4)
    a, b = a / a.sum(), b / b.sum()

    def grads(x, y, create_graph=False):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        s = flashot.sinkhorn_divergence(x, y, a, b, eps=0.5, rho=rho, cost=cost, **TIGHT)
        return torch.autograd.grad(s, (x, y), create_graph=create_graph), (x, y)

    h = 1e-5
    plus, _ = grads(x + h * vx, y + h * vy)
    minus, _ = grads(x - h * vx, y - h * vy)
    fd = [(p - m) / (2 * h) for p, m in zip(plus, minus, strict=True)]
    (gx, gy), leaves = grads(x, y, create_graph=True)
    hx, hy = torch.autograd.grad((gx * vx).sum() + (gy * vy).sum(), leaves)
    assert rel(hx, fd[0]) < 1e-5 and rel(hy, fd[1]) < 1e-5


def test_samples_loss_double_backward_is_the_divergence_hessian_at_its_potentials():
    # SamplesLoss runs GeomLoss' fixed schedule (not converged): its Hessian is that of
    # the converged value at its final potentials, close to the converged divergence's
    x, y, a, b, vx, _ = problem(5)
    a, b = a / a.sum(), b / b.sum()
    xs = x.clone().requires_grad_()
    loss = flashot.SamplesLoss(blur=0.5, scaling=0.999, cost=None)(a, xs, b, y)
    (g,) = torch.autograd.grad(loss, xs, create_graph=True)
    (h_sl,) = torch.autograd.grad((g * vx).sum(), xs)
    xd = x.clone().requires_grad_()
    div = flashot.sinkhorn_divergence(xd, y, a, b, eps=0.25, cost="half_sqeuclidean", **TIGHT)
    (g,) = torch.autograd.grad(div, xd, create_graph=True)
    (h_div,) = torch.autograd.grad((g * vx).sum(), xd)
    assert rel(h_sl, h_div) < 2e-2


def test_double_backward_through_a_model():
    # points = model(theta): the chain rule through the exact Hessian
    x, y, a, b, _, _ = problem(6)
    theta = torch.tensor([[1.1, 0.2], [-0.1, 0.9]], dtype=F64, requires_grad=True)
    shift = torch.tensor([0.3, -0.2], dtype=F64, requires_grad=True)

    def loss(theta, shift):
        return flashot.sinkhorn(x @ theta + shift, y, a, b, eps=0.5, **TIGHT).cost

    H = torch.autograd.functional.hessian(loss, (theta, shift))
    h = 1e-5
    e = torch.zeros_like(theta)
    e[0, 1] = 1.0

    def grad_at(t):
        t = t.clone().requires_grad_()
        return torch.autograd.grad(loss(t, shift.detach()), t)[0]

    fd = (grad_at(theta.detach() + h * e) - grad_at(theta.detach() - h * e)) / (2 * h)
    assert rel(H[0][0][:, :, 0, 1], fd) < 1e-5


def test_weights_second_order_and_mixed_blocks():
    x, y, a, b, vx, _ = problem(7)
    rho = 1.0  # relaxed: the weights' masses matter

    def grad_a(x):
        aa = a.clone().requires_grad_()
        return torch.autograd.grad(flashot.sinkhorn(x, y, aa, b, eps=0.5, rho=rho, **TIGHT).cost,
                                   aa)[0]  # fmt: skip

    h = 1e-5
    fd = (grad_a(x + h * vx) - grad_a(x - h * vx)) / (2 * h)  # d/dx (d cost / da) along vx
    xs, aa = x.clone().requires_grad_(), a.clone().requires_grad_()
    cost = flashot.sinkhorn(xs, y, aa, b, eps=0.5, rho=rho, **TIGHT).cost
    (gx,) = torch.autograd.grad(cost, xs, create_graph=True)
    (mixed,) = torch.autograd.grad((gx * vx).sum(), aa)
    assert rel(mixed, fd) < 1e-5


def test_hvp_options_are_checked():
    x, y, _a, _b, vx, vy = problem(8)
    with pytest.raises(ValueError, match="wrt"):
        hvp(x, y, vx, eps=0.5, wrt="z")
    with pytest.raises(ValueError, match="v must have shape"):
        hvp(x, y, vy, eps=0.5)
    with pytest.raises(ValueError, match="pair"):
        hvp(x, y, (vx,), eps=0.5, wrt="xy")
    with pytest.raises(ValueError, match="non-finite"):
        hvp(x, y, vx * float("nan"), eps=0.5)
    with pytest.raises(ValueError, match="cg_tol"):
        hvp(x, y, vx, eps=0.5, cg_tol=-1.0)


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
def test_triton_backend_matches_torch():
    x, y, a, b, vx, vy = problem(9, n=8, m=6)
    kw = dict(eps=0.5, tol=1e-6, max_iter=5000, update="alternating")
    args = (x.float(), y.float(), (vx.float(), vy.float()), a.float(), b.float())
    ht = hvp(*args, wrt="xy", backend="torch", **kw)
    hk = hvp(*args, wrt="xy", backend="triton", **kw)
    assert rel(hk[0], ht[0]) < 1e-3 and rel(hk[1], ht[1]) < 1e-3


def test_torch_func_transforms_of_hvp_are_a_clear_error():
    x, y, _a, _b, vx, _ = problem(10)
    with pytest.raises(RuntimeError, match=r"torch\.func"):
        torch.func.grad(lambda x: hvp(x, y, vx, eps=0.5).sum())(x)


def test_public_names():
    # the API: flashot.hvp, flashot.linalg.{cg, lanczos}, flashot.optim (attributes
    # of the package, the modules of flashot.numerics)
    assert flashot.hvp is hvp and flashot.linalg.lanczos is lanczos
    assert {"NewtonCG", "TrustRegion", "AdamNewton"} <= set(dir(flashot.optim))


def test_numpy_inputs():
    import numpy as np

    x, y, a, b, vx, vy = problem(7)
    kw = dict(eps=0.5, **TIGHT)
    want = hvp(x, y, vx, a, b, **kw)
    got = hvp(x.numpy(), y.numpy(), vx.numpy(), a.numpy(), b.numpy(), **kw)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    pair = hvp(x.numpy(), y.numpy(), (vx.numpy(), vy.numpy()), wrt="xy", **kw)
    want = hvp(x, y, (vx, vy), wrt="xy", **kw)
    assert all(torch.equal(p, w) for p, w in zip(pair, want, strict=True))
    assert isinstance(vx.numpy(), np.ndarray)


@pytest.mark.parametrize(
    "wrt,rho,cost",
    [("x", None, "sqeuclidean"), ("y", 1.0, "cosine"), ("xy", (None, 2.0), "half_sqeuclidean")],
)
def test_batched_directions_share_the_dual_solve(wrt, rho, cost):
    """A batch of k directions: each HVP equals the single-direction one, and the k dual
    solves run as the columns of one CG (each of its matvecs streams k values)."""
    from flashot.autodiff import implicit

    x, y, a, b, _vx, _vy = problem(5, n=8, m=6, d=2)
    gen = torch.Generator().manual_seed(9)
    k = 4
    bx = torch.randn(k, *x.shape, generator=gen, dtype=F64)
    by = torch.randn(k, *y.shape, generator=gen, dtype=F64)
    v = {"x": bx, "y": by, "xy": (bx, by)}[wrt]
    kw = dict(eps=0.5, rho=rho, cost=cost, wrt=wrt, **TIGHT)
    widths = []
    real = implicit.solve_dual

    def spy(form, f, g, a_, b_, spec, f_bar, g_bar):
        widths.append(f_bar.shape[1] if f_bar.dim() == 2 else 1)
        return real(form, f, g, a_, b_, spec, f_bar, g_bar)

    implicit.solve_dual = spy
    try:
        batch = hvp(x, y, v, a, b, **kw)
    finally:
        implicit.solve_dual = real
    assert widths == [k]  # one solve, k columns
    for i in range(k):
        one = hvp(x, y, (bx[i], by[i]) if wrt == "xy" else v[i], a, b, **kw)
        if wrt == "xy":
            assert rel(batch[0][i], one[0]) < 1e-10 and rel(batch[1][i], one[1]) < 1e-10
        else:
            assert rel(batch[i], one) < 1e-10


def test_hvp_whole_call_keeps_few_cloud_sized_tensors():
    """Loss, gradient with create_graph and the double backward (the peer's HVP setup, a
    fixed schedule: :mod:`flashot.autodiff.unrolled`) hold at most ten point-cloud-sized
    tensors at once beyond the inputs: the problem's two features and the form rebuilt for
    the second derivative, the envelope step's barycenters, the gradient, the softmax
    average the envelope's derivative reads, a plan_vjp output and autograd's
    temporaries of the chain rule to x."""
    from flashot.backends.torch_backend import TorchBackend
    from tests.live_memory import LiveTensors

    gen = torch.Generator().manual_seed(0)
    n, d = 800, 48
    x, y, v = (torch.randn(n, d, generator=gen) for _ in range(3))
    cloud = n * d * 4
    with LiveTensors(cloud // 4) as live:
        live.ignore(x, y, v)
        xs = x.detach().requires_grad_()
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.5, debias=False,
                                   backend=TorchBackend(budget=8192))(xs, y)  # fmt: skip
        (g,) = torch.autograd.grad(loss, xs, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), xs)
    assert torch.isfinite(h).all() and live.peak / cloud <= 10.0


def dense_divergence_gradient(x, y, a, b, eps, **kw):
    """(∇_x, ∇_y) of S_ε = OT(a, b) − ½ OT(a, a) − ½ OT(b, b), dense float64 (each self
    term's derivative is the sum of its two arguments' envelope gradients)."""
    gx, gy = dense_gradient(x, y, a, b, eps, **kw)
    sx = sum(dense_gradient(x, x, a, a, eps, **kw))
    sy = sum(dense_gradient(y, y, b, b, eps, **kw))
    return gx - 0.5 * sx, gy - 0.5 * sy


CASES = st.sampled_from([
    ("ot", "sqeuclidean", None), ("ot", "cosine", None), ("ot", "sqeuclidean", 1.0),
    ("ot", "cosine", (None, 2.0)), ("ot", "half_sqeuclidean", (0.7, None)),
    ("divergence", "sqeuclidean", None), ("divergence", "cosine", 1.5),
])  # fmt: skip


@pytest.mark.slow
@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10**6), st.integers(3, 9), st.integers(3, 9), st.integers(1, 3),
       st.floats(0.2, 2.0), CASES, st.sampled_from([torch.float32, F64]))  # fmt: skip
def test_double_backward_at_the_defaults_is_within_the_accuracy_contract(
    seed, n, m, d, eps, case, dtype
):
    """No option given: HVPs by double backward within 1e-3 (float32) and 1e-6 (float64)
    of central differences of the float64 dense gradient, for every kind of problem."""
    kind, cost, rho = case
    d = max(d, 2) if cost == "cosine" else d  # (on a line the cosine cost has no curvature)
    x, y, a, b, vx, vy = problem(seed, n, m, d)
    pair = rho_pair(rho)
    wa, wb = reference_weights(a, b, rho)
    h = 1e-5
    grad = dense_divergence_gradient if kind == "divergence" else dense_gradient
    plus = grad(x + h * vx, y + h * vy, wa, wb, eps, cost=cost, rho=pair)
    minus = grad(x - h * vx, y - h * vy, wa, wb, eps, cost=cost, rho=pair)
    ref = [(p - q) / (2 * h) for p, q in zip(plus, minus, strict=True)]
    leaves = [t.to(dtype).requires_grad_() for t in (x, y)]
    fn = flashot.sinkhorn_divergence if kind == "divergence" else flashot.sinkhorn
    value = fn(*leaves, a.to(dtype), b.to(dtype), eps=eps, cost=cost, rho=rho, warn=False)
    value = value if kind == "divergence" else value.cost
    g = torch.autograd.grad(value, leaves, create_graph=True)
    hv = torch.autograd.grad(
        sum((gi * vi.to(dtype)).sum() for gi, vi in zip(g, (vx, vy), strict=False)), leaves
    )
    bound = 1e-3 if dtype == torch.float32 else 1e-6
    scale = max(float(ref[0].norm()), float(ref[1].norm()))
    for got, want in zip(hv, ref, strict=True):
        assert float((got.double() - want).norm()) <= bound * scale


def test_hvp_tol_sets_the_accuracy_as_documented(monkeypatch):
    """hvp_tol is the relative error asked for: the dual solve reaches hvp_tol / 10 and the
    product lands within hvp_tol of the tight one; a looser one takes fewer iterations."""
    from flashot.autodiff import dense_dual

    monkeypatch.setattr(dense_dual, "DENSE_UP_TO", 0)  # (the CG, not a direct solve)
    x, y, a, b, vx, _ = problem(11, n=30, m=25, d=3)
    ref = hvp(x, y, vx, a, b, eps=0.05, cg_tol=1e-13, **TIGHT)
    iters = []
    for tol in (1e-2, 1e-4, 1e-6):
        with flashot.record_dual_solves() as log:
            out = hvp(x, y, vx, a, b, eps=0.05, hvp_tol=tol, **TIGHT)
        assert len(log) == 1 and log.last.tol == pytest.approx(tol / 10)
        assert log.last.converged and log.last.residual <= tol / 10
        assert rel(out, ref) <= tol
        iters.append(log.last.n_iter)
    assert iters[0] < iters[1] < iters[2]


def test_hvp_tol_is_checked():
    x, y, _a, _b, vx, _ = problem(13)
    with pytest.raises(ValueError, match="hvp_tol"):
        hvp(x, y, vx, eps=0.5, hvp_tol=0.0)
    with pytest.raises(ValueError, match="not both"):
        hvp(x, y, vx, eps=0.5, hvp_tol=1e-3, cg_tol=1e-4)
    with pytest.raises(ValueError, match="hvp_tol"):
        flashot.sinkhorn(x, y, eps=0.5, hvp_tol=2.0)
    with pytest.raises(ValueError, match="hvp_tol"):
        flashot.sinkhorn(x[None], y[None], eps=0.5, hvp_tol=-1.0)


def test_a_hessian_operator_solves_once_and_equals_hvp(monkeypatch):
    """HessianOperator: one Sinkhorn solve, then H v for any v (flat matvec and batches
    too) equal to hvp's; lanczos over its matvec finds the top eigenvalue of the
    assembled Hessian."""
    from flashot import HessianOperator
    from flashot.numerics import linalg

    x, y, a, b, vx, vy = problem(21, n=12, m=9, d=2)
    solves = []
    real = flashot.hessian.sinkhorn
    monkeypatch.setattr(
        flashot.hessian, "sinkhorn", lambda *s, **k: solves.append(1) or real(*s, **k)
    )
    for wrt, v in (("x", vx), ("xy", (vx, vy))):
        H = HessianOperator(x, y, a, b, wrt=wrt, eps=0.5, **TIGHT)
        for scale in (1.0, -2.0):
            w = v if wrt == "x" else tuple(scale * t for t in v)
            got, want = H(w), hvp(x, y, w, a, b, wrt=wrt, eps=0.5, **TIGHT)
            for g_, w_ in zip(got if wrt == "xy" else (got,), want if wrt == "xy" else (want,),
                              strict=True):  # fmt: skip
                assert torch.allclose(g_, w_, rtol=1e-9, atol=1e-12)
    assert len(solves) == 2 + 4  # one per operator, one per hvp call
    H = HessianOperator(x, y, a, b, eps=0.5, **TIGHT)
    dense = torch.stack([H.matvec(e) for e in torch.eye(H.shape[0], dtype=x.dtype)], 1)
    assert torch.allclose(H.matvec(torch.eye(H.shape[0], dtype=x.dtype)), dense, atol=1e-12)
    assert torch.allclose(dense, dense.T, atol=1e-8)
    top = linalg.lanczos(H.matvec, H.shape[0], k=1, which="largest").values[0]
    assert float(top) == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-8)
    with pytest.raises(ValueError, match=r"v must have shape \(24,\)"):
        H.matvec(torch.ones(5, dtype=x.dtype))


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
@pytest.mark.parametrize("wrt,rho", [("x", None), ("y", None), ("x", (2.0, None)), ("xy", 1.0)])
def test_hvp_on_triton_matches_float64_torch(wrt, rho):
    x, y = cuda_clouds(1500, 1200, 8)
    v = torch.randn_like(x) if wrt != "y" else torch.randn_like(y)
    if wrt == "xy":
        v = (v, torch.randn_like(y))
    kw = dict(eps=0.5, wrt=wrt, rho=rho)
    h = flashot.hvp(x, y, v, backend="triton", tol=1e-6, **kw)
    v64 = tuple(t.double() for t in v) if wrt == "xy" else v.double()
    ref = flashot.hvp(x.double(), y.double(), v64, backend="torch", tol=1e-12, **kw)
    for got, want in zip(h if wrt == "xy" else (h,), ref if wrt == "xy" else (ref,), strict=False):
        assert rel(got, want) < 1e-3


@pytest.mark.gpu
def test_batched_hvp_directions_on_triton_match_single_ones():
    """k directions in one hvp call (one CG with k columns, captures off) give each
    direction's own HVP."""
    x, y = cuda_clouds(1500, 1200, 8)
    gen = torch.Generator("cuda").manual_seed(3)
    V = torch.randn(4, *x.shape, device="cuda", generator=gen)
    H = flashot.hvp(x, y, V, eps=0.5, backend="triton", tol=1e-6)
    for i in range(4):
        h = flashot.hvp(x, y, V[i], eps=0.5, backend="triton", tol=1e-6)
        assert rel(H[i], h) < 1e-4, i
