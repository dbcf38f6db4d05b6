import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.geometry.costs import (
    COSTS,
    attention_form,
    bounding_diameter,
    column_box,
    column_sum,
    get_cost,
)
from tests.conftest import clouds, rel
from tests.references import dense_cost


@pytest.mark.parametrize("name", sorted(COSTS))
def test_attention_form_reproduces_cost(gen, name):
    x, y = clouds(gen, 17, 23, 4)
    form = attention_form(get_cost(name), x, y)
    assert rel(form.dense(), dense_cost(x, y, name)) < 1e-13


@pytest.mark.parametrize("name", sorted(COSTS))
def test_transpose_is_cost_transpose(gen, name):
    x, y = clouds(gen, 5, 7, 2)
    form = attention_form(get_cost(name), x, y)
    assert torch.allclose(form.T.dense(), form.dense().T)


def test_centering_keeps_float32_accurate_far_from_origin(gen):
    x, y = clouds(gen, 40, 40, 3)
    ref = dense_cost(x, y)
    form = attention_form(get_cost("sqeuclidean"), (x + 1e3).float(), (y + 1e3).float())
    # inputs rounded at 1e3 carry ~6e-5 absolute error; without centering the error is ~1e-1
    assert (form.dense().double() - ref).abs().max() < 2e-3


def test_row_features_map_new_points_like_rows(gen):
    x, y = clouds(gen, 6, 5, 3)
    form = attention_form(get_cost("cosine"), x, y)
    assert torch.allclose(form.row_features(x), form.q)


def test_unknown_cost_names_argument():
    with pytest.raises(ValueError, match="cost"):
        get_cost("euclidean")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 30),
    d=st.integers(1, 4),
    block=st.integers(1, 40),
    specials=st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf")]), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_column_box_equals_one_reduction(n, d, block, specials, seed):
    """Blocks of a few rows give the one-reduction extremes, NaN and ±inf included."""
    import flashot.geometry.costs

    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, d, generator=gen)
    for value in specials:
        i, j = torch.randint(n, (1,), generator=gen), torch.randint(d, (1,), generator=gen)
        u[i, j] = value
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flashot.geometry.costs, "_BLOCK", block)
        box = column_box(u)
    expected = torch.stack(torch.aminmax(u, dim=0))
    assert box.shape == (2, d)
    assert torch.equal(box.isnan(), expected.isnan())
    assert torch.equal(box.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_column_box_of_no_rows_is_an_error():
    with pytest.raises(ValueError, match="at least one row"):
        column_box(torch.zeros(0, 3))


@pytest.mark.parametrize("block", [1, 5, 1 << 20])
def test_column_sum_is_the_sum_over_rows(monkeypatch, gen, block):
    import flashot.geometry.costs

    monkeypatch.setattr(flashot.geometry.costs, "_BLOCK", block)
    u = torch.randn(37, 3, generator=gen, dtype=torch.float64)
    assert torch.allclose(column_sum(u), u.sum(0), rtol=1e-14, atol=1e-13)


def test_bounding_diameter_is_box_diagonal():
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([[0.0, 2.0]])
    assert bounding_diameter(get_cost("sqeuclidean"), x, y) == pytest.approx(5**0.5)


@pytest.mark.parametrize("rounding", [None, "tf32", torch.bfloat16, torch.float16])
def test_in_place_form_equals_the_autograd_form(gen, rounding):
    """Without autograd the form is built in place, block by block; same numbers."""
    from flashot.geometry.costs import _round_in_place

    x = torch.randn(40_000, 3, generator=gen) * 3 + 1  # more rows than one rounding block
    y = torch.randn(50, 3, generator=gen)
    plain = attention_form(get_cost("sqeuclidean"), x, y, rounding=rounding)
    graph = attention_form(get_cost("sqeuclidean"), x.requires_grad_(), y, rounding=rounding)
    for a, b in zip(
        (plain.q, plain.k, plain.alpha, plain.beta),
        (graph.q, graph.k, graph.alpha, graph.beta),
        strict=True,
    ):
        assert torch.allclose(a, b.detach(), rtol=1e-6, atol=1e-6)
    if rounding is not None:  # the rounding is exact: rounding again changes nothing
        k = plain.k.clone()
        assert torch.equal(_round_in_place(k, rounding), plain.k)


def test_squared_norms_first_and_second_derivatives():
    """|w|² by its own autograd Function: gradcheck and gradgradcheck in float64, batched too."""
    from flashot.geometry.costs import _SquaredNorms

    gen = torch.Generator().manual_seed(0)
    for shape in [(5, 3), (2, 4, 3)]:
        w = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.allclose(_SquaredNorms.apply(w), (w * w).sum(-1), rtol=1e-14, atol=0)
        assert torch.autograd.gradcheck(_SquaredNorms.apply, (w,))
        assert torch.autograd.gradgradcheck(_SquaredNorms.apply, (w,))


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(COSTS)),
    n=st.integers(1, 40),
    d=st.integers(1, 6),
    shift=st.sampled_from([0.0, 3.0, 1e3]),
    grad=st.booleans(),
    rounding=st.sampled_from([None, "tf32", torch.bfloat16]),
    seed=st.integers(0, 99),
)
def test_self_form_is_the_form_of_the_cloud_with_itself(name, n, d, shift, grad, rounding, seed):
    """``self_attention_form(x)`` is ``attention_form(x, x.detach())`` from one centering:
    the same numbers (the column side a detached copy), an exactly symmetric matrix, the
    float64 cost, and gradients to the row side only."""
    from flashot.geometry.costs import self_attention_form

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float32) + shift
    if rounding is None:
        x = x.double()
    cost = get_cost(name)
    xs = x.clone().requires_grad_(grad)
    own = self_attention_form(cost, xs, rounding=rounding)
    xr = x.clone().requires_grad_(grad)
    ref = attention_form(cost, xr, x, rounding=rounding)
    for a, b in zip((own.q, own.k, own.alpha, own.beta), (ref.q, ref.k, ref.alpha, ref.beta),
                    strict=True):  # fmt: skip
        assert torch.allclose(a.detach(), b.detach(), rtol=1e-6, atol=1e-6 * (1 + shift) ** 2)
    dense = own.dense().detach()
    # exactly symmetric as a form (the column side is the row side scaled by a power of
    # two); the dense matrix only to rounding: a BLAS product may sum (i, j) and (j, i) in
    # different orders (cosine, n = 4, d = 5, float64 on OpenBLAS)
    two_s = 2.0 * cost.scale
    assert torch.equal(own.k, own.q.detach() / two_s) and torch.equal(own.beta, own.alpha.detach())
    tiny = 8 * torch.finfo(dense.dtype).eps * float(dense.abs().max().clamp_min(1e-30))
    assert float((dense - dense.T).abs().max()) <= tiny
    assert own.cost_bound == pytest.approx(ref.cost_bound, rel=1e-6)
    if rounding is None and shift < 1e3:
        assert (dense - dense_cost(x, x, name)).abs().max() < 1e-10 * (1 + shift) ** 2
    assert not own.k.requires_grad and not own.beta.requires_grad
    assert own.q.requires_grad == grad and own.alpha.requires_grad == grad
    if grad:  # the row side's gradients are attention_form's
        w = torch.randn(n, n, generator=gen, dtype=dense.dtype)
        (g_own,) = torch.autograd.grad((own.dense() * w).sum(), xs)
        (g_ref,) = torch.autograd.grad((ref.dense() * w).sum(), xr)
        assert rel(g_own, g_ref) < 1e-5
