"""A schedule's iterations in replayed blocks (flashot.solver.blocks): solves to a
tolerance run as blocks ending at a check, with the eager loop's results bit for bit
(a stand-in capture on the CPU, :mod:`tests.recorded_graphs`; CUDA graphs in the GPU
test)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends.torch_backend import TorchBackend
from flashot.problem import make_problem
from flashot.solver import graphs
from flashot.solver import loop as solver
from tests.conftest import clouds, cuda_clouds, rel, triton_backend
from tests.recorded_graphs import RecordedGraph

# replays the recorded aten ops with their recorded scalars, as a CUDA graph would
Replayer = RecordedGraph


#: a solve to a tolerance: schedules, check grids, budgets, tolerances met and missed
TOLERANCE_SOLVES = dict(
    temps=st.sampled_from([[0.3], [3.0, 1.0, 0.3], [8.0, 4.0, 2.0, 1.0, 0.5, 0.25]]),
    every=st.integers(1, 7),
    min_iter=st.integers(0, 30),
    max_iter=st.integers(6, 60),
    tol=st.sampled_from([1e-2, 1e-5, 1e-9, 0.0]),
    rho=st.sampled_from([None, 2.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)


@settings(max_examples=25, deadline=None)
@given(**TOLERANCE_SOLVES, warm=st.booleans())
def test_solves_to_a_tolerance_replay_blocks_with_the_eager_iterates(
    temps, every, min_iter, max_iter, tol, rho, warm, dtype
):
    """A solve with ``tol`` (alternating) runs as blocks of iterations ending at a check,
    each a graph key: eager on its first use, captured the next, replayed after. Every
    field of the result is the eager loop's, bit for bit (the same launches), whether a
    block is run, captured or replayed, including misses and their causes."""
    from hypothesis import assume

    assume(min_iter <= max_iter)
    gen = torch.Generator().manual_seed(len(temps) + every + max_iter)
    x, y = clouds(gen, 20, 15, 3, dtype=dtype)
    prob = make_problem(x, y, eps=temps[-1], rho=rho)
    form, la, lb = prob.form.detach(), prob.log_a, prob.log_b
    init = (0.5 * form.alpha, 0.5 * form.beta) if warm else None
    args = (form, la, lb, temps, prob.damping, (rho, rho), prob.engine)
    kw = dict(max_iter=max(max_iter, len(temps)), tol=tol, check_every=every, min_iter=min_iter,
              update="alternating", init=init)  # fmt: skip
    cache = graphs.GraphCache(capture=Replayer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchBackend, "graph_key", lambda self, form: None)
        ref = solver.solve(*args, **kw)
        mp.setattr(solver, "GRAPHS", cache)
        mp.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
        Replayer.log = []
        for _ in range(3):  # each block: eager, captured, replayed
            out = solver.solve(*args, **kw)
            assert torch.equal(out.f, ref.f) and torch.equal(out.g, ref.g)
            assert (out.n_iter, out.converged, out.cause) == (ref.n_iter, ref.converged, ref.cause)
            same = out.error == ref.error or (math.isnan(out.error) and math.isnan(ref.error))
            assert same and out.floor == ref.floor
    assert "replay" in Replayer.log


@settings(max_examples=20, deadline=None)
@given(**TOLERANCE_SOLVES)
def test_self_problems_to_a_tolerance_replay_blocks_with_the_eager_iterates(
    temps, every, min_iter, max_iter, tol, rho, dtype
):
    """The debiased divergence's self problems (symmetric updates, one potential) in
    replayed blocks: the eager loop's potential, iterations, error and cause, bit for bit."""
    from hypothesis import assume

    from flashot.geometry.costs import attention_form, get_cost

    assume(min_iter <= max_iter)
    gen = torch.Generator().manual_seed(len(temps) + every + max_iter)
    x, _ = clouds(gen, 20, 15, 3, dtype=dtype)
    form = attention_form(get_cost("sqeuclidean"), x, x)
    log_a = torch.full((20,), -math.log(20), dtype=dtype)
    damping = (lambda e: 1.0) if rho is None else (lambda e: rho / (rho + e))
    args = (form, log_a, temps, damping, rho, TorchBackend())
    kw = dict(max_iter=max(max_iter, len(temps)), tol=tol, check_every=every, min_iter=min_iter)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchBackend, "graph_key", lambda self, form: None)
        ref = solver.solve_self(*args, **kw)
        mp.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
        mp.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
        Replayer.log = []
        for _ in range(3):
            out = solver.solve_self(*args, **kw)
            assert torch.equal(out.f, ref.f)
            assert (out.n_iter, out.converged, out.cause) == (ref.n_iter, ref.converged, ref.cause)
            same = out.error == ref.error or (math.isnan(out.error) and math.isnan(ref.error))
            assert same and out.floor == ref.floor
    assert "replay" in Replayer.log


def test_a_long_solve_replays_one_graph_for_its_blocks_at_the_final_eps(gen, monkeypatch):
    """Blocks at the final ε differ only in their data: a solve that runs to max_iter
    captures its warm-up block and one block of ``check_every`` iterations, then
    replays; the unbalanced ρ and a symmetric update (its fast state lives across
    blocks) or momentum stay eager."""
    Replayer.log = []
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=Replayer))
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
    x, y = clouds(gen, 20, 15, 3)
    with pytest.warns(flashot.ConvergenceWarning):
        res = flashot.sinkhorn(x, y, eps=0.05, tol=0.0, max_iter=200, eps_schedule="geomloss")
    assert res.n_iter == 200
    assert Replayer.log.count("capture") == 1 and Replayer.log.count("replay") >= 15
    # moved data (a training step): another diameter, so other warm-up temperatures,
    # the same final ε: the blocks at the final ε replay the same graph (only the
    # short last block, met a second time, may be captured now)
    Replayer.log = []
    kw = dict(eps=0.05, tol=0.0, max_iter=200, eps_schedule="geomloss")
    with pytest.warns(flashot.ConvergenceWarning):
        moved = flashot.sinkhorn(1.3 * x, y, **kw)
    assert Replayer.log[:17] == ["replay"] * 17 and Replayer.log.count("capture") <= 1
    # the replays (recorded ops, recorded scalars) give the eager solve's potentials
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: None)
    with pytest.warns(flashot.ConvergenceWarning):
        eager = flashot.sinkhorn(1.3 * x, y, **kw)
    assert torch.equal(moved.f, eager.f) and torch.equal(moved.g, eager.g)
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
    Replayer.log = []
    for options in (dict(update="symmetric"), dict(momentum=1.3)):
        flashot.sinkhorn(x, y, eps=0.3, tol=1e-6, max_iter=200, **options)
        flashot.sinkhorn(x, y, eps=0.3, tol=1e-6, max_iter=200, **options)
    assert Replayer.log == []


@pytest.mark.gpu
def test_solves_to_a_tolerance_replay_their_blocks_as_cuda_graphs(monkeypatch):
    """A solve with ``tol`` replays its blocks of iterations (each ending at a check):
    the same iterations, error and potentials as the eager loop, on new data each call."""
    from flashot.solver import graphs
    from flashot.solver import loop as solver

    cache = graphs.GraphCache()
    monkeypatch.setattr(solver, "GRAPHS", cache)
    kw = dict(eps=0.5, tol=1e-4, max_iter=300, eps_schedule="geomloss")
    for seed in range(4):
        x, y = cuda_clouds(3000, 2000, 16, seed)
        res = flashot.sinkhorn(x, y, backend=triton_backend(), **kw)
        ref = flashot.sinkhorn(x, y, backend=triton_backend(graphs=False), **kw)
        assert res.converged and ref.converged and abs(res.n_iter - ref.n_iter) <= 10
        assert rel(res.f, ref.f) < 1e-5 and rel(res.cost, ref.cost) < 1e-6
        # the debiased divergence: its self problems' loops (symmetric) in blocks too
        div = flashot.sinkhorn_divergence(x, y, backend=triton_backend(), **kw)
        div_ref = flashot.sinkhorn_divergence(x, y, backend=triton_backend(graphs=False), **kw)
        assert rel(div, div_ref) < 1e-5
    assert len(cache._graphs) >= 3
