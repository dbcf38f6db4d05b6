"""Batched and ragged solves (flashot.batched) against per-problem solves and the
float64 dense reference; the Triton backend's segmented kernel in the interpreter."""

import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.backends.dual import Potentials
from flashot.batched import sinkhorn_batched, sinkhorn_varlen
from tests.conftest import rel
from tests.references import dense_cost, entropic_ot, geomloss_loop, plan_dense, sinkhorn_dense

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ragged(gen, sizes, d=3, dtype=torch.float64, device="cpu"):
    """Per-problem clouds, their concatenations and offsets."""
    xs = [(0.5 * torch.randn(n, d, generator=gen, dtype=dtype)).to(device) for n, _ in sizes]
    ys = [(0.5 * torch.randn(m, d, generator=gen, dtype=dtype) + 0.5).to(device) for _, m in sizes]
    xo = [0, *itertools.accumulate(n for n, _ in sizes)]
    yo = [0, *itertools.accumulate(m for _, m in sizes)]
    return xs, ys, xo, yo


def ragged_sizes(lo: int, hi: int, most: int = 4):
    """Hypothesis: 1 … ``most`` problems of ``lo`` … ``hi`` points per cloud."""
    return st.lists(st.tuples(st.integers(lo, hi), st.integers(lo, hi)), min_size=1,
                    max_size=most)  # fmt: skip


def eps_lists(lo: float, hi: float, count: int = 4):
    """Hypothesis: ``count`` values of ε (or of a relative ε) in [lo, hi]."""
    return st.lists(st.floats(lo, hi), min_size=count, max_size=count)


SEEDS = st.integers(0, 2**16)


@settings(max_examples=12, deadline=None)
@given(
    sizes=ragged_sizes(1, 12),
    eps=eps_lists(0.3, 3.0),
    weighted=st.booleans(),
    seed=SEEDS,
)
def test_varlen_matches_per_problem_solves_and_the_dense_reference(sizes, eps, weighted, seed):
    gen = torch.Generator().manual_seed(seed)
    xs, ys, xo, yo = ragged(gen, sizes)
    eps = eps[: len(sizes)]
    ws = [(torch.rand(n, generator=gen, dtype=torch.float64) + 0.1,
           torch.rand(m, generator=gen, dtype=torch.float64) + 0.1) for n, m in sizes]  # fmt: skip
    a = torch.cat([w[0] for w in ws]).requires_grad_() if weighted else None
    b = torch.cat([w[1] for w in ws]) if weighted else None
    x = torch.cat(xs).requires_grad_()
    y = torch.cat(ys).requires_grad_()
    res = sinkhorn_varlen(x, y, xo, yo, a, b, eps=eps, tol=1e-12, max_iter=5000,
                          backend="torch")  # fmt: skip
    assert res.converged.all()
    gx, gy = torch.autograd.grad(res.cost.sum(), (x, y))
    for s, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
        xi, yi = xi.clone().requires_grad_(), yi.clone().requires_grad_()
        ai, bi = ws[s] if weighted else (None, None)
        one = flashot.sinkhorn(xi, yi, ai, bi, eps=eps[s], tol=1e-12, max_iter=5000,
                               backend="torch")  # fmt: skip
        wa = torch.full((len(xi),), 1.0 / len(xi), dtype=torch.float64)
        wb = torch.full((len(yi),), 1.0 / len(yi), dtype=torch.float64)
        if weighted:
            wa, wb = ai / ai.sum(), bi / bi.sum()
        ref = entropic_ot(xi.detach(), yi.detach(), wa, wb, eps[s])
        rows, cols = slice(xo[s], xo[s + 1]), slice(yo[s], yo[s + 1])
        assert res.cost[s].item() == pytest.approx(float(one.cost), rel=1e-10, abs=1e-12)
        assert res.cost[s].item() == pytest.approx(float(ref), rel=1e-8, abs=1e-10)
        f_ref, g_ref = one.f.detach(), one.g.detach()
        shift = (res.f[rows].detach() - f_ref).mean()  # potentials up to a constant
        assert torch.allclose(res.f[rows].detach() - shift, f_ref, atol=1e-8)
        assert torch.allclose(res.g[cols].detach() + shift, g_ref, atol=1e-8)
        gxi, gyi = torch.autograd.grad(one.cost, (xi, yi))
        assert torch.allclose(gx[rows], gxi, atol=1e-9)
        assert torch.allclose(gy[cols], gyi, atol=1e-9)
    assert torch.equal(res.eps, torch.tensor(eps, dtype=torch.float64))


def test_weight_gradients_match_per_problem_solves(gen):
    sizes = [(6, 9), (11, 4)]
    xs, ys, xo, yo = ragged(gen, sizes)
    a = (torch.rand(17, generator=gen, dtype=torch.float64) + 0.2).requires_grad_()
    res = sinkhorn_varlen(torch.cat(xs), torch.cat(ys), xo, yo, a, eps=0.5, tol=1e-12,
                          max_iter=5000, backend="torch")  # fmt: skip
    (ga,) = torch.autograd.grad(res.cost.sum(), a)
    for s in range(2):
        ai = a.detach()[xo[s] : xo[s + 1]].clone().requires_grad_()
        one = flashot.sinkhorn(xs[s], ys[s], ai, eps=0.5, tol=1e-12, max_iter=5000,
                               backend="torch")  # fmt: skip
        (gai,) = torch.autograd.grad(one.cost, ai)
        assert torch.allclose(ga[xo[s] : xo[s + 1]], gai, atol=1e-9)


def test_batched_sinkhorn_routes_3d_inputs_and_keeps_the_batch_layout(gen):
    x = torch.randn(3, 10, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 8, 2, generator=gen, dtype=torch.float64)
    b = torch.rand(3, 8, generator=gen, dtype=torch.float64) + 0.1
    res = flashot.sinkhorn(x, y, None, b, eps=0.2, tol=1e-10, eps_schedule="geomloss",
                           backend="torch")  # fmt: skip
    assert isinstance(res, flashot.BatchedSinkhornResult)
    assert res.f.shape == (3, 10) and res.g.shape == (3, 8) and res.cost.shape == (3,)
    assert res.n_iter.shape == (3,) and res.converged.all()
    v = torch.randn(3, 8, 4, generator=gen, dtype=torch.float64)
    pv = res.plan @ v
    for i in range(3):
        one = flashot.sinkhorn(x[i], y[i], None, b[i], eps=0.2, tol=1e-10, backend="torch")
        assert res.cost[i].item() == pytest.approx(float(one.cost), rel=1e-9)
        assert torch.allclose(pv[i], one.plan @ v[i], atol=1e-9)
        assert res.marginal_error[i] <= 1e-10


def test_packed_plan_is_block_diagonal_and_matches_the_blocks(gen):
    sizes = [(4, 6), (7, 3), (2, 5)]
    xs, ys, xo, yo = ragged(gen, sizes)
    res = sinkhorn_varlen(torch.cat(xs), torch.cat(ys), xo, yo, eps=0.5, tol=1e-12,
                          backend="torch")  # fmt: skip
    dense = res.plan.packed.dense()
    for s in range(3):
        block = dense[xo[s] : xo[s + 1], yo[s] : yo[s + 1]]
        c = dense_cost(xs[s], ys[s])
        wa = torch.full((len(xs[s]),), 1.0 / len(xs[s]), dtype=torch.float64)
        wb = torch.full((len(ys[s]),), 1.0 / len(ys[s]), dtype=torch.float64)
        ref = plan_dense(c, wa, wb, *sinkhorn_dense(c, wa, wb, 0.5), 0.5)
        assert torch.allclose(block, ref, atol=1e-10)
        dense[xo[s] : xo[s + 1], yo[s] : yo[s + 1]] = 0
    assert dense.abs().max() == 0  # nothing between problems
    u = torch.randn(len(torch.cat(xs)), 2, generator=gen, dtype=torch.float64)
    assert torch.allclose(res.plan.T @ u, res.plan.packed.dense().T @ u, atol=1e-12)


def test_per_problem_convergence_and_warning(gen):
    sizes = [(8, 8), (8, 8)]
    xs, ys, xo, yo = ragged(gen, sizes)
    with pytest.warns(flashot.ConvergenceWarning, match="1 of 2 problems"):
        res = sinkhorn_varlen(torch.cat(xs), torch.cat(ys), xo, yo, eps=[10.0, 0.005],
                              tol=1e-9, max_iter=60, update="alternating",
                              backend="torch")  # fmt: skip
    assert res.converged.tolist() == [True, False]
    assert res.marginal_error[0] <= 1e-9 < res.marginal_error[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sinkhorn_varlen(torch.cat(xs), torch.cat(ys), xo, yo, eps=[10.0, 0.005], tol=1e-9,
                        max_iter=60, backend="torch", warn=False)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x_offsets=[0, 5, 20]), "x_offsets must run from 0"),
        (dict(x_offsets=[0, 5, 6, 20, 26]), "x_offsets and y_offsets must describe"),
        (dict(x_offsets=[0, 10, 10, 26], y_offsets=[0, 4, 9, 14]), "increase strictly"),
        (dict(x_offsets=torch.tensor([0.0, 26.0])), "integer"),
        (dict(eps=[0.1, 0.2]), "one value per problem"),
        (dict(eps=[0.1, -1.0, 0.2]), "eps must be finite and > 0"),
        (dict(a=torch.cat([torch.zeros(10), torch.ones(16)]).double()), "sums to zero within"),
        (dict(a=torch.ones(25).double()), r"a must have shape \(26,\)"),
        (dict(cost=flashot.labeled_cost(torch.zeros(2, 2))), "plain costs"),
    ],
)
def test_varlen_errors_name_the_argument(gen, kwargs, match):
    x = torch.randn(26, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(14, 2, generator=gen, dtype=torch.float64)
    args = dict(x_offsets=[0, 10, 20, 26], y_offsets=[0, 4, 9, 14], eps=0.5)
    args.update(kwargs)
    xo, yo = args.pop("x_offsets"), args.pop("y_offsets")
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
        sinkhorn_varlen(x, y, xo, yo, backend="torch", **args)


def test_batched_refuses_what_it_does_not_do(gen):
    x = torch.randn(2, 5, 2, generator=gen, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="history"):
        flashot.sinkhorn(x, x, eps=0.1, history=True)
    with pytest.raises(ValueError, match=r"init\[0\] \(f\) must have shape \(10,\)"):
        flashot.sinkhorn(x, x, eps=0.1, init=(torch.zeros(2, 4), torch.zeros(2, 5)))
    with pytest.raises(NotImplementedError, match="eps above"):  # (its value would lose digits)
        flashot.sinkhorn(x, x, eps=1e6, rho=1.0)
    with pytest.raises(ValueError, match="same batch size"):
        sinkhorn_batched(x, x[:1], eps=0.1)
    with pytest.raises(ValueError, match=r"a must be a \(2, 5\) tensor"):
        sinkhorn_batched(x, x, torch.ones(5).double(), eps=0.1)


@pytest.mark.parametrize("reach", [None, 0.3])
def test_samples_loss_batch_is_one_packed_solve_equal_to_the_loop(gen, reach):
    """Balanced and relaxed (``reach``) batches: one packed solve, equal to one solve per
    item (values, potentials, gradients in x and in the weights) in float64."""
    x = torch.rand(3, 12, 2, generator=gen, dtype=torch.float64).requires_grad_()
    y = torch.rand(3, 9, 2, generator=gen, dtype=torch.float64)
    a = torch.rand(3, 12, generator=gen, dtype=torch.float64) + 0.1
    a = (a / a.sum(1, keepdim=True)).requires_grad_()
    for debias, pots in itertools.product([True, False], [False, True]):
        loss = flashot.SamplesLoss(blur=0.1, scaling=0.6, debias=debias, potentials=pots,
                                   reach=reach, backend="torch")  # fmt: skip
        out = loss(a, x, None, y)
        temps = loss._schedule(x, y)
        ref = [loss._single(a[i], x[i], None, y[i], temps) for i in range(3)]
        if pots:
            assert torch.allclose(out[0], torch.stack([r[0] for r in ref]), atol=1e-12)
            assert torch.allclose(out[1], torch.stack([r[1] for r in ref]), atol=1e-12)
            continue
        assert torch.allclose(out, torch.stack(ref), atol=1e-13)
        g = torch.autograd.grad(out.sum(), (x, a))
        g_ref = torch.autograd.grad(sum(ref), (x, a))
        assert torch.allclose(g[0], g_ref[0], atol=1e-13)
        assert torch.allclose(g[1], g_ref[1], atol=1e-12)


@pytest.mark.parametrize("blur", [0.05, 3.0])
def test_packed_schedules_take_the_near_path_where_single_solves_do(gen, monkeypatch, blur):
    """A schedule's warm-up temperatures up to a few times a problem's cost bound take
    the usual LSE (:func:`flashot.solver.blocks.warm_form`); a packed batch decides per problem
    from its segments' bounds, and took the near path (torch tiles, one problem at a
    time) at its first temperature, D², which single solves did not (H200: the GeomLoss
    call as a batch of one ran 40–80× slower). Both now take it at the same temperatures:
    none at a small blur, the final ε at a blur above the cost's range."""
    import flashot.backends.base as base

    calls = []
    real = base.near_attend
    monkeypatch.setattr(base, "near_attend", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    x = torch.rand(1, 40, 3, generator=gen, dtype=torch.float64)
    y = torch.rand(1, 30, 3, generator=gen, dtype=torch.float64)
    loss = flashot.SamplesLoss(blur=blur, scaling=0.5, debias=True, backend="torch")
    single = loss(x[0], y[0])
    alone = sorted(set(calls))
    calls.clear()
    packed = loss(x, y)
    assert sorted(set(calls)) == alone
    assert bool(alone) == (blur > 1)
    assert float(packed[0]) == pytest.approx(float(single), rel=1e-12, abs=1e-15)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(sizes=ragged_sizes(1, 10, most=3), blur=st.sampled_from([0.05, 0.3, 2.0]),
       scaling=st.sampled_from([0.3, 0.7]), seed=SEEDS)  # fmt: skip
def test_packed_debiased_schedules_match_the_dense_loop(sizes, blur, scaling, seed):
    """Property: a batch of debiased GeomLoss calls (ε-scaling from the batch's diameter
    down to blur², so warm-up temperatures near and above each problem's cost bound, and
    blur 2 puts the final ε above it) equals, item by item, the dense float64 GeomLoss
    loop's debiased value: float64 on the torch backend, float32 on the Triton kernels."""
    gen = torch.Generator().manual_seed(seed)
    n, m = max(s[0] for s in sizes), max(s[1] for s in sizes)  # a batch: one size
    x = 0.5 * torch.randn(len(sizes), n, 3, generator=gen, dtype=torch.float64)
    y = 0.5 * torch.randn(len(sizes), m, 3, generator=gen, dtype=torch.float64) + 0.5
    loss = flashot.SamplesLoss(blur=blur, scaling=scaling, debias=True, backend="torch")
    temps = loss._schedule(x, y)
    a = torch.full((n,), 1 / n, dtype=torch.float64)
    b = torch.full((m,), 1 / m, dtype=torch.float64)
    ref = []
    for xi, yi in zip(x, y, strict=True):
        f, g = geomloss_loop(xi, yi, a, b, temps)
        p, _ = geomloss_loop(xi, xi, a, a, temps)
        _, q = geomloss_loop(yi, yi, b, b, temps)
        ref.append((a * (f - p)).sum() + (b * (g - q)).sum())
    ref = torch.stack(ref)
    assert torch.allclose(loss(x, y), ref, rtol=1e-9, atol=1e-12)
    if "triton" in available_backends(DEVICE):
        fast = flashot.SamplesLoss(blur=blur, scaling=scaling, debias=True, backend="triton")
        got = fast(x.float().to(DEVICE), y.float().to(DEVICE)).double().cpu()
        scale = max(float(ref.abs().max()), temps[-1] * 1e-2)  # (a value of ~0 is a difference)
        assert (got - ref).abs().max() <= 2e-5 * scale


@pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")
def test_triton_segmented_kernel_matches_the_torch_backend(gen):
    """One launch over the packed blocks (rows of two problems never share a program)."""
    sizes = [(5, 7), (40, 3), (20, 33), (1, 4)]
    xs, ys, xo, yo = ragged(gen, sizes, d=5, dtype=torch.float32, device=DEVICE)
    x, y = torch.cat(xs).requires_grad_(), torch.cat(ys)
    out = {}
    v = torch.randn(len(y), 3, generator=gen).to(DEVICE)
    for backend in ("torch", "triton"):
        res = sinkhorn_varlen(x, y, xo, yo, eps=[0.5, 0.3, 1.0, 0.3], tol=None, max_iter=12,
                              update="symmetric", backend=backend)  # fmt: skip
        (gx,) = torch.autograd.grad(res.cost.sum(), x)
        out[backend] = (res.cost.detach(), res.f.detach(), gx, res.plan @ v)
    for t, r in zip(out["triton"], out["torch"], strict=True):
        assert torch.allclose(t, r, rtol=1e-5, atol=1e-5)


def test_fixed_iteration_solve_measures_its_errors_on_demand(gen):
    sizes = [(6, 9), (11, 4)]
    xs, ys, xo, yo = ragged(gen, sizes)
    fixed = sinkhorn_varlen(torch.cat(xs), torch.cat(ys), xo, yo, eps=0.5, tol=None,
                            max_iter=7, update="alternating", backend="torch")  # fmt: skip
    assert fixed.measured_error is None and fixed.converged is None
    for s in range(2):
        one = flashot.sinkhorn(xs[s], ys[s], eps=0.5, tol=None, max_iter=7,
                               update="alternating", backend="torch")  # fmt: skip
        assert fixed.marginal_error[s].item() == pytest.approx(one.marginal_error, rel=1e-9)


@pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")
def test_triton_fused_plan_sums_stream_only_the_diagonal_blocks(gen):
    """The one-exp pass over a packed form: its row and column sums against the dense
    block-diagonal matrix (entries between problems are exp(−inf) = 0)."""
    from flashot.backends.triton import TritonBackend
    from flashot.batched import pack_problems

    sizes = [(5, 70), (40, 3), (20, 33)]
    xs, ys, xo, yo = ragged(gen, sizes, d=4, dtype=torch.float32, device=DEVICE)
    pp = pack_problems(torch.cat(xs), torch.cat(ys), xo, yo, eps=0.7, backend="triton")
    form = pp.form
    f = 0.1 * torch.randn(len(form.q), generator=gen).to(DEVICE)
    g = 0.1 * torch.randn(len(form.k), generator=gen).to(DEVICE)
    log_a, log_b = pp.a.log(), pp.b.log()
    r, c = TritonBackend().plan_sums(Potentials(form, f, g, log_a, log_b, 0.7))
    e = torch.exp((f[:, None] + g[None, :] - form.dense().double()) / 0.7)
    assert torch.allclose(r.double(), e @ pp.b.double(), rtol=1e-5)
    assert torch.allclose(c.double(), e.T @ pp.a.double(), rtol=1e-5)


def test_several_target_weight_vectors_for_one_pair_of_clouds_in_one_solve(gen):
    """POT's several histograms b for one (x, y): a batch of the same clouds."""
    x = torch.randn(9, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    bs = torch.rand(4, 7, generator=gen, dtype=torch.float64) + 0.05
    res = flashot.sinkhorn(x.expand(4, 9, 2), y.expand(4, 7, 2), None, bs, eps=0.4, tol=1e-11,
                           backend="torch")  # fmt: skip
    for i in range(4):
        one = flashot.sinkhorn(x, y, None, bs[i], eps=0.4, tol=1e-11, backend="torch")
        assert res.cost[i].item() == pytest.approx(float(one.cost), rel=1e-10)


def test_batched_divergence_is_one_packed_solve_equal_to_per_problem_divergences(gen):
    x = torch.randn(3, 11, 2, generator=gen, dtype=torch.float64).requires_grad_()
    y = torch.randn(3, 8, 2, generator=gen, dtype=torch.float64) + 0.5
    b = torch.rand(3, 8, generator=gen, dtype=torch.float64) + 0.1
    eps = [0.3, 0.5, 0.8]
    out = flashot.sinkhorn_divergence(x, y, None, b, eps=eps, tol=1e-11, max_iter=5000,
                                      backend="torch")  # fmt: skip
    (gx,) = torch.autograd.grad(out.sum(), x)
    for i in range(3):
        xi = x.detach()[i].clone().requires_grad_()
        one = flashot.sinkhorn_divergence(xi, y[i], None, b[i], eps=eps[i], tol=1e-11,
                                          max_iter=5000, backend="torch")  # fmt: skip
        (gi,) = torch.autograd.grad(one, xi)
        assert out[i].item() == pytest.approx(float(one), rel=1e-8, abs=1e-11)
        assert torch.allclose(gx[i], gi, atol=1e-8)


@pytest.mark.parametrize("rho", [0.8, (1.5, None), (0.5, 2.0)])
def test_relaxed_batch_matches_per_problem_relaxed_solves(gen, rho):
    sizes = [(7, 9), (12, 5), (3, 8)]
    xs, ys, xo, yo = ragged(gen, sizes)
    a = (torch.rand(22, generator=gen, dtype=torch.float64) + 0.1).requires_grad_()
    b = 2.0 * (torch.rand(22, generator=gen, dtype=torch.float64) + 0.1)
    x = torch.cat(xs).requires_grad_()
    kw = dict(eps=0.4, rho=rho, tol=1e-11, max_iter=20_000, backend="torch")
    res = sinkhorn_varlen(x, torch.cat(ys), xo, yo, a, b, **kw)
    gx, ga = torch.autograd.grad(res.cost.sum(), (x, a))
    for s in range(3):
        rows, cols = slice(xo[s], xo[s + 1]), slice(yo[s], yo[s + 1])
        xi = xs[s].clone().requires_grad_()
        ai = a.detach()[rows].clone().requires_grad_()
        one = flashot.sinkhorn(xi, ys[s], ai, b[cols], **kw)
        gxi, gai = torch.autograd.grad(one.cost, (xi, ai))
        assert res.cost[s].item() == pytest.approx(float(one.cost), rel=1e-9)
        assert torch.allclose(res.f[rows].detach(), one.f.detach(), atol=1e-8)
        assert torch.allclose(gx[rows], gxi, atol=1e-8)
        assert torch.allclose(ga[rows], gai, atol=1e-8)
        assert res.marginal_error[s] <= 1e-10
    with pytest.raises(NotImplementedError, match="one eps"):
        sinkhorn_varlen(x, torch.cat(ys), xo, yo, eps=[0.4, 0.5, 0.4], rho=rho)


@settings(max_examples=8, deadline=None)
@given(
    sizes=ragged_sizes(2, 10, most=3),
    rel=eps_lists(0.05, 1.0, count=3),
    seed=SEEDS,
)
def test_relative_eps_is_each_problems_own(sizes, rel, seed):
    """``relative_eps=True``: problem s is solved at ε_s = eps_s × its own mean cost,
    as ``flashot.sinkhorn(relative_eps=True)`` does for it alone (float64: the absolute
    ε, costs and potentials)."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys, xo, yo = ragged(gen, sizes)
    scale = [1.0 + 3.0 * s for s in range(len(sizes))]  # problems of different cost scales
    xs = [x * c for x, c in zip(xs, scale, strict=True)]
    ys = [y * c for y, c in zip(ys, scale, strict=True)]
    eps = rel[: len(sizes)]
    kw = dict(tol=None, max_iter=40, update="symmetric", backend="torch")
    res = sinkhorn_varlen(torch.cat(xs), torch.cat(ys), xo, yo, eps=eps, relative_eps=True, **kw)
    for s, (x, y) in enumerate(zip(xs, ys, strict=True)):
        one = flashot.sinkhorn(x, y, eps=eps[s], relative_eps=True, **kw)
        assert float(res.eps[s]) == pytest.approx(one.eps, rel=1e-12)
        assert float(res.cost[s]) == pytest.approx(float(one.cost), rel=1e-10, abs=1e-12)
        assert torch.allclose(res.f[xo[s] : xo[s + 1]], one.f, rtol=1e-9, atol=1e-10)


def test_relative_eps_batches_through_sinkhorn_and_refuse_zero_mean_cost(gen):
    x = torch.randn(2, 6, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 5, 2, generator=gen, dtype=torch.float64)
    res = flashot.sinkhorn(x, y, eps=0.2, relative_eps=True, tol=None, max_iter=20)
    one = flashot.sinkhorn(x[1], y[1], eps=0.2, relative_eps=True, tol=None, max_iter=20)
    assert float(res.cost[1]) == pytest.approx(float(one.cost), rel=1e-10)
    z = torch.ones(2, 4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positive mean cost in every problem.*problem 0"):
        flashot.sinkhorn(z, z, eps=0.2, relative_eps=True)
    with pytest.raises(TypeError, match="relative_eps must be True or False"):
        sinkhorn_varlen(x[0], y[0], [0, 6], [0, 5], eps=0.2, relative_eps=1)


@pytest.mark.parametrize("packed", [False, True])
def test_a_warm_start_from_a_converged_batch_converges_at_once(gen, packed):
    """``init``: each problem's potentials at its own ε (a previous result's), rescaled
    to the batch's common ε inside; a converged batch restarted from its own potentials
    meets the tolerance at the first check with the same costs."""
    sizes = [(7, 5), (4, 9), (6, 6)]
    xs, ys, xo, yo = ragged(gen, sizes)
    kw = dict(eps=[0.3, 0.9, 0.5], tol=1e-10, check_every=5, max_iter=20000, backend="torch")
    if packed:
        x, y = torch.cat(xs), torch.cat(ys)
        cold = sinkhorn_varlen(x, y, xo, yo, **kw)
        warm = sinkhorn_varlen(x, y, xo, yo, init=(cold.f, cold.g), **kw)
    else:
        x, y = torch.stack([t[:4] for t in xs]), torch.stack([t[:5] for t in ys])
        cold = flashot.sinkhorn(x, y, **kw)
        warm = flashot.sinkhorn(x, y, init=(cold.f, cold.g), **kw)
    assert int(cold.n_iter[0]) > 20 and int(warm.n_iter[0]) <= 5
    assert torch.allclose(warm.cost, cold.cost, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")
@settings(max_examples=6, deadline=None)
@given(
    sizes=ragged_sizes(1, 40),
    eps=eps_lists(0.2, 2.0),
    weighted=st.booleans(),
    seed=SEEDS,
)
def test_triton_packed_solves_match_the_torch_backend(sizes, eps, weighted, seed):
    """Property over ragged batches (single points, blocks cut mid-problem, per-problem ε,
    weights): the Triton kernels' packed solve (symmetric steps, fused sums where they
    apply) gives the torch backend's costs, potentials and ∇x to float32 accuracy."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys, xo, yo = ragged(gen, sizes, d=3, dtype=torch.float32, device=DEVICE)
    x, y = torch.cat(xs), torch.cat(ys)
    a = torch.rand(len(x), generator=gen).to(DEVICE) + 0.1 if weighted else None
    out = {}
    for backend in ("torch", "triton"):
        xg = x.clone().requires_grad_()
        res = sinkhorn_varlen(xg, y, xo, yo, a, eps=eps[: len(sizes)], tol=None, max_iter=8,
                              update="symmetric", backend=backend)  # fmt: skip
        (gx,) = torch.autograd.grad(res.cost.sum(), xg)
        out[backend] = (res.cost.detach(), res.f.detach(), res.g.detach(), gx)
    for t, r in zip(out["triton"], out["torch"], strict=True):
        assert torch.allclose(t, r, rtol=2e-5, atol=2e-5)


BATCHED_SECOND_ORDER = {
    "sinkhorn": (lambda x, y: flashot.sinkhorn(x, y, eps=0.4, tol=1e-11, max_iter=20_000).cost,
                 lambda x, y: flashot.sinkhorn(x, y, eps=0.4, tol=1e-11, max_iter=20_000).cost),
    "sinkhorn-fixed": (lambda x, y: flashot.sinkhorn(x, y, eps=0.4, tol=None, max_iter=7).cost,
                       lambda x, y: flashot.sinkhorn(x, y, eps=0.4, tol=None, max_iter=7).cost),
    "sinkhorn-relaxed": (lambda x, y: flashot.sinkhorn(x, y, eps=0.4, rho=0.7, tol=1e-11,
                                                       max_iter=20_000).cost,
                         lambda x, y: flashot.sinkhorn(x, y, eps=0.4, rho=0.7, tol=1e-11,
                                                       max_iter=20_000).cost),
    "divergence": (lambda x, y: flashot.sinkhorn_divergence(x, y, eps=0.4, tol=1e-11,
                                                            max_iter=20_000),
                   lambda x, y: flashot.sinkhorn_divergence(x, y, eps=0.4, tol=1e-11,
                                                            max_iter=20_000, update="symmetric")),
    "samples_loss": (lambda x, y: flashot.SamplesLoss(blur=0.4, diameter=4.0)(x, y),
                     lambda x, y: flashot.SamplesLoss(blur=0.4, diameter=4.0)(x, y)),
    "samples_loss-reach": (lambda x, y: flashot.SamplesLoss(blur=0.4, reach=0.8,
                                                            diameter=4.0)(x, y),
                           lambda x, y: flashot.SamplesLoss(blur=0.4, reach=0.8,
                                                            diameter=4.0)(x, y)),
}  # fmt: skip


@pytest.mark.parametrize("call", sorted(BATCHED_SECOND_ORDER))
def test_second_derivatives_of_a_batch_are_each_problems(call):
    """A double backward through a (B, n, d) value (one dual solve, or one replayed
    schedule, for the batch) gives each problem's own second derivatives, weighted by
    the outer gradient; the gradient is the same with and without create_graph."""
    batched, single = BATCHED_SECOND_ORDER[call]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 6, 2, generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn_like(x)
    w = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)  # per-problem weights
    xs = x.clone().requires_grad_()
    (plain,) = torch.autograd.grad((batched(xs, y) * w).sum(), xs)
    (g,) = torch.autograd.grad((batched(xs, y) * w).sum(), xs, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    assert torch.equal(plain, g.detach())
    for i in range(3):
        xi = x[i].clone().requires_grad_()
        (gi,) = torch.autograd.grad(single(xi, y[i]), xi, create_graph=True)
        (hi,) = torch.autograd.grad((gi * v[i]).sum(), xi)
        assert rel(g[i].detach(), w[i] * gi.detach()) < 1e-7, i
        assert rel(h[i], w[i] * hi) < 1e-6, i


def test_ragged_second_derivatives_with_one_eps_per_problem():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(13, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(11, 2, generator=gen, dtype=torch.float64) + 0.3
    v = torch.randn_like(x)
    rows, cols, eps = [0, 6, 13], [0, 5, 11], [0.3, 0.8]
    kw = dict(tol=1e-11, max_iter=20_000)
    xs = x.clone().requires_grad_()
    value = flashot.sinkhorn_varlen(xs, y, rows, cols, eps=eps, **kw).cost.sum()
    (g,) = torch.autograd.grad(value, xs, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    for s in range(2):
        r, c = slice(rows[s], rows[s + 1]), slice(cols[s], cols[s + 1])
        want = flashot.hvp(x[r], y[c], v[r], eps=eps[s], **kw)
        assert rel(h[r], want) < 1e-6, s
