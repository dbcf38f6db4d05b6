import numpy as np
import pytest
import torch

import flashot
from tests.conftest import clouds, cuda_clouds, rel, weights
from tests.references import dense_cost, plan_dense

F64 = torch.float64


@pytest.fixture(params=[None, 0.9])
def solved(gen, request):
    x, y = clouds(gen, 23, 31, 3)
    a, b = weights(gen, 23), weights(gen, 31)
    res = flashot.sinkhorn(x, y, a, b, eps=0.3, rho=request.param, tol=1e-11, max_iter=20000)
    P = plan_dense(
        dense_cost(x, y), res.plan._log_a.exp(), res.plan._log_b.exp(), res.f, res.g, 0.3
    )
    return x, y, res, P


def test_dense_plan_matches_formula(solved):
    _, _, res, P = solved
    assert rel(res.plan.dense(), P) < 1e-12


def test_plan_products_match_dense(solved, gen):
    _, _, res, P = solved
    V = torch.randn(31, 4, generator=gen, dtype=F64)
    U = torch.randn(23, 2, generator=gen, dtype=F64)
    v = torch.randn(31, generator=gen, dtype=F64)
    assert rel(res.plan @ V, P @ V) < 1e-12
    assert rel(res.plan.T @ U, P.T @ U) < 1e-12
    assert (res.plan @ v).shape == (23,) and rel(res.plan @ v, P @ v) < 1e-12
    assert rel(res.plan.row_sums(), P.sum(1)) < 1e-12
    assert rel(res.plan.col_sums(), P.sum(0)) < 1e-12


def test_transport_cost_and_barycentric_map(solved):
    x, y, res, P = solved
    C = dense_cost(x, y)
    assert rel(res.transport_cost, (P * C).sum()) < 1e-10
    assert rel(res.plan.barycentric_map(), (P @ y) / P.sum(1, keepdim=True)) < 1e-12
    assert rel(res.plan.T.barycentric_map(), (P.T @ x) / P.sum(0)[:, None]) < 1e-12


def test_map_at_new_points_extends_the_barycentric_map(solved, gen):
    x, y, res, _ = solved
    assert rel(res.plan.barycentric_map(x), res.plan.barycentric_map()) < 1e-12
    z = torch.randn(5, 3, generator=gen, dtype=F64)
    C = dense_cost(z, y)
    logw = res.plan._log_b + (res.g - C) / 0.3
    assert rel(res.plan.barycentric_map(z), torch.softmax(logw, 1) @ y) < 1e-12


def test_balanced_marginals_are_met(gen):
    x, y = clouds(gen, 40, 30, 2)
    res = flashot.sinkhorn(x, y, eps=0.5, tol=1e-10, max_iter=10000)
    assert rel(res.plan.row_sums(), torch.full((40,), 1 / 40, dtype=F64)) < 1e-9
    assert rel(res.plan.col_sums(), torch.full((30,), 1 / 30, dtype=F64)) < 1e-9


def test_dense_refuses_large_plans(gen):
    x, y = clouds(gen, 50, 50, 2)
    res = flashot.sinkhorn(x, y, eps=1.0)
    with pytest.raises(ValueError, match="max_elements"):
        res.plan.dense(max_elements=100)


def test_plan_product_validates_values(solved):
    _, _, res, _ = solved
    with pytest.raises(ValueError, match="V must have shape"):
        res.plan @ torch.ones(5, 2, dtype=F64)
    with pytest.raises(TypeError, match=r"V must be a torch\.Tensor"):
        res.plan @ [1.0, 2.0]
    with pytest.raises(TypeError, match="floating"):
        res.plan @ torch.ones(31, dtype=torch.int64)


def test_float32_plan_product_accuracy(gen):
    x, y = clouds(gen, 64, 80, 3)
    r32 = flashot.sinkhorn(x.float(), y.float(), eps=0.2, tol=1e-5)
    P = plan_dense(
        dense_cost(x, y),
        torch.full((64,), 1 / 64, dtype=F64),
        torch.full((80,), 1 / 80, dtype=F64),
        r32.f.double(),
        r32.g.double(),
        0.2,
    )
    V = torch.randn(80, 3, generator=gen)
    assert rel(r32.plan @ V, P @ V.double()) < 1e-5


def test_plan_product_is_differentiable_in_v(gen):
    x, y = clouds(gen, 12, 9, 2)
    res = flashot.sinkhorn(x, y, eps=0.5, tol=1e-12, max_iter=5000)
    v = torch.randn(9, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: res.plan @ v, (v,))
    assert torch.autograd.gradcheck(
        lambda u: res.plan.T @ u, (torch.randn(12, 3, dtype=torch.float64, requires_grad=True),)
    )


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("rho", [None, 0.9])
def test_row_blocks_of_a_plan_are_its_rows(gen, name, rho):
    """plan[lo:hi] is P[lo:hi]: products, marginals and the transpose, for any slice
    (whole, inner, negative, clipped, empty), on both backends (the kernels under the
    interpreter, in float32)."""
    from tests.backends.test_base import exact, make_backend

    dtype, tol = exact(name)
    x, y = (t.to(dtype) for t in clouds(gen, 23, 31, 3))
    a, b = (t.to(dtype) for t in (weights(gen, 23), weights(gen, 31)))
    res = flashot.sinkhorn(x, y, a, b, eps=0.3, rho=rho, tol=1e-5 if name == "triton" else 1e-11,
                           max_iter=20000, backend=make_backend(name, "cpu"))  # fmt: skip
    P = plan_dense(dense_cost(x.double(), y.double()), a.double(), b.double(), res.f.double(),
                   res.g.double(), 0.3)  # fmt: skip
    V = torch.randn(31, 4, generator=gen, dtype=F64).to(dtype)
    for rows in (slice(0, 23), slice(5, 11), slice(-4, None), slice(20, 99), slice(7, 7)):
        block = res.plan[rows]
        n = len(range(23)[rows])
        assert block.shape == (n, 31)
        if n == 0:  # an empty block holds no mass
            assert (block @ V).shape == (0, 4) and block.row_sums().shape == (0,)
            assert torch.equal(block.T @ torch.ones(0, dtype=dtype), torch.zeros(31, dtype=dtype))
            continue
        assert rel((block @ V).double(), P[rows] @ V.double()) < tol
        assert rel(block.row_sums().double(), P[rows].sum(1)) < tol
        ones = torch.ones(n, dtype=dtype)
        assert rel((block.T @ ones).double(), P[rows].sum(0)) < tol
    with pytest.raises(ValueError, match="step 1"):
        res.plan[::2]
    with pytest.raises(TypeError, match="slice"):
        res.plan[3]


def test_row_blocks_refuse_plans_that_need_gradients_and_stale_plans(gen):
    x, y = clouds(gen, 12, 9, 2)
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable in x"):
        flashot.sinkhorn(xg, y, eps=0.5).plan[0:4]
    res = flashot.sinkhorn(x, y, eps=0.5)
    block = res.plan[2:6]
    v = torch.randn(9, 2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: block @ v, (v,))  # still differentiable in V
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="y changed in place"):
        block @ torch.ones(9, dtype=F64)
    with pytest.raises(RuntimeError, match="y changed in place"):
        res.plan[0:3]


def test_in_place_changes_of_the_inputs_are_detected(gen):
    x, y = clouds(gen, 12, 9, 2)
    res = flashot.sinkhorn(x, y, eps=0.5)
    y.add_(1.0)  # e.g. an optimizer step
    with pytest.raises(RuntimeError, match="y changed in place"):
        res.plan.barycentric_map()
    with pytest.raises(RuntimeError, match="y changed in place"):
        res.plan @ torch.ones(9, dtype=torch.float64)


@pytest.mark.parametrize("cost", ["sqeuclidean", "half_sqeuclidean", "cosine"])
def test_target_side_map_at_new_points(gen, cost):
    # was: plan.T.barycentric_map(y) differed from plan.T.barycentric_map() by 0.99
    x, y = clouds(gen, 30, 25, 2)
    res = flashot.sinkhorn(x, y, eps=0.5, cost=cost, tol=1e-12, max_iter=10000)
    assert torch.allclose(res.plan.T.barycentric_map(y), res.plan.T.barycentric_map(), atol=1e-12)
    assert torch.allclose(res.plan.barycentric_map(x), res.plan.barycentric_map(), atol=1e-12)
    # the map at a new target point z: softmax_i((f_i - C(x_i, z))/eps + log a_i) x_i
    z = torch.randn(4, 2, generator=gen, dtype=torch.float64)
    C = dense_cost(x, z, cost)
    w = torch.softmax((res.f.detach()[:, None] - C) / 0.5 + torch.log(torch.tensor(1 / 30)), 0)
    assert torch.allclose(res.plan.T.barycentric_map(z), w.T @ x, atol=1e-12)


def test_inverse_transform_matches_pot(gen):
    ot = pytest.importorskip("ot")
    x, y = clouds(gen, 30, 25, 2)
    res = flashot.sinkhorn(x, y, eps=0.5, tol=1e-12, max_iter=10000)
    st = ot.da.SinkhornTransport(reg_e=0.5, metric="sqeuclidean", norm=None, max_iter=10000,
                                 tol=1e-12)  # fmt: skip
    st.fit(Xs=x.numpy(), Xt=y.numpy())
    new = torch.tensor([[0.3, -0.2], [2.0, 1.5]], dtype=torch.float64)
    assert np.allclose(
        res.plan.T.barycentric_map(new).numpy(), st.inverse_transform(Xt=new.numpy()), atol=1e-6
    )
    assert np.allclose(
        res.plan.T.barycentric_map().numpy(), st.inverse_transform(Xt=y.numpy()), atol=1e-6
    )


def test_repr_is_one_short_line():
    import warnings

    x, y = torch.randn(50, 2, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64)
    res = flashot.sinkhorn(x.requires_grad_(), y, eps=0.5)
    text = repr(res)
    assert "\n" not in text and len(text) < 120 and "tensor" not in text
    assert f"cost={float(res.cost.detach()):.6g}" in text and "n=50, m=40" in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        short = flashot.sinkhorn(x, y, eps=0.5, max_iter=2)
    assert repr(short).endswith("converged=False, cause='max_iter')")


@pytest.mark.parametrize("cost", ["sqeuclidean", "cosine", "labeled"])
def test_results_pickle_and_torch_save_round_trip(gen, cost, tmp_path):
    """torch.save / torch.load (and pickle) of a SinkhornResult keep its values and a
    working lazy plan (products, maps at new points, marginals); the saved plan is a
    detached snapshot even when the solve had gradients."""
    import pickle

    x, y = clouds(gen, 25, 20, 3)
    if cost == "labeled":
        x = torch.cat([x, (torch.arange(25) % 3)[:, None].double()], 1)
        y = torch.cat([y, (torch.arange(20) % 2)[:, None].double()], 1)
        cost = flashot.labeled_cost(torch.rand(3, 3, generator=gen, dtype=torch.float64))
    xs = x.clone().requires_grad_()
    res = flashot.sinkhorn(xs, y, eps=0.3, cost=cost)
    V = torch.randn(20, 2, generator=gen, dtype=torch.float64)
    z = x[:4].clone()
    z[:, :3] += 0.05  # (labels, if any, kept)
    torch.save(res, tmp_path / "res.pt")
    for back in (torch.load(tmp_path / "res.pt", weights_only=False),
                 pickle.loads(pickle.dumps(res))):  # fmt: skip
        assert back.n_iter == res.n_iter and back.eps == res.eps and repr(back) == repr(res)
        assert not back.cost.requires_grad and torch.equal(back.cost, res.cost.detach())
        assert torch.equal(back.f, res.f) and torch.equal(back.g, res.g)
        with torch.no_grad():
            assert torch.equal(back.plan @ V, res.plan @ V)
            assert torch.equal(back.plan.T @ back.f, res.plan.T @ res.f)
            assert torch.equal(back.plan.barycentric_map(z), res.plan.barycentric_map(z))
        assert back.marginal_error == res.marginal_error
        assert not (back.plan @ V).requires_grad


def test_triton_backend_options_set_later_reach_its_operands():
    """The operands' conversions follow the backend's precision and presplit however
    they are set (one value for both; a stale mode would pick the wrong MMA silently)."""
    from flashot.backends.triton import TritonBackend

    be = TritonBackend()
    be.operands.cache.append(("stale", 0, None))
    be.precision = "bf16"
    assert be.operands.precision == "bf16" and be.operands.cache == []
    assert not be.operands.splits(1)  # half copies, never splits, in bf16
    be.precision, be.presplit = "fp32", True
    assert be.operands.presplit is True and be.operands.splits(1)
    with pytest.raises(TypeError, match="presplit"):
        be.presplit = "yes"
    with pytest.raises(ValueError, match="precision"):
        be.precision = "fp8"
    assert be.precision == be.operands.precision == "fp32"


def test_triton_backend_pickles_without_its_caches():
    import pickle

    from flashot.backends.triton import TritonBackend

    be = TritonBackend("tf32", fused=False, splits=2)
    be.operands.cache.append(("stale", 0, None))
    back = pickle.loads(pickle.dumps(be))
    assert (back.precision, back.fused, back.splits, back.operands.cache) == ("tf32", False, 2, [])
    assert back.launch_key() == be.launch_key()


@pytest.mark.parametrize("rho", [None, 0.9, (None, 2.0)])
def test_primal_dual_objectives_and_gap_match_the_dense_plan(gen, rho):
    """primal_cost, dual_cost, kl and the duality gap against the dense float64 plan
    of the same potentials, converged and not; weak duality on relaxed problems."""
    from tests.references import kl, primal

    x, y = clouds(gen, 23, 31, 3)
    a, b = weights(gen, 23), weights(gen, 31)
    eps = 0.3
    C = dense_cost(x, y)
    rhos = rho if isinstance(rho, tuple) else (rho, rho)
    for kw in (dict(tol=1e-12, max_iter=20000), dict(tol=None, max_iter=3)):
        res = flashot.sinkhorn(x, y, a, b, eps=eps, rho=rho, **kw)
        wa, wb = res.plan._log_a.exp(), res.plan._log_b.exp()
        P = plan_dense(C, wa, wb, res.f, res.g, eps)
        assert rel(res.primal_cost, primal(C, wa, wb, P, eps, rhos)) < 1e-12
        assert rel(res.kl, kl(P, wa[:, None] * wb[None, :])) < 1e-9

        def phi(pot, r):
            return pot if r is None else r * (1 - torch.exp(-pot / r))

        dual = ((wa * phi(res.f, rhos[0])).sum() + (wb * phi(res.g, rhos[1])).sum()
                - eps * (P.sum() - wa.sum() * wb.sum()))  # fmt: skip
        assert rel(res.dual_cost, dual) < 1e-12
        gap = res.duality_gap
        if rhos[0] is not None and rhos[1] is not None:  # every plan is feasible
            assert gap >= -1e-12
        if kw["tol"] is not None:
            assert abs(gap) < 1e-9
        else:
            assert abs(gap) > 1e-6  # three iterations are far from the optimum


@pytest.mark.parametrize("cost,rho", [("sqeuclidean", None), ("cosine", 0.7), ("labeled", None)])
def test_potentials_at_new_points_are_the_soft_c_transform(gen, cost, rho):
    """plan.source_potential(z) is −ε log Σ_j b_j e^{(g_j − C(z, y_j))/ε} (damped when
    relaxed) against the dense formula; on the clouds the solve's own f and g; a pickled
    plan keeps it."""
    import pickle

    x, y = clouds(gen, 25, 20, 3)
    z = torch.randn(7, 3, generator=gen, dtype=F64)
    if cost == "labeled":
        lab = lambda t, k: torch.cat([t, (torch.arange(len(t)) % k)[:, None].double()], 1)  # noqa: E731
        x, y, z = lab(x, 3), lab(y, 3), lab(z, 3)
        cost = flashot.labeled_cost(torch.rand(3, 3, generator=gen, dtype=F64))
    eps = 0.4
    res = flashot.sinkhorn(x, y, eps=eps, cost=cost, rho=rho, tol=1e-13, max_iter=50000)
    b = res.plan._log_b.exp()
    lam = 1.0 if rho is None else rho / (rho + eps)
    C = dense_cost(z, y, cost) if isinstance(cost, str) else cost_of(cost, z, y)
    want = -lam * eps * torch.logsumexp((res.g[None] - C) / eps + b.log()[None], 1)
    assert rel(res.plan.source_potential(z), want) < 1e-12
    assert rel(res.plan.source_potential(x), res.f) < 1e-9
    assert rel(res.plan.T.source_potential(y), res.g) < 1e-9
    back = pickle.loads(pickle.dumps(res.plan))
    assert torch.equal(back.source_potential(z), res.plan.source_potential(z))
    with pytest.raises(ValueError, match="points must have shape"):
        res.plan.source_potential(z[:, :2])


def cost_of(cost, z, y):
    """The labeled cost between labeled points, densely (feature part + table)."""
    lz, ly = z[:, -1].long(), y[:, -1].long()
    feat = cost.scale * torch.cdist(z[:, :-1], y[:, :-1]) ** 2  # (λ_x folded into scale)
    return feat + cost.lambda_y * cost.table[lz][:, ly]


def _mode_calls():
    from flashot.compat import pot
    from flashot.tasks.otdd import dataset_distance

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 2, generator=g), torch.randn(30, 2, generator=g) + 0.5
    xb, yb = torch.randn(3, 20, 2, generator=g), torch.randn(3, 15, 2, generator=g)
    lx, ly = torch.randint(0, 3, (40,), generator=g), torch.randint(0, 3, (30,), generator=g)
    v, vb = torch.randn(30, 3, generator=g), torch.randn(3, 15, 2, generator=g)
    d = torch.randn(40, 2, generator=g)

    def plan_outputs(r):
        return [r.cost, r.f, r.g, r.plan @ v, r.plan.T @ d, r.transport_cost,
                r.plan.barycentric_map(), r.plan[:10] @ v]  # fmt: skip

    def distance(out):
        return [torch.as_tensor(getattr(out, "distance", out))]

    return {
        "sinkhorn": lambda: plan_outputs(flashot.sinkhorn(x, y, eps=0.1)),
        "sinkhorn-fixed": lambda: [flashot.sinkhorn(x, y, eps=0.1, tol=None, max_iter=20).cost],
        "sinkhorn-relaxed": lambda: plan_outputs(flashot.sinkhorn(x, y, eps=0.1, rho=1.0)),
        "divergence": lambda: [flashot.sinkhorn_divergence(x, y, eps=0.1)],
        "samples_loss": lambda: [flashot.SamplesLoss()(x, y)],
        "samples_loss-potentials": lambda: list(flashot.SamplesLoss(potentials=True)(x, y)),
        "batched": lambda: [(r := flashot.sinkhorn(xb, yb, eps=0.1)).cost, r.f, r.plan @ vb],
        "batched-samples_loss": lambda: [flashot.SamplesLoss()(xb, yb)],
        "batched-divergence": lambda: [flashot.sinkhorn_divergence(xb, yb, eps=0.2)],
        "otdd": lambda: distance(dataset_distance(x, lx, y, ly, eps=0.5)),
        "hvp": lambda: [flashot.hvp(x, y, d, eps=0.5)],
        "hessian_operator": lambda: [flashot.HessianOperator(x, y, eps=0.5)(d)],
        "pot": lambda: [
            torch.as_tensor(pot.empirical_sinkhorn2(x, y, 0.5)),
            pot.solve_sample(x, y, reg=0.5).value,
        ],
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(_mode_calls()))
def test_inference_mode_and_no_grad_give_the_plain_numbers(name):
    """torch.inference_mode crashed flashot.sinkhorn ("Inference tensors do not track
    version counter"), and everything built on it; each entry point now gives the same
    numbers in plain, no_grad and inference mode (an HVP runs outside inference mode)."""
    call = _mode_calls()[name]
    out = {}
    for mode, ctx in (("plain", torch.enable_grad), ("no_grad", torch.no_grad),
                      ("inference", torch.inference_mode)):  # fmt: skip
        with ctx():
            out[mode] = [t.clone() for t in call()]
    for mode in ("no_grad", "inference"):
        assert all(torch.equal(a, b) for a, b in zip(out["plain"], out[mode], strict=True))


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
def test_plan_products_match_float64():
    x, y = cuda_clouds(3000, 2000, 16)
    v = torch.randn(2000, 5, device="cuda")
    ref = flashot.sinkhorn(x.double(), y.double(), eps=1.0, tol=1e-9, backend="torch")
    # the plan's error follows the marginal error: tol 1e-5 gives ~1e-4 on P @ v (float32
    # torch backend too), 1e-6 gives ~3e-6
    res = flashot.sinkhorn(x, y, eps=1.0, tol=1e-6, backend="triton")
    assert rel((res.plan @ v).double(), ref.plan @ v.double()) < 1e-4
    assert rel(res.plan.barycentric_map().double(), ref.plan.barycentric_map()) < 1e-4
    assert rel(res.transport_cost.double(), ref.transport_cost) < 1e-4


@pytest.mark.parametrize("cost", ["sqeuclidean", "cosine"])
def test_a_result_keeps_the_clouds_not_its_form(gen, cost):
    """Without autograd a plan makes its attention form again when used (LazyForm): the
    result holds x and y, not two more cloud-sized operands, and its products, blocks,
    transpose and pickle agree with the dense plan."""
    import gc
    import pickle

    from flashot.geometry.costs import LazyForm

    x, y = clouds(gen, 40, 30, 3)
    with torch.no_grad():
        res = flashot.sinkhorn(x, y, eps=0.3, cost=cost, tol=1e-9)
    gc.collect()
    source = res.plan._source
    assert isinstance(source, LazyForm) and source._ref() is None  # (no form alive)
    a, b = res.plan._log_a.exp(), res.plan._log_b.exp()
    P = plan_dense(dense_cost(x, y, cost), a, b, res.f, res.g, 0.3)
    v = torch.randn(30, 2, generator=gen, dtype=F64)
    u = torch.randn(40, generator=gen, dtype=F64)
    assert rel(res.plan @ v, P @ v) < 1e-10 and rel(res.plan.T @ u, P.T @ u) < 1e-10
    assert rel(res.plan[5:17] @ v, P[5:17] @ v) < 1e-10
    again = pickle.loads(pickle.dumps(res))
    assert rel(again.plan @ v, P @ v) < 1e-10
    # with autograd the plan keeps its (differentiable) form
    xs = x.clone().requires_grad_()
    assert not isinstance(flashot.sinkhorn(xs, y, eps=0.3, cost=cost).plan._source, LazyForm)
