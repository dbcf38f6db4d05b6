"""OTDD (flashot.tasks.otdd) against an independent float64 dense reference of its definition."""

import pytest
import torch

import flashot
from flashot.tasks.otdd import dataset_distance, gaussian_table
from tests.references import bures_wasserstein_sq, dense_cost, entropic_ot_matrix

F64 = torch.float64


def datasets(seed, n=24, m=20, d=3, ka=3, kb=2, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    ya = torch.arange(n) % ka  # every class present, at least 2 points each
    yb = torch.arange(m) % kb + 7  # label values need not start at 0
    xa = torch.randn(n, d, generator=g, dtype=F64) + ya[:, None] * 0.5
    xb = torch.randn(m, d, generator=g, dtype=F64) * 1.2 - (yb[:, None] - 7) * 0.7
    return xa.to(dtype), ya, xb.to(dtype), yb


def union_table(xa, ya, xb, yb, inner, diagonal=False, eps=None, unbiased=False):
    clouds = [xa[ya == c] for c in torch.unique(ya)] + [xb[yb == c] for c in torch.unique(yb)]
    k = len(clouds)
    t = torch.zeros(k, k, dtype=F64)
    for i in range(k):
        for j in range(k):
            if inner == "gaussian":
                t[i, j] = bures_wasserstein_sq(clouds[i], clouds[j], diagonal, unbiased)
            elif i != j:
                u, v = clouds[i].double(), clouds[j].double()
                ones = lambda z: torch.full((len(z),), 1 / len(z), dtype=F64)  # noqa: E731
                t[i, j] = (
                    entropic_ot_matrix(dense_cost(u, v), ones(u), ones(v), eps)
                    - 0.5 * entropic_ot_matrix(dense_cost(u, u), ones(u), ones(u), eps, True)
                    - 0.5 * entropic_ot_matrix(dense_cost(v, v), ones(v), ones(v), eps, True)
                )
    return t


def dense_otdd(xa, ya, xb, yb, eps, lx, ly, table, debias=True):
    ia = torch.unique(ya, return_inverse=True)[1]
    ib = torch.unique(yb, return_inverse=True)[1] + len(torch.unique(ya))
    pts = [(xa.double(), ia), (xb.double(), ib)]

    def ot(p, q):
        C = lx * dense_cost(p[0], q[0]) + ly * table[p[1]][:, q[1]]
        a = torch.full((len(p[0]),), 1 / len(p[0]), dtype=F64)
        b = torch.full((len(q[0]),), 1 / len(q[0]), dtype=F64)
        return entropic_ot_matrix(C, a, b, eps, self_problem=p is q)

    value = ot(pts[0], pts[1])
    if debias:
        value = value - 0.5 * ot(pts[0], pts[0]) - 0.5 * ot(pts[1], pts[1])
    return float(value)


@pytest.mark.parametrize("diagonal", [False, True])
def test_gaussian_table_matches_scipy_sqrtm(diagonal):
    xa, ya, xb, yb = datasets(0, d=4)
    ours = gaussian_table([xa[ya == c] for c in range(3)] + [xb[yb == c] for c in (7, 8)],
                          diagonal)  # fmt: skip
    ref = union_table(xa, ya, xb, yb, "gaussian", diagonal)
    assert torch.allclose(ours, ref, rtol=1e-9, atol=1e-10)
    assert torch.equal(ours, ours.T) and float(ours.diagonal().abs().max()) == 0.0


@pytest.mark.parametrize("diagonal", [False, True])
def test_unbiased_covariances_are_otdds_estimator(diagonal):
    xa, ya, xb, yb = datasets(2, d=4)
    ref = union_table(xa, ya, xb, yb, "gaussian", diagonal, unbiased=True)
    out = dataset_distance(xa, ya, xb, yb, eps=0.7, diagonal=diagonal, unbiased=True)
    assert torch.allclose(out.label_cost, ref, rtol=1e-9, atol=1e-10)
    biased = union_table(xa, ya, xb, yb, "gaussian", diagonal)
    assert not torch.allclose(out.label_cost, biased, rtol=1e-3)  # (the option does something)
    with pytest.raises(ValueError, match="at least two points in every class"):
        dataset_distance(xa, ya, xb[:1], yb[:1], eps=0.7, unbiased=True)
    with pytest.raises(ValueError, match="unbiased applies to inner='gaussian'"):
        dataset_distance(xa, ya, xb, yb, eps=0.7, inner="exact", unbiased=True)


@pytest.mark.parametrize("inner, debias, lx, ly", [
    ("gaussian", True, 1.0, 1.0), ("gaussian", False, 0.5, 2.0), ("exact", True, 1.0, 0.3),
])  # fmt: skip
def test_distance_matches_the_dense_definition(inner, debias, lx, ly):
    xa, ya, xb, yb = datasets(1)
    eps = 0.7
    out = dataset_distance(xa, ya, xb, yb, eps=eps, lambda_x=lx, lambda_y=ly, inner=inner,
                           debias=debias, tol=1e-12, max_iter=20000)  # fmt: skip
    table = union_table(xa, ya, xb, yb, inner, eps=eps)
    assert torch.allclose(out.label_cost, table, rtol=1e-8, atol=1e-9)
    ref = dense_otdd(xa, ya, xb, yb, eps, lx, ly, table, debias)
    assert float(out.distance) == pytest.approx(ref, rel=1e-6)
    assert out.classes_a.tolist() == [0, 1, 2] and out.classes_b.tolist() == [7, 8]


def test_class_mass_is_the_plan_summed_by_class():
    xa, ya, xb, yb = datasets(2)
    out = dataset_distance(xa, ya, xb, yb, eps=0.5, tol=1e-12, max_iter=20000)
    P = out.result.plan.dense()
    ref = torch.stack(
        [torch.stack([P[ya == c][:, yb == e].sum() for e in (7, 8)]) for c in range(3)]
    )
    assert torch.allclose(out.class_mass, ref, atol=1e-12)
    assert float(out.class_mass.sum()) == pytest.approx(1.0, abs=1e-10)
    # the result holds the datasets, not the labeled operands (made again when used)
    import gc

    gc.collect()
    assert out.result.plan._source._ref() is None


def test_self_distance_is_zero_and_swapping_is_symmetric():
    xa, ya, xb, yb = datasets(3)
    # A's copy is B: its labels index B's block of the table, so OT(A, B) is no self
    # problem to the solver; the symmetric update converges fast on such twins
    kw = dict(eps=0.5, tol=1e-12, max_iter=20000, update="symmetric")
    same = dataset_distance(xa, ya, xa, ya, **kw)
    cross = same.result.cost
    assert abs(float(same.distance)) <= 1e-8 * abs(float(cross))
    ab, ba = (
        dataset_distance(*args, **kw).distance for args in ((xa, ya, xb, yb), (xb, yb, xa, ya))
    )
    assert float(ab) == pytest.approx(float(ba), rel=1e-9)


def test_gradient_reaches_the_features_and_matches_finite_differences():
    xa, ya, xb, yb = datasets(4, n=10, m=8)
    kw = dict(eps=0.8, tol=1e-12, max_iter=20000)
    x = xa.clone().requires_grad_()
    (grad,) = torch.autograd.grad(dataset_distance(x, ya, xb, yb, **kw).distance, x)
    v = torch.randn_like(xa)
    h = 1e-5
    fd = (float(dataset_distance(xa + h * v, ya, xb, yb, **kw).distance)
          - float(dataset_distance(xa - h * v, ya, xb, yb, **kw).distance)) / (2 * h)  # fmt: skip
    # the table depends on the features too (class statistics), held fixed by the flow's
    # gradient: compare with the table frozen at xa
    table = dataset_distance(xa, ya, xb, yb, **kw).label_cost
    cost = flashot.labeled_cost(table)
    la = lambda z: torch.cat([z, ya[:, None].double()], 1)  # noqa: E731
    lb = torch.cat([xb, (3 + yb - 7)[:, None].double()], 1)

    def frozen(z):
        val = flashot.sinkhorn(la(z), lb, eps=0.8, cost=cost, tol=1e-12, max_iter=20000).cost
        return val - 0.5 * flashot.sinkhorn(la(z), la(z), eps=0.8, cost=cost, tol=1e-12,
                                             max_iter=20000).cost  # fmt: skip

    fd_frozen = (float(frozen(xa + h * v)) - float(frozen(xa - h * v))) / (2 * h)
    assert float((grad * v).sum()) == pytest.approx(fd_frozen, rel=1e-5)
    assert fd != pytest.approx(fd_frozen, rel=1e-6)  # the statistics' share is real


@pytest.mark.parametrize("args, match", [
    (dict(ya=torch.zeros(5, dtype=torch.long)), "ya must hold one integer label per row"),
    (dict(yb=torch.zeros(20)), "yb must hold one integer label"),
    (dict(xb=torch.randn(20, 5, dtype=F64)), "same feature size"),
    (dict(inner="bures"), "inner must be one of"),
])  # fmt: skip
def test_mistakes_name_the_argument(args, match):
    xa, ya, xb, yb = datasets(5)
    kw = dict(xa=xa, ya=ya, xb=xb, yb=yb) | args
    with pytest.raises(ValueError, match=match):
        dataset_distance(
            kw["xa"], kw["ya"], kw["xb"], kw["yb"], eps=0.5, inner=kw.get("inner", "gaussian")
        )


@pytest.mark.slow
def test_the_kernels_agree_with_the_torch_backend():
    from flashot.backends import available_backends

    if "triton" not in available_backends("cpu"):
        pytest.skip("triton unavailable on the CPU")
    xa, ya, xb, yb = datasets(6)
    ref = dataset_distance(xa, ya, xb, yb, eps=0.6, tol=1e-12, max_iter=20000)
    out = dataset_distance(xa.float(), ya, xb.float(), yb, eps=0.6, backend="triton")
    assert float(out.distance) == pytest.approx(float(ref.distance), rel=2e-5)
    assert torch.allclose(out.class_mass.double(), ref.class_mass, atol=1e-6)


@pytest.mark.parametrize("flow", [False, True])
def test_peak_memory_in_clouds(flow, monkeypatch):
    """Cloud-sized tensors alive at once, beyond the inputs (blocks of the in-place passes
    set small, as they are against a cloud at full size). The distance: one attention
    form and the class statistics' temporaries (2.2 clouds here; it was 5.3
    with two labeled copies and a centered one, and 10 before: every class in float64
    twice, three forms). A flow step: one problem's graph at a time (5.1; it was 10)."""
    import flashot.geometry.costs
    from flashot.backends.torch_backend import TorchBackend
    from flashot.tasks.flows import dataset_flow
    from tests.live_memory import LiveTensors

    monkeypatch.setattr(flashot.geometry.costs, "_BLOCK", 1 << 12)
    gen = torch.Generator().manual_seed(0)
    n, d = 400, 60
    xa, xb = torch.rand(n, d, generator=gen), torch.rand(n, d, generator=gen)
    ya, yb = torch.arange(n) % 4, torch.arange(n) % 3
    cloud = n * d * 4
    kw = dict(eps=1.0, diagonal=True, max_iter=5, backend=TorchBackend(budget=2048))
    with LiveTensors(cloud // 4) as live:
        live.ignore(xa, xb)
        if flow:
            dataset_flow(xa, ya, xb, yb, steps=1, progress=False, **kw)
        else:
            dataset_distance(xa, ya, xb, yb, **kw)
    assert live.peak / cloud < (5.3 if flow else 2.5)


def test_numpy_datasets_give_the_tensor_results():
    xa, ya, xb, yb = datasets(4)
    kw = dict(eps=0.5, tol=1e-10, max_iter=20000)
    want = dataset_distance(xa, ya, xb, yb, **kw)
    got = dataset_distance(xa.numpy(), ya.numpy(), xb.numpy(), yb.numpy(), **kw)
    assert isinstance(got.distance, torch.Tensor) and torch.equal(got.distance, want.distance)
    assert torch.equal(got.class_mass, want.class_mass)
