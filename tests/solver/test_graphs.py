"""The graph cache's bookkeeping and the solver's use of it, with a stand-in for CUDA
graph capture that replays the recorded ops (:mod:`tests.recorded_graphs`; the real
capture runs in this file's GPU tests)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends.dual import Potentials
from flashot.backends.torch_backend import TorchBackend
from flashot.solver import graphs
from flashot.solver import loop as solver
from tests.conftest import clouds, cuda_clouds, rel, triton_backend
from tests.recorded_graphs import RecordedGraph

# replays the recorded aten ops with their recorded scalars, as a CUDA graph would
Replayer = RecordedGraph


def test_the_stand_in_replays_recorded_scalars_as_a_cuda_graph_does():
    """What these tests lean on: a replay repeats the recorded ops with their recorded
    Python scalars on the new data (a key that misses a temperature gives the old one's
    result), and a host read whose value changes at replay raises."""
    cache = graphs.GraphCache(capture=RecordedGraph)
    x = torch.arange(4.0)
    for scale in (2.0, 2.0, 3.0):  # eager, captured at 2.0, replayed "at 3.0"
        (out,) = cache("k", lambda t, s=scale: (t * s + 1.0,), [x + 1.0])
    assert torch.equal(out, (x + 1.0) * 2.0 + 1.0)
    branchy = graphs.GraphCache(capture=RecordedGraph)
    for t in (x, x, -x - 1.0):
        run = lambda u: (u * 2.0 if bool((u >= 0).all()) else -u,)  # noqa: E731
        if t[0] < 0:
            with pytest.raises(RuntimeError, match="host read changed"):
                branchy("b", run, [t])
        else:
            branchy("b", run, [t])


def test_a_replay_returns_copies_in_the_outputs_structure():
    """A captured function may return tensors, None and (nested) tuples of them (a solve's
    final passes); a replay hands back clones in that structure, never the static buffers."""
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4.0)
    out = graphs._copies((a, None, ((b, None), (c, a))))
    assert out[1] is None and out[2][0][1] is None
    got = [out[0], out[2][0][0], out[2][1][0], out[2][1][1]]
    for copy, static in zip(got, (a, b, c, a), strict=True):
        assert torch.equal(copy, static) and copy.data_ptr() != static.data_ptr()


def test_first_call_eager_second_captures_then_replays_and_lru_drops():
    Replayer.log = []
    cache = graphs.GraphCache(capacity=2, capture=Replayer)
    double = lambda t: (2 * t,)  # noqa: E731
    for value in (1.0, 2.0, 3.0):
        (out,) = cache("a", double, [torch.tensor([value])])
        assert out.item() == 2 * value
    assert Replayer.log == ["capture", "replay", "replay"]
    out[0] = -1.0  # a copy: the static output is untouched
    assert cache("a", double, [torch.tensor([5.0])])[0].item() == 10.0
    for key in ("b", "c"):
        cache(key, double, [torch.tensor([1.0])])
        cache(key, double, [torch.tensor([1.0])])
    assert list(cache._graphs) == ["b", "c"]  # "a" was the least recently used


@pytest.mark.parametrize("update", ["symmetric", "alternating"])
def test_solver_replays_fixed_iteration_solves_with_new_data(gen, monkeypatch, update):
    Replayer.log = []
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
    kw = dict(eps=0.3, max_iter=6, tol=None, update=update)
    for shift in (0.0, 1.0, 2.0):
        x, y = clouds(gen, 20, 15, 3, shift=shift)
        res = flashot.sinkhorn(x, y, **kw)
        monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: None)
        ref = flashot.sinkhorn(x, y, **kw)
        monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
        assert rel(res.f, ref.f) < 1e-13 and rel(res.cost, ref.cost) < 1e-13
    assert Replayer.log == ["capture", "replay", "replay"]
    flashot.sinkhorn(x, y, **{**kw, "eps": 0.4})  # another temperature: another key
    assert Replayer.log == ["capture", "replay", "replay"]


def test_replayed_loops_return_the_iterates_they_keep(gen, monkeypatch):
    """``keep_iterates`` in a replayed loop (the problem's and a self problem's): run,
    captured, then replayed on new data, each call returns its own stacked iterates
    (copies, not the graph's buffers), the eager loop's."""
    from flashot.geometry.costs import attention_form, get_cost

    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
    temps, log_w = [4.0, 1.0, 0.5], torch.full((20,), -math.log(20), dtype=torch.float64)
    kept, Replayer.log = [], []
    for shift in (0.0, 1.0, 2.0):
        x, _ = clouds(gen, 20, 15, 3, shift=shift)
        form = attention_form(get_cost("sqeuclidean"), x, x)
        outs = []
        for key in (("torch",), None):
            monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form, key=key: key)
            pair = solver.solve(form, log_w, log_w, temps, lambda e: (1.0, 1.0), (None, None),
                                TorchBackend(), max_iter=6, tol=None,
                                keep_iterates=True)  # fmt: skip
            own = solver.solve_self(form, log_w, temps, lambda e: 1.0, None, TorchBackend(),
                                    max_iter=6, tol=None, keep_iterates=True)  # fmt: skip
            outs.append((*pair.iterates, *own.iterates))
        for got, want in zip(*outs, strict=True):
            assert got.shape == (7, 20) and rel(got, want) < 1e-13
        kept.append(outs[0])
    assert not torch.equal(kept[0][0], kept[2][0])  # (the first call's not overwritten)
    assert Replayer.log.count("capture") == 2 and Replayer.log.count("replay") == 4


@pytest.mark.parametrize("replayed", [False, True])
def test_final_step_runs_with_the_loop_and_matches_the_extrapolation(gen, monkeypatch, replayed):
    """``final_step=True`` returns ``(λ T(g), λ T(f))`` of the loop's last iterate, in
    the replayed sequence too (so it costs no launches of its own there)."""
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
    key = ("torch",) if replayed else None
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: key)
    x, y = clouds(gen, 20, 15, 3)
    prob = flashot.problem.make_problem(x, y, eps=0.3, rho=0.5)
    form, la, lb = prob.form.detach(), prob.log_a, prob.log_b
    args = (form, la, lb, [1.0, 0.3], prob.damping, (0.5, 0.5), prob.engine)
    for _ in range(3):  # eager, captured, replayed
        out = solver.solve(*args, max_iter=5, tol=None, final_step=True)
        ref = prob.engine.extrapolate(
            Potentials(form, out.f, out.g, la, lb, 0.3), prob.damping(0.3)
        )
        assert out.final is not None
        assert rel(out.final[0], ref[0]) < 1e-14 and rel(out.final[1], ref[1]) < 1e-14
    assert solver.solve(*args, max_iter=5, tol=None).final is None


def _count_attends(monkeypatch) -> list:
    """Calls of the torch backend's ``row_attend`` (the streaming pass) made from Python:
    a replayed sequence runs its recorded ops instead and adds none."""
    calls: list = []
    original = TorchBackend.row_attend

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "row_attend", counted)
    return calls


@settings(max_examples=12, deadline=None)
@given(update=st.sampled_from(["symmetric", "alternating"]), rho=st.sampled_from([None, 0.7]),
       grad_y=st.booleans(), weights=st.booleans())  # fmt: skip
def test_a_differentiable_solve_replays_its_final_passes_with_the_eager_gradients(
    update, rho, grad_y, weights
):
    """With autograd on x (and y, and the weights) the final step's streaming passes run
    in the replayed sequence and autograd attaches to their outputs afterwards: values
    and gradients are the eager ones, and a replayed call streams nothing from Python."""
    gen = torch.Generator().manual_seed(int(grad_y) + 2 * int(weights))
    x, y = clouds(gen, 20, 15, 3)
    a = torch.rand(20, generator=gen, dtype=x.dtype) + 0.5 if weights else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
        calls = _count_attends(mp)
        outs = []
        for key in (("torch",), ("torch",), ("torch",), None):
            mp.setattr(TorchBackend, "graph_key", lambda self, form, key=key: key)
            xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_(grad_y)
            ag = None if a is None else a.clone().requires_grad_()
            calls.clear()
            cost = flashot.sinkhorn(xg, yg, ag, eps=0.3, max_iter=6, tol=None, update=update,
                                    rho=rho).cost  # fmt: skip
            wrt = [t for t in (xg, yg, ag) if t is not None and t.requires_grad]
            outs.append((cost.detach(), torch.autograd.grad(cost, wrt), len(calls)))
    *replayed, eager = outs
    for value, grads, _ in replayed:
        assert rel(value, eager[0]) < 1e-13
        assert all(rel(g, e) < 1e-12 for g, e in zip(grads, eager[1], strict=True))
    # the replay streamed nothing eagerly (a relaxed cost measures the plan's mass after)
    assert replayed[-1][2] == (0 if rho is None else 2) and eager[2] > 2
    assert eager[1][0].abs().max() > 0


def test_debiased_divergence_replays_its_self_problems_too(gen, monkeypatch):
    """A fixed-schedule debiased divergence (the GeomLoss call) runs three loops: the
    problem and the two self problems. All three replay (the self problems' loops were
    most of the call's eager launches at 10k); values and gradients are the eager ones."""
    Replayer.log = []
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
    calls = _count_attends(monkeypatch)
    loss = flashot.SamplesLoss(blur=0.2, scaling=0.5, debias=True, diameter=4.0,
                               backend="torch")  # fmt: skip
    for shift in (0.0, 0.5, 1.0):  # (a fixed diameter: the same temperatures each call)
        x, y = clouds(gen, 20, 15, 3, shift=shift)
        outs = []
        for key in (("torch",), None):  # replayed (from the second call on), then eager
            monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form, key=key: key)
            xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
            calls.clear()
            value = loss(xg, yg)
            grads = torch.autograd.grad(value, (xg, yg))
            outs.append((value.detach(), grads, len(calls)))
        assert rel(outs[0][0], outs[1][0]) < 1e-13
        assert all(rel(r, e) < 1e-12 for r, e in zip(outs[0][1], outs[1][1], strict=True))
        # replayed (the third call; the first runs eagerly, the second captures): the final
        # c-transforms of all three problems ran in their graphs
        assert outs[0][2] == (0 if shift == 1.0 else outs[1][2]) and outs[1][2] > 0
    # (a capture replays at once: its call's outputs are the replay's)
    assert Replayer.log == ["capture", "replay"] * 3 + ["replay"] * 3


def test_self_problem_replays_are_keyed_by_their_near_steps(gen, monkeypatch):
    """A replayed loop is keyed by which LSE each step takes: the same shapes and
    temperatures with a cost bound that sends the final step to the near path are
    another sequence of launches, so another capture."""
    Replayer.log = []
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
    from flashot.geometry.costs import attention_form, get_cost

    x, _ = clouds(gen, 20, 15, 3)
    log_a = torch.full((20,), -math.log(20), dtype=torch.float64)
    outs = []
    for scale in (1.0, 1.0, 1.0, 1e-3, 1e-3):  # the bound shrinks below the final ε
        form = attention_form(get_cost("sqeuclidean"), x * scale, x * scale)
        temps = [4.0, 1.0, 0.5]
        out = solver.solve_self(form, log_a, temps, lambda e: 1.0, None, TorchBackend(),
                                max_iter=6, tol=None)  # fmt: skip
        monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: None)
        ref = solver.solve_self(form, log_a, temps, lambda e: 1.0, None, TorchBackend(),
                                max_iter=6, tol=None)  # fmt: skip
        monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
        assert rel(out.f, ref.f) < 1e-13
        outs.append(out)
    assert Replayer.log == ["capture", "replay", "replay", "capture", "replay"]


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_repeated_fixed_iteration_solves_replay_a_cuda_graph(precision, monkeypatch):
    """New data each call (the bf16 copies must be remade inside the graph); replays
    equal eager solves; a warm start is another key. The second step's probe runs
    inside the graph too."""
    from flashot.backends.triton import _step
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    cache = graphs.GraphCache()
    monkeypatch.setattr(solver, "GRAPHS", cache)
    monkeypatch.setattr(_step, "PROBE_FROM", 1024)
    kw = dict(eps=0.1, max_iter=10, tol=None)
    for seed in range(4):
        x, y = cuda_clouds(3000, 2000, 64, seed)
        res = flashot.sinkhorn(x, y, backend=triton_backend(precision), **kw)
        ref = flashot.sinkhorn(x, y, backend=triton_backend(precision, graphs=False), **kw)
        assert rel(res.f, ref.f) < 1e-6 and rel(res.g, ref.g) < 1e-6
        assert rel(res.cost, ref.cost) < 1e-6
        warm = dict(kw, init=(ref.f * 0.9, ref.g * 0.9))
        res = flashot.sinkhorn(x, y, backend=triton_backend(precision), **warm)
        ref = flashot.sinkhorn(x, y, backend=triton_backend(precision, graphs=False), **warm)
        assert rel(res.f, ref.f) < 1e-6 and rel(res.cost, ref.cost) < 1e-6
    assert len(cache._graphs) == 2


def _replayed_and_eager_loss(x, y, kw):
    """``SamplesLoss(**kw)`` value and gradient w.r.t. x, with graphs and without."""
    outs = []
    for be in (triton_backend(), triton_backend(graphs=False)):
        xg = x.clone().requires_grad_()
        value = flashot.SamplesLoss(backend=be, **kw)(xg, y)
        outs.append((value.detach(), torch.autograd.grad(value, xg)[0]))
    return outs


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
    for step, be in enumerate([triton_backend()] * 4 + [triton_backend(graphs=False)]):
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


@pytest.mark.gpu
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
        x, y = cuda_clouds(3000, 2500, 16, seed=seed)
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
