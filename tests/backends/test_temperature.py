"""Temperatures on the device: the table's rows, and replays that serve any schedule of one
structure (:mod:`flashot.backends.temperature`), under the stand-in capture that replays recorded
ops with their recorded scalars (:mod:`tests.recorded_graphs`)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends.temperature import (
    LOG2E,
    Temperature,
    device_damping,
    device_value,
    schedule_table,
    temperatures_on,
)
from flashot.backends.torch_backend import TorchBackend
from flashot.solver import graphs
from flashot.solver import loop as solver
from flashot.solver.schedule import geomloss_schedule
from tests.conftest import clouds, rel
from tests.recorded_graphs import RecordedGraph


class CellBackend(TorchBackend):
    """The torch backend with a row LSE that reads a temperature's device cell (dense)."""

    def reads_temperatures(self, form):
        return form.segments is None

    def _row_attend(self, form, h, eps, v=None):
        e = device_value(eps)
        s = (form.q @ form.k.T + h) / e
        lse = e * torch.logsumexp(s, 1)
        return lse, None if v is None else torch.softmax(s, 1) @ v


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=12),
       st.sampled_from([None, 0.3, (0.3, None)]),
       st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_table_rows_are_the_scalars_a_kernel_would_take(eps_list, rho, dtype):
    """Row i is (ε_i, log2(e)/ε_i, min(1, ε_i/ε_{i−1}), λ_x(ε_i), λ_y(ε_i)) rounded from
    float64 to the solve's dtype, as a scalar argument is; each temperature is its float
    with its row, and its row's damping is the one the table was built with."""
    pair = rho if isinstance(rho, tuple) else (rho, rho)

    def damping(e):
        lam = tuple(1.0 if r is None else r / (r + e) for r in pair)
        return lam if isinstance(rho, tuple) else lam[0]  # (a pair, or one λ for both)

    table = schedule_table(eps_list, torch.device("cpu"), dtype, damping)
    temps = temperatures_on(eps_list, table)
    for i, (e, t) in enumerate(zip(eps_list, temps, strict=True)):
        ratio = 1.0 if i == 0 else min(1.0, e / eps_list[i - 1])
        lam = tuple(1.0 if r is None else r / (r + e) for r in pair)
        want = torch.tensor([e, LOG2E / e, ratio, *lam], dtype=torch.float64).to(dtype)
        assert torch.equal(table[i], want) and torch.equal(t.cell, want)
        assert float(t) == e and t.index == i and isinstance(t, float)
        assert torch.equal(device_value(t), want[0]) and device_value(e) == e
        row_lam = device_damping(t, None)
        assert torch.equal(row_lam[0], want[3]) and torch.equal(row_lam[1], want[4])
        assert device_damping(e, lam) == lam


def test_a_schedule_table_is_shared_by_solves_of_the_same_schedule():
    """One device table per schedule, dtype and damping (a divergence's three solves, a
    repeated call): the same tensor again, a new one when any of them differs, and only
    the last TABLES_KEPT kept."""
    from flashot.backends import temperature

    cpu = torch.device("cpu")
    first = schedule_table([4.0, 1.0, 0.25], cpu)
    assert schedule_table([4.0, 1.0, 0.25], cpu) is first
    assert schedule_table([4.0, 1.0, 0.25], cpu, damping=lambda e: 1.0) is first  # same rows
    others = [schedule_table([4.0, 1.0, 0.25], cpu, torch.float64),
              schedule_table([4.0, 1.0, 0.25], cpu, damping=lambda e: 0.5 / (0.5 + e)),
              schedule_table([4.0, 1.0, 0.5], cpu)]  # fmt: skip
    assert all(t is not first for t in others)
    assert torch.allclose(others[0], first.double(), rtol=1e-7) and not torch.equal(
        others[1], first
    )
    for i in range(temperature.TABLES_KEPT):
        schedule_table([float(i + 10)], cpu)
    assert len(temperature._TABLES) == temperature.TABLES_KEPT
    again = schedule_table([4.0, 1.0, 0.25], cpu)
    assert again is not first and torch.equal(again, first)


def _moving(gen, scales):
    """Clouds scaled so that the diameter (and every warm-up temperature) moves, and
    weights that are not uniform (a baked ``ε log w`` would then show)."""
    x, y = clouds(gen, 24, 17, 3)
    a = torch.rand(24, generator=gen, dtype=x.dtype) + 0.2
    b = torch.rand(17, generator=gen, dtype=x.dtype) + 0.2
    return [(a / a.sum(), x * s, b / b.sum(), y * s + 0.5) for s in scales]


@pytest.mark.parametrize("debias, reach", [(False, None), (True, None), (True, 0.8)])
def test_replays_serve_schedules_that_move_with_the_data(gen, monkeypatch, debias, reach):
    """SamplesLoss with the data's diameter (GeomLoss' call in a training loop): each call
    has other warm-up temperatures, the same schedule length. A backend that reads the
    temperatures (and the unbalanced damping λ(ε)) from the table replays one graph per
    loop from the second call on, and the values and gradients are the eager ones; the
    final ε keys by value."""
    loss = flashot.SamplesLoss(blur=0.1, scaling=0.5, debias=debias, reach=reach,
                               backend=CellBackend())  # fmt: skip
    cache = graphs.GraphCache(capture=RecordedGraph)
    monkeypatch.setattr(solver, "GRAPHS", cache)
    RecordedGraph.log = []
    pairs = _moving(gen, (1.0, 0.97, 1.04, 0.99))
    lengths = set()
    for a, x, b, y in pairs:
        lengths.add(len(geomloss_schedule(_diameter(x, y), 0.01, 0.5)))
        outs = []
        for key in (("cells",), None):  # replayed where the key repeats, then eager
            monkeypatch.setattr(CellBackend, "graph_key", lambda self, form, key=key: key)
            xg = x.clone().requires_grad_()
            value = loss(a, xg, b, y)
            outs.append((value.detach(), torch.autograd.grad(value, xg)[0]))
        assert rel(outs[0][0], outs[1][0]) < 1e-13 and rel(outs[0][1], outs[1][1]) < 1e-12
    loops = 3 if debias else 1
    assert len(lengths) == 1
    assert RecordedGraph.log == ["capture", "replay"] * loops + ["replay"] * (2 * loops)


def _diameter(x, y):
    both = torch.cat([x, y])
    return float((both.amax(0) - both.amin(0)).norm())


def test_a_backend_without_cells_keys_every_temperature(gen, monkeypatch):
    """The torch backend's LSE bakes ε: its moving schedules are other keys (no replay of
    another diameter's graph), and each call is its eager solve."""
    loss = flashot.SamplesLoss(blur=0.1, scaling=0.5, debias=False, backend="torch")
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=RecordedGraph))
    monkeypatch.setattr(TorchBackend, "graph_key", lambda self, form: ("torch",))
    RecordedGraph.log = []
    for a, x, b, y in _moving(gen, (1.0, 0.97, 1.04)):
        loss(a, x, b, y)
    assert RecordedGraph.log == []


def test_a_near_warm_up_step_keys_its_temperature(gen, monkeypatch):
    """A warm-up step on the near-uniform path (torch ops with ε as a scalar) keeps its
    temperature in the key even where the backend reads cells: a schedule that differs
    there is another capture, and each replay equals its eager solve."""
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=RecordedGraph))
    from flashot.geometry.costs import attention_form, get_cost

    x, y = clouds(gen, 20, 15, 3)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    log_a = torch.full((20,), -math.log(20), dtype=torch.float64)
    log_b = torch.full((15,), -math.log(15), dtype=torch.float64)
    bound = form.cost_bound
    RecordedGraph.log = []
    for first in (50 * bound, 50 * bound, 60 * bound, 60 * bound):  # near: keyed by value
        temps = [first, 0.3 * bound, 0.1 * bound]
        kw = dict(max_iter=5, tol=None, update="symmetric")
        outs = []
        for key in (("cells",), None):
            monkeypatch.setattr(CellBackend, "graph_key", lambda self, form, key=key: key)
            outs.append(solver.solve(form, log_a, log_b, temps, lambda e: (1.0, 1.0),
                                     (None, None), CellBackend(), **kw))  # fmt: skip
        assert torch.equal(outs[0].f, outs[1].f) and torch.equal(outs[0].g, outs[1].g)
    assert RecordedGraph.log == ["capture", "replay", "capture", "replay"]


@pytest.mark.parametrize("update", ["symmetric", "alternating"])
@pytest.mark.parametrize("rho", [None, 0.7])
def test_solver_loops_replay_other_warm_ups_with_their_eager_iterates(gen, monkeypatch, update,
                                                                      rho):  # fmt: skip
    """Both updates, balanced or not, fixed iterations and to a tolerance (in blocks):
    schedules that differ in their warm-up values replay the first one's graphs, with the
    eager solve's potentials (the damping λ(ε) read from the rows too)."""
    monkeypatch.setattr(solver, "GRAPHS", graphs.GraphCache(capture=RecordedGraph))
    from flashot.geometry.costs import attention_form, get_cost

    x, y = clouds(gen, 20, 15, 3)
    form = attention_form(get_cost("sqeuclidean"), x, y).detach()
    log_a = torch.log(torch.rand(20, generator=gen, dtype=torch.float64) + 0.2)
    log_b = torch.full((15,), -math.log(15), dtype=torch.float64)
    lam = (lambda e: 1.0) if rho is None else (lambda e: rho / (rho + e))
    bound = form.cost_bound
    for tol in (None, 1e-12):
        RecordedGraph.log = []
        for s in (1.0, 1.3, 0.8, 1.1):
            temps = [1.5 * s * bound, 0.6 * s * bound, 0.05 * bound]
            outs = []
            for key in (("cells",), None):
                monkeypatch.setattr(CellBackend, "graph_key", lambda self, form, key=key: key)
                outs.append(solver.solve(form, log_a, log_b, temps, lambda e: (lam(e), lam(e)),
                                         (rho, rho), CellBackend(), max_iter=23, tol=tol,
                                         check_every=5, update=update))  # fmt: skip
            assert torch.equal(outs[0].f, outs[1].f) and torch.equal(outs[0].g, outs[1].g)
            assert outs[0].n_iter == outs[1].n_iter
        # (a symmetric solve to a tolerance runs eagerly: its gate lives across checks)
        assert ("replay" in RecordedGraph.log) == (tol is None or update == "alternating")


@settings(max_examples=20, deadline=None)
@given(warm=st.sampled_from([[3.0, 1.0], [8.0, 4.0, 2.0, 1.0, 0.5]]), every=st.integers(1, 7),
       min_iter=st.integers(0, 30), max_iter=st.integers(6, 60),
       tol=st.sampled_from([1e-2, 1e-5, 1e-9, 0.0]), rho=st.sampled_from([None, 2.0]),
       dtype=st.sampled_from([torch.float32, torch.float64]), selfp=st.booleans())  # fmt: skip
def test_blocks_replay_across_moving_warm_ups_with_the_eager_iterates(
    warm, every, min_iter, max_iter, tol, rho, dtype, selfp
):
    """Solves to a tolerance in blocks (alternating, or a self problem's symmetric loop)
    whose warm-up temperatures move from call to call (the same length, the same final
    ε): the warm-up block replays another call's graph, reading this call's rows, and
    every field of the result is this call's eager loop's, bit for bit."""
    from hypothesis import assume

    from flashot.geometry.costs import attention_form, get_cost

    assume(min_iter <= max_iter)
    gen = torch.Generator().manual_seed(len(warm) + every + max_iter)
    x, y = clouds(gen, 20, 15, 3, dtype=dtype)
    form = attention_form(get_cost("sqeuclidean"), x, x if selfp else y).detach()
    la = torch.log(torch.rand(20, generator=gen, dtype=dtype) + 0.2)
    lb = la if selfp else torch.full((15,), -math.log(15), dtype=dtype)
    lam = (lambda e: 1.0) if rho is None else (lambda e: rho / (rho + e))
    kw = dict(max_iter=max(max_iter, len(warm) + 1), tol=tol, check_every=every,
              min_iter=min_iter)  # fmt: skip

    def run(temps):
        if selfp:
            return solver.solve_self(form, la, temps, lam, rho, CellBackend(), **kw)
        return solver.solve(form, la, lb, temps, lambda e: (lam(e), lam(e)), (rho, rho),
                            CellBackend(), update="alternating", **kw)  # fmt: skip

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(solver, "GRAPHS", graphs.GraphCache(capture=RecordedGraph))
        RecordedGraph.log = []
        for scale in (1.0, 1.25, 0.8, 1.1):
            temps = [t * scale for t in warm] + [0.3]
            mp.setattr(CellBackend, "graph_key", lambda self, form: None)
            ref = run(temps)
            mp.setattr(CellBackend, "graph_key", lambda self, form: ("cells",))
            out = run(temps)
            assert torch.equal(out.f, ref.f) and torch.equal(out.g, ref.g)
            assert (out.n_iter, out.converged, out.cause) == (ref.n_iter, ref.converged, ref.cause)
            same = out.error == ref.error or (math.isnan(out.error) and math.isnan(ref.error))
            assert same and out.floor == ref.floor
    assert "replay" in RecordedGraph.log


def test_a_temperature_pickles_as_its_value():
    import pickle

    t = temperatures_on([0.5], schedule_table([0.5], torch.device("cpu")))[0]
    assert isinstance(t, Temperature)
    back = pickle.loads(pickle.dumps(t))
    assert back == 0.5 and type(back) is float
