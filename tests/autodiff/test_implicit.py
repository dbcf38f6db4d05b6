"""Implicit derivatives of everything a solve returns, against central differences of
the float64 dense reference (a fresh dense solve at each shifted point)."""

import pytest
import torch

import flashot
from flashot.autodiff.implicit import GAUGE, DualSpec, PlanProduct
from flashot.backends.torch_backend import TorchBackend
from flashot.geometry.costs import attention_form, get_cost
from tests.conftest import rel
from tests.references import dense_cost, plan_dense, sinkhorn_dense

F64 = torch.float64
TIGHT = dict(tol=1e-13, max_iter=100_000, update="alternating")
EPS = 0.5


def data(seed=0, n=8, m=6, d=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(m, d, generator=gen, dtype=F64) + 0.4
    a = torch.rand(n, generator=gen, dtype=F64) + 0.2
    b = torch.rand(m, generator=gen, dtype=F64) + 0.2
    return x, y, a, b, gen


def dense_outputs(x, y, a, b, rho, V):
    """(f, g, P V, <P, C>, barycentric map) by the dense reference."""
    if rho is None:
        a, b = a / a.sum(), b / b.sum()
    C = dense_cost(x, y)
    f, g = sinkhorn_dense(C, a, b, EPS, (rho, rho))
    P = plan_dense(C, a, b, f, g, EPS)
    return f, g, P @ V, (P * C).sum(), (P @ y) / P.sum(1, keepdim=True)


def fd(fn, t, direction, h=1e-5):
    return (fn(t + h * direction) - fn(t - h * direction)) / (2 * h)


@pytest.mark.parametrize("rho", [None, 0.8])
@pytest.mark.parametrize("wrt", ["x", "y", "a", "b"])
def test_plan_outputs_have_exact_gradients(rho, wrt):
    x, y, a, b, gen = data()
    V = torch.randn(6, 3, generator=gen, dtype=F64)
    W = torch.randn(8, 3, generator=gen, dtype=F64)
    Wm = torch.randn(8, 2, generator=gen, dtype=F64)
    inputs = {"x": x, "y": y, "a": a, "b": b}
    t = inputs[wrt]
    direction = torch.randn(t.shape, generator=gen, dtype=F64)

    def scalars(res_or_dense):
        f, g, PV, tc, bmap = res_or_dense
        gauge_free = f - f.mean() if rho is None else f
        return [(PV * W).sum(), tc, (bmap * Wm).sum(), (gauge_free**2).sum(), (g.exp()).sum()
                if rho is not None else ((g - g.mean()) ** 3).sum()]  # fmt: skip

    def reference(tt):
        args = dict(inputs, **{wrt: tt})
        return torch.stack(
            scalars(dense_outputs(args["x"], args["y"], args["a"], args["b"], rho, V))
        )

    expected = fd(reference, t, direction)
    leaf = t.clone().requires_grad_()
    args = dict(inputs, **{wrt: leaf})
    res = flashot.sinkhorn(args["x"], args["y"], args["a"], args["b"], eps=EPS, rho=rho, **TIGHT)
    outs = scalars((res.f, res.g, res.plan @ V, res.transport_cost, res.plan.barycentric_map()))
    for k, out in enumerate(outs):
        (grad,) = torch.autograd.grad(out, leaf, retain_graph=True)
        got = float((grad * direction).sum())
        assert got == pytest.approx(float(expected[k]), rel=1e-5, abs=1e-8), k


def test_gauge_dependent_functions_of_balanced_potentials_raise():
    x, y, a, b, _ = data()
    xs = x.clone().requires_grad_()
    res = flashot.sinkhorn(xs, y, a, b, eps=EPS, **TIGHT)
    with pytest.raises(RuntimeError, match="additive constant"):
        torch.autograd.grad(res.f.sum(), xs)
    assert "invariant" in GAUGE
    (grad,) = torch.autograd.grad((res.f[:, None] + res.g[None, :]).exp().sum(), xs)
    assert torch.isfinite(grad).all()


def test_map_at_new_points_refuses_gradients():
    x, y, a, b, _ = data()
    xs = x.clone().requires_grad_()
    res = flashot.sinkhorn(xs, y, a, b, eps=EPS, **TIGHT)
    with pytest.raises(RuntimeError, match="new points"):
        res.plan.barycentric_map(torch.zeros(2, 2, dtype=F64))
    with torch.no_grad():
        assert res.plan.barycentric_map(torch.zeros(2, 2, dtype=F64)).shape == (2, 2)


def test_plan_vjp_primitive_matches_dense_autograd():
    # contract of Backend.plan_vjp: the reductions of S = P ⊙ (D Vᵀ), against autograd
    x, y, a, b, gen = data(3, n=7, m=5, d=3)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    f = torch.randn(7, generator=gen, dtype=F64)
    g = torch.randn(5, generator=gen, dtype=F64)
    V = torch.randn(5, 2, generator=gen, dtype=F64)
    D = torch.randn(7, 2, generator=gen, dtype=F64)
    leaves = [
        t.clone().requires_grad_() for t in (form.q, form.alpha, form.k, form.beta, a, b, f, g, V)
    ]
    q, al, k, be, aa, bb, ff, gg, VV = leaves
    P = aa[:, None] * bb[None, :] * torch.exp((ff[:, None] + gg[None, :] - al[:, None] - be[None, :]
                                               + q @ k.T) / EPS)  # fmt: skip
    grads = torch.autograd.grad((D * (P @ VV)).sum(), leaves)
    out = TorchBackend(budget=6).plan_vjp(form, f, g, a, b, EPS, V, D)  # several tiles
    assert rel(out.row_k / EPS, grads[0]) < 1e-12 and rel(-out.row / EPS, grads[1]) < 1e-12
    assert rel(out.col_q / EPS, grads[2]) < 1e-12 and rel(-out.col / EPS, grads[3]) < 1e-12
    assert rel(out.per_a, grads[4]) < 1e-12 and rel(out.per_b, grads[5]) < 1e-12
    assert rel(out.pt_d, grads[8]) < 1e-12


def test_plan_product_asks_only_what_each_input_needs():
    # PlanProduct's backward forms only the plan_vjp outputs its inputs' gradients use:
    # each input alone must get the gradient it gets when all are asked for
    x, y, a, b, gen = data(4, n=7, m=5, d=3)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    spec = DualSpec(EPS, (None, None), TorchBackend(budget=6), None, 1e-10)
    inputs = [
        form.q,
        form.alpha,
        form.k,
        form.beta,
        a,
        b,
        torch.randn(7, generator=gen, dtype=F64),
        torch.randn(5, generator=gen, dtype=F64),
        torch.randn(5, 2, generator=gen, dtype=F64),
    ]
    D = torch.randn(7, 2, generator=gen, dtype=F64)
    dm = torch.randn(7, generator=gen, dtype=F64)

    def grads(wanted, with_mass=True):
        leaves = [t.clone().requires_grad_(i in wanted) for i, t in enumerate(inputs)]
        out, mass = PlanProduct.apply(*leaves, spec)
        loss = (D * out).sum() + (dm * mass).sum() if with_mass else (D * out).sum()
        return torch.autograd.grad(loss, [leaves[i] for i in wanted])

    def dense(with_mass):  # (P V, P 1) of the dense plan, by autograd
        leaves = [t.clone().requires_grad_() for t in inputs]
        q, al, k, be, aa, bb, ff, gg, V = leaves
        P = aa[:, None] * bb[None, :] * torch.exp((ff[:, None] + gg[None, :] - al[:, None]
                                                   - be[None, :] + q @ k.T) / EPS)  # fmt: skip
        loss = (D * (P @ V)).sum() + (dm * P.sum(1)).sum() if with_mass else (D * (P @ V)).sum()
        return torch.autograd.grad(loss, leaves)

    for with_mass in (True, False):
        every = grads(range(9), with_mass)
        for got, want in zip(every, dense(with_mass), strict=True):
            assert rel(got, want) < 1e-12
        for i in range(9):
            assert torch.equal(grads([i], with_mass)[0], every[i]), (i, with_mass)


@pytest.mark.parametrize("rho", [None, 1.0])
def test_dual_solves_replay_kept_captures_with_new_data(monkeypatch, rho):
    # later dual solves of the same shapes replay the blocks captured by the first (here
    # a stand-in re-running the first solve's closures on the refreshed buffers): each HVP
    # equals the eager one, and one capture per block length serves all
    from flashot.autodiff import dense_dual, implicit
    from flashot.solver.graphs import GraphCache
    from tests.solver.test_graphs import Replayer

    monkeypatch.setattr(dense_dual, "DENSE_UP_TO", 0)  # (the CG's blocks, not a direct solve)

    Replayer.log = []
    monkeypatch.setattr(implicit, "_GRAPHS", GraphCache(capture=Replayer))
    monkeypatch.setattr(implicit, "_BUFFERS", type(implicit._BUFFERS)())
    kw = dict(eps=EPS, rho=rho, backend=TorchBackend(), tol=1e-13, max_iter=100_000)
    for seed in (5, 6, 7):
        x, y, a, b, gen = data(seed)
        v = torch.randn(x.shape, generator=gen, dtype=F64)
        eager = flashot.hvp(x, y, v, a, b, **kw)
        monkeypatch.setattr(implicit, "_captures", lambda backend, form: True)
        kept = flashot.hvp(x, y, v, a, b, **kw)
        monkeypatch.setattr(implicit, "_captures", lambda backend, form: False)
        assert rel(kept, eager) < 1e-12
    assert Replayer.log.count("capture") == 1 and len(implicit._BUFFERS) == 1
    # more signatures (ε) than buffers kept: the oldest go with every graph, and the
    # first signature, met again, captures anew on new buffers
    monkeypatch.setattr(implicit, "_captures", lambda backend, form: True)
    for eps in (0.6, 0.7, 0.8, 0.9, EPS):
        kept = flashot.hvp(x, y, v, a, b, **dict(kw, eps=eps))
    assert len(implicit._BUFFERS) == 4 and Replayer.log.count("capture") == 6
    assert rel(kept, eager) < 1e-12
