"""Labeled costs (flashot.geometry.labeled) against the dense augmented cost, on every backend."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.geometry.costs import attention_form
from tests.references import dense_cost, entropic_ot_matrix

F64 = torch.float64


def labeled(x, labels):
    return torch.cat([x, labels[:, None].to(x.dtype)], 1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6), d=st.integers(1, 5),
       lx=st.floats(0.1, 3.0), ly=st.floats(0.0, 3.0), half=st.booleans())  # fmt: skip
def test_the_form_is_the_augmented_cost(seed, k, d, lx, ly, half):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(7, d, generator=g, dtype=F64), torch.randn(5, d, generator=g, dtype=F64)
    lab_x, lab_y = torch.randint(0, k, (7,), generator=g), torch.randint(0, k, (5,), generator=g)
    table = 4 * torch.rand(k, k, generator=g, dtype=F64)
    base = "half_sqeuclidean" if half else "sqeuclidean"
    cost = flashot.labeled_cost(table, lx, ly, base)
    form = attention_form(cost, labeled(x, lab_x), labeled(y, lab_y))
    C = form.alpha[:, None] + form.beta[None, :] - form.q @ form.k.T
    ref = lx * dense_cost(x, y, base) + ly * table[lab_x][:, lab_y]
    assert torch.allclose(C, ref, rtol=1e-12, atol=1e-12)
    assert form.cost_bound >= float(ref.max()) * (1 - 1e-12)
    # maps at new labeled points use the same features
    assert torch.allclose(form.row_features(labeled(x, lab_x)), form.q)
    assert torch.allclose(form.col_features(labeled(y, lab_y)), form.k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_solves_match_the_dense_reference_on_each_backend(backend):
    if backend not in available_backends("cpu"):
        pytest.skip(f"{backend} unavailable on the CPU")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=g, dtype=F64), torch.randn(30, 3, generator=g, dtype=F64)
    lab_x, lab_y = torch.randint(0, 3, (40,), generator=g), torch.randint(1, 4, (30,), generator=g)
    table = torch.rand(4, 4, generator=g, dtype=F64) * 5
    cost = flashot.labeled_cost(table, 0.8, 1.5)
    C = 0.8 * dense_cost(x, y) + 1.5 * table[lab_x][:, lab_y]
    a, b = torch.full((40,), 1 / 40, dtype=F64), torch.full((30,), 1 / 30, dtype=F64)
    ref = float(entropic_ot_matrix(C, a, b, 0.5))
    dtype, rel = (F64, 1e-9) if backend == "torch" else (torch.float32, 1e-5)
    res = flashot.sinkhorn(labeled(x, lab_x).to(dtype), labeled(y, lab_y).to(dtype), eps=0.5,
                           cost=cost, backend=backend, max_iter=5000)  # fmt: skip
    assert res.converged and float(res.cost) == pytest.approx(ref, rel=rel)


def test_gradients_reach_features_not_labels():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 2, generator=g, dtype=F64), torch.randn(9, 2, generator=g, dtype=F64)
    lab_x, lab_y = torch.randint(0, 2, (12,), generator=g), torch.randint(0, 2, (9,), generator=g)
    cost = flashot.labeled_cost(torch.tensor([[0.0, 2.0], [2.0, 0.0]]))
    xs = labeled(x, lab_x).requires_grad_()
    (grad,) = torch.autograd.grad(flashot.sinkhorn(xs, labeled(y, lab_y), eps=0.5, cost=cost,
                                                   tol=1e-12).cost, xs)  # fmt: skip
    assert float(grad[:, -1].abs().max()) == 0.0
    # features: the envelope gradient a_i Σ_j P_ij ∂C/∂x_i with the dense plan
    xd = x.clone().requires_grad_()
    C = ((xd[:, None] - y[None]) ** 2).sum(-1) + cost.table[lab_x][:, lab_y]
    res = flashot.sinkhorn(labeled(x, lab_x), labeled(y, lab_y), eps=0.5, cost=cost, tol=1e-12)
    P = res.plan.dense()
    (ref,) = torch.autograd.grad((P * C).sum(), xd)
    assert torch.allclose(grad[:, :-1], ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("table, kw, match", [
    (torch.ones(2, 3), {}, "square"),
    (torch.tensor([[0.0, -1.0], [1.0, 0.0]]), {}, "nonnegative"),
    (torch.tensor([[0.0, float("nan")], [1.0, 0.0]]), {}, "finite"),
    (torch.zeros(2, 2), dict(lambda_x=0.0), "lambda_x"),
    (torch.zeros(2, 2), dict(lambda_y=-1.0), "lambda_y"),
    (torch.zeros(2, 2), dict(base="cosine"), "base"),
])  # fmt: skip
def test_bad_tables_and_weights_are_named(table, kw, match):
    with pytest.raises(ValueError, match=match):
        flashot.labeled_cost(table, **kw)


@pytest.mark.parametrize("label, match", [(2.0, "0 … 1"), (0.5, "integers"), (-1.0, "0 … 1")])
def test_labels_outside_the_table_are_named(label, match):
    cost = flashot.labeled_cost(torch.zeros(2, 2))
    x = torch.zeros(3, 3)
    y = x.clone()
    y[1, -1] = label
    with pytest.raises(ValueError, match=f"y's last column.*{match}"):
        flashot.sinkhorn(x, y, eps=1.0, cost=cost)
    with pytest.raises(ValueError, match="x must be \\(n, d \\+ 1\\)"):
        flashot.sinkhorn(torch.zeros(3, 1), torch.zeros(3, 1), eps=1.0, cost=cost)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_labels_held_by_the_cost_give_the_labeled_points_solve(backend):
    """``cost.with_labels(lx, ly)`` between plain features equals the labeled points'
    solve: value, potentials and the features' gradient (float64 on the torch backend,
    float32 in the interpreter for the kernels)."""
    if backend not in available_backends(torch.device("cpu")):
        pytest.skip(f"{backend} unavailable")
    dtype = F64 if backend == "torch" else torch.float32
    g = torch.Generator().manual_seed(4)
    x = torch.randn(23, 3, generator=g, dtype=dtype)
    y = torch.randn(17, 3, generator=g, dtype=dtype)
    lab_x, lab_y = torch.randint(0, 3, (23,), generator=g), torch.randint(0, 3, (17,), generator=g)
    cost = flashot.labeled_cost(3 * torch.rand(3, 3, generator=g, dtype=F64), 0.7, 1.3)
    kw = dict(eps=0.5, tol=None, max_iter=30, backend=backend)
    xs = labeled(x, lab_x).requires_grad_()
    want = flashot.sinkhorn(xs, labeled(y, lab_y), cost=cost, **kw)
    (want_grad,) = torch.autograd.grad(want.cost, xs)
    xf = x.clone().requires_grad_()
    got = flashot.sinkhorn(xf, y, cost=cost.with_labels(lab_x, lab_y), **kw)
    (got_grad,) = torch.autograd.grad(got.cost, xf)
    rel = 1e-12 if dtype == F64 else 1e-5
    assert float(got.cost) == pytest.approx(float(want.cost), rel=rel)
    assert torch.allclose(got.f, want.f, rtol=rel, atol=rel)
    assert torch.allclose(got_grad, want_grad[:, :-1], rtol=rel * 10, atol=rel)


def test_held_labels_are_checked():
    cost = flashot.labeled_cost(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="labels_y must be a 1-D integer tensor of indices 0 … 1"):
        cost.with_labels(torch.zeros(3, dtype=torch.long), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="labels_x must be"):
        cost.with_labels(torch.zeros(3), torch.zeros(3, dtype=torch.long))
    bound = cost.with_labels(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"y must be \(4, d\) features: this cost holds"):
        flashot.sinkhorn(torch.zeros(3, 2), torch.zeros(5, 2), eps=1.0, cost=bound)


def test_second_derivatives_of_labeled_values_match_finite_differences():
    """The operands' Function is differentiable twice (create_graph): the HVP of a
    labeled self problem's value (x given twice) against central differences of its
    gradient, float64."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(15, 2, generator=g, dtype=F64)
    lab = torch.randint(0, 2, (15,), generator=g)
    cost = flashot.labeled_cost(torch.tensor([[0.0, 1.5], [1.5, 0.0]], dtype=F64)).with_labels(
        lab, lab)  # fmt: skip
    v = torch.randn(15, 2, generator=g, dtype=F64)

    def grad_at(z, create_graph=False):
        z = z.detach().requires_grad_() if not create_graph else z
        value = flashot.sinkhorn(z, z, eps=0.7, cost=cost, tol=1e-13, max_iter=5000).cost
        return torch.autograd.grad(value, z, create_graph=create_graph)[0]

    xs = x.clone().requires_grad_()
    (hv,) = torch.autograd.grad((grad_at(xs, create_graph=True) * v).sum(), xs)
    h = 1e-5
    fd = (grad_at(x + h * v) - grad_at(x - h * v)) / (2 * h)
    assert torch.allclose(hv, fd, rtol=1e-5, atol=1e-7)
