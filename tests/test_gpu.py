"""GPU suite (``pytest -m gpu``): the Triton kernels on CUDA against the float64 torch
backend on the same GPU, at sizes the interpreter cannot reach."""

import math

import pytest
import torch

import flashot
from flashot.backends.triton import TritonBackend
from tests.conftest import rel

pytestmark = pytest.mark.gpu

# mode: relative error of the cost against float64 on the unrounded clouds (reduced modes
# solve the problem between the rounded clouds; against that problem all modes agree to
# float32 accuracy)
TOLERANCES = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 3e-2, "fp16": 5e-3}
ROUND = {"fp32": None, "tf32": "tf32", "bf16": torch.bfloat16, "fp16": torch.float16}


def data(n, m, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g)
    y = torch.randn(m, d, device="cuda", generator=g) + 0.5
    return x, y


@pytest.mark.parametrize("precision", sorted(TOLERANCES))
@pytest.mark.parametrize(
    "n,m,d", [(3000, 2500, 3), (2048, 3000, 64), (1000, 1100, 700), (500, 600, 4099)]
)
def test_converged_solve_matches_float64(precision, n, m, d):
    from flashot.geometry.costs import round_operands

    x, y = data(n, m, d)
    eps = 0.1 * d
    res = flashot.sinkhorn(
        x, y, eps=eps, tol=1e-5, backend=TritonBackend(precision, autotune=False)
    )
    center = ((x.double().sum(0) + y.double().sum(0)) / (n + m)).float()
    xr = round_operands(x - center, ROUND[precision]).double()
    yr = round_operands(y - center, ROUND[precision]).double()
    rounded = flashot.sinkhorn(xr, yr, eps=eps, tol=1e-9, backend="torch")
    exact = flashot.sinkhorn(x.double(), y.double(), eps=eps, tol=1e-9, backend="torch")
    err_rounded, err_exact = rel(res.cost, rounded.cost), rel(res.cost, exact.cost)
    print(f"{precision} n={n} m={m} d={d}: vs rounded {err_rounded:.2e}, vs exact {err_exact:.2e}")
    assert err_rounded < 2e-5
    assert err_exact < TOLERANCES[precision]
    shift = (res.f.double() - rounded.f).mean()
    assert rel(res.f.double() - shift, rounded.f) < 2e-4


@pytest.mark.parametrize("d, eps", [(3, None), (64, None), (100, None), (512, None),
                                    (256, 0.1), (512, 0.1)])  # fmt: skip
def test_default_precision_is_within_1e_6_of_float64(d, eps):
    """The default (fp32: operands split once per solve, three half MMAs) against the
    float64 torch backend, 10 fixed iterations; 3xTF32 per tile (presplit=False) beside.
    d = 100 (one 128-wide feature chunk) took d = 64's tiles, which need more shared
    memory than an H200 has there (v23: OutOfResources; launches now step down). From
    d = 256 the steps are one exact pass (``ONE_PASS_FROM_D``); ε = 0.1 (None: 0.1·d)
    starts them with residuals of ~10^3 nats, outside any fused window."""
    x, y = data(4096, 3000, d)
    kw = dict(eps=0.1 * d if eps is None else eps, max_iter=10, tol=None)
    ref = flashot.sinkhorn(x.double(), y.double(), backend="torch", **kw)
    for presplit in (True, False):
        res = flashot.sinkhorn(x, y, backend=TritonBackend(presplit=presplit), **kw)
        err = rel(res.cost.double(), ref.cost)
        print(f"d={d} presplit={presplit}: cost vs float64 {err:.2e}")
        assert err < 1e-6, presplit


@pytest.mark.parametrize("d", [64, 512])
def test_default_precision_gradient_is_as_accurate_as_3xtf32(d):
    """The default's gradient pass (scores and values split once per solve, V_SPLIT)
    against float64, beside 3xTF32 per tile (presplit=False), 10 fixed iterations."""
    x, y = data(4096, 3000, d)
    kw = dict(eps=0.1 * d, max_iter=10, tol=None)

    def grad(xx, yy, backend):
        xg = xx.clone().requires_grad_()
        return torch.autograd.grad(flashot.sinkhorn(xg, yy, backend=backend, **kw).cost, xg)[0]

    ref = grad(x.double(), y.double(), "torch")
    errs = {p: rel(grad(x, y, TritonBackend(presplit=p)).double(), ref) for p in (True, False)}
    print(f"d={d}: gradient vs float64, split {errs[True]:.2e}, 3xTF32 {errs[False]:.2e}")
    assert errs[True] < max(2.0 * errs[False], 1e-6)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_gradient_matches_float64(precision):
    x, y = data(4000, 3000, 32)
    grads = []
    ours = TritonBackend(precision, autotune=False)
    for xx, yy, be in ((x.double(), y.double(), "torch"), (x, y, ours)):
        xg, yg = xx.clone().requires_grad_(), yy.clone().requires_grad_()
        cost = flashot.sinkhorn(xg, yg, eps=2.0, tol=1e-5, backend=be).cost
        grads.append(torch.autograd.grad(cost, [xg, yg]))
    for g_ours, g_ref in zip(grads[1], grads[0], strict=True):
        assert rel(g_ours.double(), g_ref) < (1e-4 if precision == "fp32" else 3e-3)


def test_plan_products_match_float64():
    x, y = data(3000, 2000, 16)
    v = torch.randn(2000, 5, device="cuda")
    ref = flashot.sinkhorn(x.double(), y.double(), eps=1.0, tol=1e-9, backend="torch")
    # the plan's error follows the marginal error: tol 1e-5 gives ~1e-4 on P @ v (float32
    # torch backend too), 1e-6 gives ~3e-6
    res = flashot.sinkhorn(x, y, eps=1.0, tol=1e-6, backend="triton")
    assert rel((res.plan @ v).double(), ref.plan @ v.double()) < 1e-4
    assert rel(res.plan.barycentric_map().double(), ref.plan.barycentric_map()) < 1e-4
    assert rel(res.transport_cost.double(), ref.transport_cost) < 1e-4


def test_auto_picks_triton_on_cuda():
    x, y = data(100, 100, 3)
    assert flashot.sinkhorn(x, y, eps=1.0).plan._backend.name == "triton"
    assert flashot.sinkhorn(x.double(), y.double(), eps=1.0).plan._backend.name == "torch"


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_forward_memory_is_inputs_plus_little(precision):
    x, y = data(50_000, 50_000, 64)
    a = torch.full((50_000,), 1 / 50_000, device="cuda")
    be = TritonBackend(precision, autotune=False)  # memory does not depend on tiles
    fn = lambda: flashot.sinkhorn(x, y, a, a, eps=0.1, max_iter=10, tol=None, backend=be)  # noqa: E731
    with torch.no_grad():
        fn()  # compile and tune outside the measurement
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        extra = (torch.cuda.max_memory_allocated() - base) / 1e6
    print(f"extra memory fwd 50k d64 {precision}: {extra:.1f} MB")
    # centred copies of both clouds (25.6 MB) and O(n) vectors; fp32 also splits each
    # cloud once per solve into two float16 parts (another 25.6 MB while it runs)
    split = 2 * x.numel() * 4 / 1e6 if precision == "fp32" else 0.0
    assert extra < 32 + split, f"{extra:.1f} MB beyond the inputs"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cold_start_fast_path_equals_exact_path(precision):
    """ε = 0.1 at d = 64 from a cold start: the first steps overflow the fused pass
    (gated off or repaired), later ones use it; the iterates must equal the exact ones."""
    x, y = data(8192, 6000, 64)
    kw = dict(eps=0.1, max_iter=10, tol=None)
    fast = flashot.sinkhorn(x, y, backend=TritonBackend(precision, autotune=False), **kw)
    exact = TritonBackend(precision, fused=False, autotune=False)
    ref = flashot.sinkhorn(x, y, backend=exact, **kw)
    assert rel(fast.f, ref.f) < 1e-5 and rel(fast.g, ref.g) < 1e-5
    assert rel(fast.cost, ref.cost) < 1e-6


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_repeated_fixed_iteration_solves_replay_a_cuda_graph(precision, monkeypatch):
    """New data each call (the bf16 copies must be remade inside the graph); replays
    equal eager solves; a warm start is another key. The second step's probe runs
    inside the graph too."""
    from flashot.backends import triton as backend
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    cache = graphs.GraphCache()
    monkeypatch.setattr(solver, "GRAPHS", cache)
    monkeypatch.setattr(backend, "PROBE_FROM", 1024)
    kw = dict(eps=0.1, max_iter=10, tol=None)
    for seed in range(4):
        x, y = data(3000, 2000, 64, seed)
        res = flashot.sinkhorn(x, y, backend=TritonBackend(precision), **kw)
        ref = flashot.sinkhorn(x, y, backend=TritonBackend(precision, graphs=False), **kw)
        assert rel(res.f, ref.f) < 1e-6 and rel(res.g, ref.g) < 1e-6
        assert rel(res.cost, ref.cost) < 1e-6
        warm = dict(kw, init=(ref.f * 0.9, ref.g * 0.9))
        res = flashot.sinkhorn(x, y, backend=TritonBackend(precision), **warm)
        ref = flashot.sinkhorn(x, y, backend=TritonBackend(precision, graphs=False), **warm)
        assert rel(res.f, ref.f) < 1e-6 and rel(res.cost, ref.cost) < 1e-6
    assert len(cache._graphs) == 2


def test_solves_to_a_tolerance_replay_their_blocks_as_cuda_graphs(monkeypatch):
    """A solve with ``tol`` replays its blocks of iterations (each ending at a check):
    the same iterations, error and potentials as the eager loop, on new data each call."""
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    cache = graphs.GraphCache()
    monkeypatch.setattr(solver, "GRAPHS", cache)
    kw = dict(eps=0.5, tol=1e-4, max_iter=300, eps_schedule="geomloss")
    for seed in range(4):
        x, y = data(3000, 2000, 16, seed)
        res = flashot.sinkhorn(x, y, backend=TritonBackend(), **kw)
        ref = flashot.sinkhorn(x, y, backend=TritonBackend(graphs=False), **kw)
        assert res.converged and ref.converged and abs(res.n_iter - ref.n_iter) <= 10
        assert rel(res.f, ref.f) < 1e-5 and rel(res.cost, ref.cost) < 1e-6
        # the debiased divergence: its self problems' loops (symmetric) in blocks too
        div = flashot.sinkhorn_divergence(x, y, backend=TritonBackend(), **kw)
        div_ref = flashot.sinkhorn_divergence(x, y, backend=TritonBackend(graphs=False), **kw)
        assert rel(div, div_ref) < 1e-5
    assert len(cache._graphs) >= 3


def _replayed_and_eager_loss(x, y, kw):
    """``SamplesLoss(**kw)`` value and gradient w.r.t. x, with graphs and without."""
    outs = []
    for be in (TritonBackend(), TritonBackend(graphs=False)):
        xg = x.clone().requires_grad_()
        value = flashot.SamplesLoss(backend=be, **kw)(xg, y)
        outs.append((value.detach(), torch.autograd.grad(value, xg)[0]))
    return outs


def test_debiased_divergence_replays_its_three_loops_as_cuda_graphs(monkeypatch):
    """The GeomLoss call (fixed ε schedule, debiased): the problem's loop and both self
    problems' loops are captured and replayed, with values and gradients as eager."""
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    cache = graphs.GraphCache()
    monkeypatch.setattr(solver, "GRAPHS", cache)
    kw = dict(p=2, blur=0.05, scaling=0.5, debias=True, diameter=4.0)
    for seed in range(3):
        # sizes differ: the two self problems are then two loops of their own; y is
        # shifted so that the value is not a cancellation of its three terms (the plan
        # sums' atomics make replay and eager differ in the last bits)
        gen = torch.Generator("cuda").manual_seed(seed)
        x, y = (torch.rand(size, 3, device="cuda", generator=gen) for size in (3000, 2000))
        y = y + 1.0
        (value, grad), (eager, eager_grad) = _replayed_and_eager_loss(x, y, kw)
        assert rel(value, eager) < 1e-6 and rel(grad, eager_grad) < 1e-5
    assert len(cache._graphs) == 3


@pytest.mark.parametrize("reach", [None, 0.5])
def test_the_geomloss_call_on_moving_data_replays_its_loops(monkeypatch, reach):
    """The GeomLoss call with the data's diameter, on clouds that move each call (a
    training loop): other warm-up temperatures, the same schedule length. The three loops
    read their temperatures (and, unbalanced, their damping) from the device, so their
    graphs replay from the second call on; values and gradients are the eager ones."""
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    cache = graphs.GraphCache()
    monkeypatch.setattr(solver, "GRAPHS", cache)
    kw = dict(p=2, blur=0.05, scaling=0.5, debias=True, reach=reach)
    gen = torch.Generator("cuda").manual_seed(5)
    x0, y0 = (torch.rand(size, 3, device="cuda", generator=gen) for size in (3000, 2000))
    for scale in (1.0, 0.96, 1.03, 0.98):  # diameters 3.3-3.6: 7 temperatures each
        x, y = x0 * scale, y0 * scale + 1.0
        (value, grad), (eager, eager_grad) = _replayed_and_eager_loss(x, y, kw)
        assert rel(value, eager) < 1e-6 and rel(grad, eager_grad) < 1e-5
    assert len(cache._graphs) == 3


def test_a_replayed_divergence_never_waits_for_the_device(monkeypatch):
    """Past its input checks, a replayed GeomLoss call (three loops, their final passes,
    autograd on x and y) queues its work without one host wait: a wait would serialize
    the host's Python with the previous replay (v33: three blocking copies of the
    temperature table did). Gradients as eager ones, for x and y."""
    from flashot.divergence import debiased_potentials
    from flashot.problem import make_problem
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache())
    gen = torch.Generator("cuda").manual_seed(3)
    x0, y0 = (torch.rand(size, 3, device="cuda", generator=gen) for size in (3000, 2000))
    temps = solver.geomloss_schedule(4.0, 0.05**2, 0.5)
    outs = []
    for step, be in enumerate([TritonBackend()] * 4 + [TritonBackend(graphs=False)]):
        # moving data, as in a training loop (the eager call: the last replay's data)
        x = (x0 + 1e-3 * min(step, 3)).requires_grad_()
        y = (y0 + 1.0).requires_grad_()
        problem = make_problem(x, y, eps=0.05**2, cost="half_sqeuclidean", normalize=False,
                               backend=be)  # fmt: skip
        torch.cuda.synchronize()
        if step >= 2:  # (from the third call on, every loop replays)
            torch.cuda.set_sync_debug_mode("error")
        try:
            pots = debiased_potentials(problem, temps, max_iter=len(temps), tol=None)
            value = pots.value(problem)
            grads = torch.autograd.grad(value, (x, y))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        outs.append((value.detach(), grads))
    (value, grads), (eager, eager_grads) = outs[-2], outs[-1]
    assert rel(value, eager) < 1e-6
    assert all(rel(g, e) < 1e-5 for g, e in zip(grads, eager_grads, strict=True))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("n", [3000, 20_000])  # replayed as a CUDA graph, and eager
def test_solves_on_a_gpu_that_is_not_the_current_one(n):
    """Triton launches (and CUDA graphs capture and replay) on the current device:
    tensors on cuda:1 while cuda:0 is current must still be solved there, with the same
    answer. New data each call: a graph captured on the wrong stream would be empty and
    its replay would return the previous call's answer."""
    kw = dict(eps=0.1, max_iter=10, tol=None)
    current = torch.cuda.current_device()
    for seed in range(4):  # eager, captured, replayed, replayed (below 2^28 elements)
        x, y = data(n, n, 16, seed)
        ref = flashot.sinkhorn(x, y, backend=TritonBackend(autotune=False), **kw)
        with torch.no_grad():
            res = flashot.sinkhorn(
                x.to("cuda:1"), y.to("cuda:1"), backend=TritonBackend(autotune=False), **kw
            )
        assert res.f.device == torch.device("cuda", 1)
        assert rel(res.cost.cpu(), ref.cost.cpu()) < 1e-5
        assert rel(res.f.cpu(), ref.f.cpu()) < 1e-5
    x1, y1 = x.to("cuda:1").requires_grad_(), y.to("cuda:1")
    cost = flashot.sinkhorn(x1, y1, backend=TritonBackend(autotune=False), **kw).cost
    grad = torch.autograd.grad(cost, x1)[0]
    xg = x.detach().requires_grad_()
    want = torch.autograd.grad(
        flashot.sinkhorn(xg, y, backend=TritonBackend(autotune=False), **kw).cost, xg
    )[0]
    assert rel(grad.cpu(), want.cpu()) < 1e-4
    assert torch.cuda.current_device() == current  # nothing global changed


def test_a_solve_inside_the_callers_cuda_graph_is_refused_clearly():
    x, y = data(100, 80, 3)
    before = flashot.sinkhorn(x, y, eps=0.1, max_iter=5, tol=None).cost
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph capture"), torch.cuda.graph(graph):
        flashot.sinkhorn(x, y, eps=0.1, max_iter=5, tol=None)
    after = flashot.sinkhorn(x, y, eps=0.1, max_iter=5, tol=None).cost  # still works
    assert rel(after.cpu(), before.cpu()) < 1e-6


def test_dual_cg_replays_its_blocks_as_a_cuda_graph(monkeypatch):
    """The dual solve of an HVP captures its CG blocks (Triton kernels inside) once and
    replays them in later HVPs of the same shapes with new data, giving the eager solve's
    answers; a plain CG captures too."""
    import flashot.numerics.linalg as linalg
    from flashot.autodiff import implicit
    from flashot.solver import graphs

    implicit.clear_dual_graphs()
    captured = []
    real = graphs._Captured

    def counting(fn, inputs):
        captured.append(len(inputs))
        return real(fn, inputs)

    monkeypatch.setattr(graphs, "_Captured", counting)
    captures = implicit._captures
    kw = dict(eps=0.5, backend="triton", tol=1e-5)
    first = None
    for seed in (0, 1):
        x, y = data(3000, 2500, 16, seed=seed)
        v = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        monkeypatch.setattr(implicit, "_captures", captures)
        h = flashot.hvp(x, y, v, **kw)
        assert captured and (first is None or len(captured) == first)  # in the first HVP only
        first = len(captured)
        monkeypatch.setattr(implicit, "_captures", lambda backend, form: False)
        h_eager = flashot.hvp(x, y, v, **kw)
        assert rel(h, h_eager) < 1e-5
    implicit.clear_dual_graphs()
    A = torch.randn(200, 200, device="cuda", dtype=torch.float64)
    A = A @ A.T + 200 * torch.eye(200, device="cuda", dtype=torch.float64)
    b = torch.randn(200, device="cuda", dtype=torch.float64)
    res = linalg.cg(lambda u: A @ u, b, tol=1e-12, capture=True, check_every=4)
    ref = linalg.cg(lambda u: A @ u, b, tol=1e-12, check_every=1)
    assert res.n_iter == ref.n_iter and rel(res.x, ref.x) < 1e-12


@pytest.mark.parametrize("wrt,rho", [("x", None), ("y", None), ("x", (2.0, None)), ("xy", 1.0)])
def test_hvp_on_triton_matches_float64_torch(wrt, rho):
    x, y = data(1500, 1200, 8)
    v = torch.randn_like(x) if wrt != "y" else torch.randn_like(y)
    if wrt == "xy":
        v = (v, torch.randn_like(y))
    kw = dict(eps=0.5, wrt=wrt, rho=rho)
    h = flashot.hvp(x, y, v, backend="triton", tol=1e-6, **kw)
    v64 = tuple(t.double() for t in v) if wrt == "xy" else v.double()
    ref = flashot.hvp(x.double(), y.double(), v64, backend="torch", tol=1e-12, **kw)
    for got, want in zip(h if wrt == "xy" else (h,), ref if wrt == "xy" else (ref,), strict=False):
        assert rel(got, want) < 1e-3


def test_batched_hvp_directions_on_triton_match_single_ones():
    """k directions in one hvp call (one CG with k columns, captures off) give each
    direction's own HVP."""
    x, y = data(1500, 1200, 8)
    gen = torch.Generator("cuda").manual_seed(3)
    V = torch.randn(4, *x.shape, device="cuda", generator=gen)
    H = flashot.hvp(x, y, V, eps=0.5, backend="triton", tol=1e-6)
    for i in range(4):
        h = flashot.hvp(x, y, V[i], eps=0.5, backend="triton", tol=1e-6)
        assert rel(H[i], h) < 1e-4, i


def test_cuda_autocast_does_not_change_results():
    """Under torch.autocast("cuda") the solve, its gradient, plan products and an HVP
    compute as outside it (the Triton backend's torch glue included)."""
    x, y = data(500, 400, 8)
    v = torch.randn(400, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def run():
        xs = x.clone().requires_grad_()
        res = flashot.sinkhorn(xs, y, eps=0.1)
        (grad,) = torch.autograd.grad(res.cost, xs)
        plan = flashot.sinkhorn(x, y, eps=0.1).plan
        return [
            res.cost.detach(),
            grad,
            plan @ v,
            plan.transport_cost(),
            flashot.SamplesLoss(blur=0.2)(x, y),
            flashot.hvp(x, y, x, eps=0.5, tol=1e-5),
        ]

    want = run()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = run()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and rel(g, w) < 1e-4, i  # (atomics reorder sums; bf16: ~1e-2)


def test_split_operands_converge_like_3xtf32_on_an_otdd_problem():
    """v21 (H200, MNIST against rot90, d' = 784 + 20 labels, ε = 5): the default's split
    operands (presplit) stalled at a marginal error of 1e-4 on both self problems where
    3xTF32 per tile and tf32 reached 1e-6 (v22: the chunk sums in the MMA's accumulator,
    see the next test). Mixture data of MNIST's shape and cost scale (float32 on the
    torch backend converges here without a warning, 2e-8 of the cost from float64)."""
    import warnings

    from flashot import ConvergenceWarning
    from flashot.tasks import datasets
    from flashot.tasks.otdd import dataset_distance

    (xa, ya), (xb, yb) = (datasets.gaussian_mixture(4096, 784, 10, seed=s, spread=3.0,
                                                    device="cuda") for s in (0, 1))  # fmt: skip
    xa, xb = 3.0 * xa, 3.0 * xb  # costs between classes ≈ 180, as MNIST's
    kw = dict(eps=5.0, eps_schedule="geomloss", diagonal=True, max_iter=2000)
    ref = dataset_distance(xa.double(), ya, xb.double(), yb, backend="torch", **kw)
    for presplit in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)
            got = dataset_distance(xa, ya, xb, yb, backend=TritonBackend(presplit=presplit), **kw)
        # float32 solves: the distance to 1e-5 of the cross problem's cost it is made of
        err = abs(float(got.distance) - float(ref.distance))
        assert err < 1e-5 * float(ref.result.cost), presplit


def block_scores(backend, form, size=64):
    """``⟨q_i, k_j⟩`` of the first (size, size) block, one column at a time through the
    row LSE with every other column's weight zero (``lse_i = s_ij``)."""
    import math

    sub = type(form)(form.q[:size], form.k[:size], form.alpha[:size], form.beta[:size])
    out = torch.empty(size, size, dtype=torch.float64, device=form.q.device)
    zero = torch.zeros(size, dtype=form.q.dtype, device=form.q.device)
    with backend.operand_scope():
        for j in range(size):
            log_w = torch.full_like(zero, -math.inf)
            log_w[j] = 0.0
            out[:, j] = backend.row_attend(sub, zero, 1.0, log_w=log_w)[0].double()
    return out


@pytest.mark.parametrize("d", [100, 804])
def test_split_scores_are_as_accurate_as_3xtf32_on_large_scores(d):
    """v22 (H200): the split operands' chunks summed in the MMA's truncating accumulator
    drifted by 2^-18 of the score (6.6e-4 on MNIST's self scores of 250, 3xTF32 4e-5),
    which stalled OTDD's float32 solves at 1e-4. Self scores of nonnegative features
    grow chunk after chunk, the case that drifts."""
    from flashot.geometry.costs import COSTS, attention_form

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(256, d, device="cuda", generator=g) * 2.0
    form = attention_form(COSTS["sqeuclidean"], x, x)
    ref = form.q[:64].double() @ form.k[:64].double().T
    errors = {}
    for presplit in (False, True):
        got = block_scores(TritonBackend(presplit=presplit), form)
        errors[presplit] = float((got - ref).abs().max())
    scale = float(ref.abs().max())
    assert errors[True] <= 2.0 * errors[False] + 2.0**-22 * scale, (errors, scale)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_split_kernel_matches_the_definition_bit_for_bit(device):
    """The split kernel compiled for this GPU (the interpreter's test runs the same code
    on numpy): largest entries at and one ulp above powers of two, tiny to huge, on the
    current GPU and on another one."""
    from flashot.backends.triton._split import split_operand
    from tests.backends.test_split import reference_split

    if torch.device(device).index == 1 and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    gen = torch.Generator().manual_seed(0)
    for k in (-130, -20, 0, 4, 14, 20, 100):
        for n, d in ((1, 1), (10_000, 64), (777, 3)):
            for above in (False, True):
                x = torch.randn(n, d, generator=gen)
                x = x / x.abs().max() * 2.0**k
                if above:
                    x.view(-1)[0] = torch.nextafter(torch.tensor(2.0**k), torch.tensor(1e38))
                xd = x.to(device)
                s = split_operand(xd)
                parts, inv = reference_split(x)
                assert s.parts.device == xd.device  # "cuda" resolves to the current index
                assert torch.equal(s.parts.cpu().view(torch.int16), parts.view(torch.int16))
                assert float(s.inv) == inv


def test_gate_views_at_any_offset_share_one_compiled_kernel():
    """A fused pass's gates are views of a small state buffer at various offsets; the
    kernel is not compiled again per offset (CONTROL_POINTERS: the GeomLoss call's first
    call built one set of constexprs three times)."""
    from flashot.backends.triton import _kernels
    from flashot.geometry.costs import attention_form, get_cost

    be = TritonBackend("fp32", autotune=False)
    x, y = data(512, 384, 8)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    f, g = torch.zeros(512, device="cuda"), torch.zeros(384, device="cuda")
    la, lb = torch.full_like(f, -math.log(512)), torch.full_like(g, -math.log(384))
    buf = torch.zeros(16, device="cuda")

    def builds():
        return sum(len(cache[0]) for cache in _kernels._plan_sums_kernel.device_caches.values())

    sums = [be.plan_sums(form, f, g, la, lb, 1.0, gate=(buf[0:2], buf[2:4]))]
    before = builds()
    for off in (2, 4, 6, 1, 3):  # 8-, 16- and 4-byte aligned views
        buf.zero_()
        sums.append(
            be.plan_sums(
                form, f, g, la, lb, 1.0, gate=(buf[off : off + 2], buf[off + 8 : off + 10])
            )
        )
    assert builds() == before
    for r, c in sums[1:]:  # and the sums are the same, but for the atomics' order
        torch.testing.assert_close(r, sums[0][0], rtol=1e-5, atol=0)
        torch.testing.assert_close(c, sums[0][1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("splits", [None, 4])
def test_looped_value_chunks_match_float64_on_the_gpu(monkeypatch, splits):
    """Running products kept in the output across tiles (VALUE_LOOP_FROM): what the
    interpreter cannot check, the GPU's ordering of one program's stores and loads."""
    from flashot.backends.triton import _configs

    x, y = data(3000, 2600, 1024)
    v = torch.randn(2600, 700, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    be = TritonBackend("fp32", autotune=False, splits=splits)
    res = flashot.sinkhorn(x, y, eps=200.0, max_iter=5, tol=None, backend=be)
    monkeypatch.setattr(_configs, "VALUE_LOOP_FROM", None)
    chunked = res.plan @ v
    monkeypatch.setattr(_configs, "VALUE_LOOP_FROM", 256)
    looped = res.plan @ v
    ref = flashot.sinkhorn(x.double(), y.double(), eps=200.0, max_iter=5, tol=None,
                           backend="torch").plan @ v.double()  # fmt: skip
    assert rel(looped.double(), ref) < 1e-5 and rel(chunked.double(), ref) < 1e-5
    assert rel(looped, chunked) < 1e-6


@pytest.mark.parametrize("blur,scaling,d", [(0.3, 0.7, 8), (0.05, 0.5, 3)])
def test_samples_loss_double_backward_on_triton_matches_float64(blur, scaling, d):
    """A fixed schedule's second derivative (the replayed schedule, flashot.autodiff.unrolled)
    on the Triton kernels against the same function in float64 on the torch backend; the
    gradient is the same with and without create_graph."""
    x, y = data(1200, 1000, d)
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


def test_lanczos_keeps_its_basis_on_the_operator_device():
    from flashot.numerics import linalg

    gen = torch.Generator("cuda").manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(300, 300, device="cuda", dtype=torch.float64,
                                       generator=gen))  # fmt: skip
    w = torch.linspace(0.5, 2.0, 300, device="cuda", dtype=torch.float64)
    w[-2:] = 3.0
    A = Q @ torch.diag(w) @ Q.T
    res = linalg.lanczos(lambda v: A @ v, torch.zeros(300, device="cuda", dtype=torch.float64),
                         k=2, which="largest")  # fmt: skip
    assert res.converged and res.values.is_cuda and res.vectors.is_cuda
    assert torch.allclose(res.values, torch.full((2,), 3.0, device="cuda", dtype=torch.float64))


def test_deterministic_mode_on_cuda_gives_bitwise_reruns(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) backend='auto' takes PyTorch's own
    ops (the Triton kernels refuse: atomic sums): reruns are bitwise identical."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    x, y = data(2000, 1500, 16)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            xs = x.clone().requires_grad_()
            res = flashot.sinkhorn(xs, y, eps=0.5)
            (g,) = torch.autograd.grad(res.cost, xs)
            runs.append((res.cost.detach(), res.f, g))
        assert res.plan.backend.name == "torch"
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        with pytest.raises(RuntimeError, match="deterministic"):
            flashot.sinkhorn(x, y, eps=0.5, backend="triton")
    finally:
        torch.use_deterministic_algorithms(False)
