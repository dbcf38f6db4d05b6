"""The replayed schedule as one autograd node (flashot.autodiff.replay): its graph routing.

The derivative itself is tested through every entry point in test_unrolled.py (against
finite differences of float64 gradients); here, that the node's two directions go
through their graph cache, by value or by the schedule's structure, with the eager
numbers.
"""

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

import flashot
from flashot.autodiff import replay, second_order
from flashot.backends import available_backends
from flashot.solver.graphs import GraphCache
from flashot.solver.loop import geomloss_schedule
from tests.autodiff.test_unrolled import double_backward, problem
from tests.conftest import cuda_clouds, rel


def stand_in(captured: list):
    """A capture for the CPU: records the call and replays by calling the captured fn."""

    def capture(fn, inputs):
        captured.append(len(inputs))
        return lambda inputs: tuple(fn(*inputs))

    return capture


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [False, True])
def test_replayed_schedule_graphs_give_the_eager_second_derivative(monkeypatch, kept):
    """The replay and its adjoint sweep run eagerly on a key's first call, captured on
    the second and replayed after (flashot.autodiff.replay): the same HVP each time
    (to the atomics' rounding), one forward and one backward graph per piece; with the
    solves' iterates kept (their loops replayed as graphs too) the forward reads them
    and only the backward is a graph."""
    from flashot.solver.graphs import _Captured

    if not kept:
        monkeypatch.setattr(replay, "_kept", lambda *t: None)
    REPLAY_GRAPHS = replay.REPLAY_GRAPHS
    REPLAY_GRAPHS.clear()
    x, y = cuda_clouds(2000, 1500, 8)
    v = torch.randn_like(x)
    # (kept iterates are read where their LSEs hold to cg_tol: at blur 0.1 they do not,
    # and every call's own solve rounds them anew: the HVPs then agree to that tolerance)
    loss = flashot.SamplesLoss(blur=0.3 if kept else 0.1, scaling=0.7, debias=True,
                               backend="triton")  # fmt: skip
    hs = []
    for _ in range(4):
        xs = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(loss(xs, y), xs, create_graph=True)
        hs.append(torch.autograd.grad((g * v).sum(), xs)[0])
    # (xy and xx pieces; y is fixed: no yy replay), each a CUDA graph, not the eager
    # fallback of a capture that failed (something in it waited for the host)
    assert len(REPLAY_GRAPHS._graphs) == (2 if kept else 4)
    assert all(isinstance(c, _Captured) for c in REPLAY_GRAPHS._graphs.values())
    assert all(rel(h, hs[0]) < (1e-4 if kept else 1e-5) for h in hs[1:])


@pytest.mark.parametrize("kept", [False, True])
def test_replay_routes_through_its_graph_cache_where_the_backend_keys_one(monkeypatch, kept):
    """With a graph key (a stand-in capture on the CPU) the replay's two directions are
    keys of their own, served from the cache from the second call on, with the eager
    derivative; with the solve's iterates kept the forward reads them outside any graph
    and only the reverse sweep is keyed."""
    captured: list = []
    monkeypatch.setattr(replay, "REPLAY_GRAPHS", GraphCache(capture=stand_in(captured)))
    if not kept:
        monkeypatch.setattr(replay, "_kept", lambda *t: None)
    x, y, a, b, v = problem(7, 6, 5, 2)
    loss = flashot.SamplesLoss(blur=0.2, scaling=0.6, diameter=4.0, debias=False)
    eager = double_backward(lambda t: loss(a, t, b, y), x, v)[1]
    # (the solver's own loop keeps its eager path: only the replay is keyed)
    monkeypatch.setattr(replay, "_graph_key", lambda spec, form: ("stand-in",))
    hs = [double_backward(lambda t: loss(a, t, b, y), x, v)[1] for _ in range(3)]
    keys = 1 if kept else 2
    assert len(captured) == keys and len(replay.REPLAY_GRAPHS._graphs) == keys
    assert all(torch.equal(h, eager) for h in hs)


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
@pytest.mark.parametrize("reach", [None, 0.7])
def test_a_structure_key_serves_a_moved_schedule_by_its_device_table(monkeypatch, reach):
    """On the Triton kernels (interpreter), a replay keyed by the schedule's structure is
    captured once and then serves another schedule of that structure (another diameter),
    with that schedule's eager derivative: every launch and torch op of both directions
    reads the temperatures' device table (ε, and the damping of a relaxed side), none the
    captured call's floats (the schedule run, not read from kept iterates)."""
    from flashot.backends.triton import TritonBackend

    monkeypatch.setattr(replay, "_kept", lambda *t: None)
    x, y, a, b, v = problem(9, 8, 6, 2, dtype=torch.float32)
    backend = TritonBackend()
    diameters = (3.0, 3.5)  # (7 temperatures each, all different)
    assert len({len(geomloss_schedule(d, 0.09, 0.6)) for d in diameters}) == 1

    def hvp(diameter):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.6, diameter=diameter, reach=reach,
                                   backend=backend)  # fmt: skip
        return double_backward(lambda t: loss(a, t, b, y), x, v)[1]

    want = [hvp(d) for d in diameters]  # eager: the backend keys no graph on the CPU
    captured: list = []
    monkeypatch.setattr(replay, "REPLAY_GRAPHS", GraphCache(capture=stand_in(captured)))
    monkeypatch.setattr(replay, "_graph_key", lambda spec, form: ("stand-in",))
    got = [hvp(d) for d in (diameters[0], diameters[0], diameters[1])]
    # forward and backward of the xy and xx pieces (y is fixed: no yy replay), once each
    assert len(captured) == 4, captured
    assert rel(got[1], want[0]) < 1e-5 and rel(got[2], want[1]) < 1e-5
    assert rel(want[0], want[1]) > 1e-3  # (the schedules' derivatives differ)


@pytest.mark.gpu
def test_points_that_move_replay_the_same_graphs_with_the_eager_derivative(monkeypatch):
    """A GeomLoss schedule moves with the data's diameter: on the Triton kernels the
    replay keys its graphs by the schedule's structure, so points that move every call
    (an optimizer's) replay the graphs captured once, with the derivative an eager
    replay (graphs=False) gives at each point (both run the schedule: no kept iterates)."""
    from flashot.backends.triton import TritonBackend
    from flashot.solver.graphs import _Captured

    replay.REPLAY_GRAPHS.clear()
    monkeypatch.setattr(replay, "_kept", lambda *t: None)
    x, y = cuda_clouds(2000, 1500, 8)
    v = torch.randn_like(x)
    points = [x * (1 + 0.002 * i) for i in range(5)]
    diameters = [8.0 + 0.05 * i for i in range(5)]  # (a new schedule of one length each call)
    assert len({len(geomloss_schedule(d, 0.01, 0.7)) for d in diameters}) == 1

    def hvps(backend):
        out = []
        for p, diameter in zip(points, diameters, strict=True):
            loss = flashot.SamplesLoss(blur=0.1, scaling=0.7, diameter=diameter, backend=backend)
            ps = p.clone().requires_grad_()
            (g,) = torch.autograd.grad(loss(ps, y), ps, create_graph=True)
            out.append(torch.autograd.grad((g * v).sum(), ps)[0])
        return out

    eager = hvps(TritonBackend(graphs=False))
    assert len(replay.REPLAY_GRAPHS._graphs) == 0
    got = hvps(TritonBackend())
    graphs = list(replay.REPLAY_GRAPHS._graphs.values())
    assert len(graphs) == 4 and all(isinstance(c, _Captured) for c in graphs)
    assert all(rel(h, e) < 1e-5 for h, e in zip(got, eager, strict=True))


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
@pytest.mark.parametrize("reach,presplit", [(None, True), (0.7, False), (None, False)])
def test_a_symmetric_steps_two_reverse_products_in_one_launch(reach, presplit):
    """With ``SYM_VJP`` (the default) a replayed symmetric step differentiates both
    transforms in one launch (where y takes no gradient), in two with y moving too (the
    second on the transposed form): the gradient and HVPs of two reverse products per
    step, and of float64 on the torch backend."""
    from flashot.backends.triton import TritonBackend, _configs
    from flashot.backends.triton import backend as triton_backend

    x, y, a, b, v = problem(11, 9, 7, 3, dtype=torch.float32)
    w = torch.randn_like(y)

    def hvps(backend, dtype=torch.float32):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.6, diameter=4.0, reach=reach,
                                   backend=backend)  # fmt: skip
        xs, ys = x.to(dtype).requires_grad_(), y.to(dtype)
        (g,) = torch.autograd.grad(loss(a.to(dtype), xs, b.to(dtype), ys), xs, create_graph=True)
        only_x = torch.autograd.grad((g * v.to(dtype)).sum(), xs)[0]
        ys = ys.clone().requires_grad_()
        gx, gy = torch.autograd.grad(loss(a.to(dtype), xs, b.to(dtype), ys), (xs, ys),
                                     create_graph=True)  # fmt: skip
        both = torch.autograd.grad((gx * v.to(dtype)).sum() + (gy * w.to(dtype)).sum(), xs)[0]
        return g.detach(), only_x, both

    want = hvps("torch", torch.float64)
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        spy = triton_backend.symmetric_vjp
        mp.setattr(triton_backend, "symmetric_vjp",
                   lambda *t, **kw: calls.append(1) or spy(*t, **kw))  # fmt: skip
        mp.setattr(_configs, "SYM_VJP", False)
        two = hvps(TritonBackend(presplit=presplit))
        assert not calls
        mp.setattr(_configs, "SYM_VJP", True)
        one = hvps(TritonBackend(presplit=presplit))
    steps = len(geomloss_schedule(4.0, 0.09, 0.6))  # (xy; y fixed: its own problem's too)
    assert len(calls) >= steps, (len(calls), steps)
    for got, ref in zip(one, two, strict=True):
        assert rel(got, ref) < 1e-5
    for got, ref in zip(one, want, strict=True):
        assert rel(got, ref) < 1e-4


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
@pytest.mark.parametrize("presplit,d,reach", [(None, 3, None), (True, 3, None), (None, 8, None),
                                              (None, 3, 0.7)])  # fmt: skip
def test_a_self_problems_reverse_step_in_one_launch(presplit, d, reach):
    """A debiased loss's self problems (mirror replays) differentiate each step's transform
    in one launch (:meth:`TritonBackend.mirror_vjp`): the HVP of two reverse products a
    step, and of float64 on the torch backend; triples (d ≤ 5) split their values too;
    balanced or relaxed."""
    from flashot.backends.triton import TritonBackend

    x, y, a, b, v = problem(12, 10, d, 4, dtype=torch.float32)

    def hvp(backend, dtype=torch.float32):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.6, diameter=4.0, reach=reach,
                                   backend=backend)  # fmt: skip
        xs = x.to(dtype).requires_grad_()
        (g,) = torch.autograd.grad(loss(a.to(dtype), xs, b.to(dtype), y.to(dtype)), xs,
                                   create_graph=True)  # fmt: skip
        return g.detach(), torch.autograd.grad((g * v.to(dtype)).sum(), xs)[0]

    want = hvp("torch", torch.float64)
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        spy = TritonBackend.mirror_vjp
        mp.setattr(TritonBackend, "mirror_vjp", lambda *t: None)
        two = hvp(TritonBackend(presplit=presplit))
        mp.setattr(TritonBackend, "mirror_vjp", lambda *t: calls.append(1) or spy(*t))
        one = hvp(TritonBackend(presplit=presplit))
    assert len(calls) >= len(geomloss_schedule(4.0, 0.09, 0.6)) - 1
    for got, ref in zip(one, two, strict=True):
        assert rel(got, ref) < 1e-5
    for got, ref in zip(one, want, strict=True):
        assert rel(got, ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("d", [3, 64])
def test_one_launch_symmetric_reverse_natively(d):
    """``SYM_VJP`` on the GPU (split operands at d = 64, triples at d = 3, graphs
    captured): the HVP of two reverse products per step, and of float64."""
    from flashot.backends.triton import _configs

    x, y = cuda_clouds(3000, 2500, d)
    v = torch.randn_like(x)
    loss = flashot.SamplesLoss(blur=0.3, scaling=0.8, debias=False)
    ref = flashot.SamplesLoss(blur=0.3, scaling=0.8, debias=False, backend="torch")
    want = double_backward(lambda t: ref(t, y.double()), x.double(), v.double())[1]
    got = []
    with pytest.MonkeyPatch.context() as mp:
        # (each call solves anew: kept iterates would carry its rounding into the HVP)
        mp.setattr(replay, "_kept", lambda *t: None)
        for on in (False, True, True):  # (the second on: a captured replay)
            if on != _configs.SYM_VJP:  # (captures keep the launches they were made with)
                replay.REPLAY_GRAPHS.clear()
            mp.setattr(_configs, "SYM_VJP", on)
            got.append(double_backward(lambda t: loss(t, y), x, v)[1])
    assert rel(got[1], got[0]) < 1e-5 and rel(got[2], got[0]) < 1e-5
    assert rel(got[1], want) < 1e-3


def _second_derivatives(loss, x, y, a, w, v, u):
    """The HVP in x along v, and the weights' mixed derivative along u (a double
    backward of ⟨∇_x loss, v⟩ + ⟨∇_a loss, u⟩ in x and a)."""
    xs, as_ = x.clone().requires_grad_(), a.clone().requires_grad_()
    gx, ga = torch.autograd.grad(loss(as_, xs, w, y), (xs, as_), create_graph=True)
    return torch.autograd.grad((gx * v).sum() + (ga * u).sum(), (xs, as_))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(2, 9), m=st.integers(2, 9),
       d=st.integers(1, 4), reach=st.sampled_from([None, 0.8]),
       cost=st.sampled_from(["sqeuclidean", "cosine"]),
       scaling=st.sampled_from([0.5, 0.8]))  # fmt: skip
def test_a_self_problem_is_differentiated_as_a_mirror(seed, n, m, d, reach, cost, scaling):
    """A debiased loss's self problem OT(a, a) replays one transform and one reverse
    product per step and forms its envelope gradient's rows only (the mirror of
    flashot.autodiff.replay): its second derivatives in the points and the weights equal
    the two-sided ones (float64)."""
    x, y, a, b, v = problem(seed, n, m, d, dtype=torch.float64)
    u = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    extra = {} if cost == "sqeuclidean" else {"cost": cost}
    loss = flashot.SamplesLoss(blur=0.3, scaling=scaling, diameter=4.0, reach=reach,
                               backend="torch", **extra)  # fmt: skip
    calls = {"mirror": 0}
    mirrors = second_order.mirrors

    def counted(*t):
        got = mirrors(*t)
        calls["mirror"] += got
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(second_order, "mirrors", counted)
        one = _second_derivatives(loss, x, y, a, b, v, u)
        assert calls["mirror"] == 1  # (xx; y takes no gradient: no yy replay)
        mp.setattr(second_order, "mirrors", lambda *t: False)
        two = _second_derivatives(loss, x, y, a, b, v, u)
    for got, want in zip(one, two, strict=True):  # (cosine in 1-D: zero curvature)
        assert (got - want).norm() <= 1e-10 * want.norm() + 1e-14


@pytest.mark.gpu
@pytest.mark.parametrize("d", [3, 64])
def test_a_self_problem_is_a_mirror_natively(d):
    """The mirror on the GPU (Triton, graphs captured on the second call): GeomLoss'
    debiased call's HVP equals the two-sided one and float64's."""
    x, y = cuda_clouds(3000, 2500, d)
    v = torch.randn_like(x)
    loss = flashot.SamplesLoss(blur=0.1, scaling=0.7)
    ref = flashot.SamplesLoss(blur=0.1, scaling=0.7, backend="torch")
    want = double_backward(lambda t: ref(t, y.double()), x.double(), v.double())[1]
    got = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay, "_kept", lambda *t: None)  # (as in the test above)
        for on in (False, True, True):  # (the second on: a captured replay)
            if len(got) < 2:  # (captures keep the launches they were made with)
                replay.REPLAY_GRAPHS.clear()
            mp.setattr(second_order, "mirrors", replay.mirrors if on else lambda *t: False)
            got.append(double_backward(lambda t: loss(t, y), x, v)[1])
    assert rel(got[1], got[0]) < 1e-5 and rel(got[2], got[0]) < 1e-5
    assert rel(got[1], want) < 1e-3


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
def test_replayed_steps_from_stabilized_sums_give_the_same_second_derivatives():
    """With ``STABILIZED_LSE_FROM`` a replayed symmetric step's two LSEs come from a fused
    step's sums (stabilized by the solve's iterates): the HVP of the row passes', and of
    float64 on the torch backend."""
    from flashot.backends.triton import TritonBackend, _configs
    from flashot.backends.triton import backend as triton_backend

    x, y, a, b, v = problem(12, 10, 8, 3, dtype=torch.float32)

    def hvp(backend, dtype=torch.float32):
        loss = flashot.SamplesLoss(blur=0.2, scaling=0.6, diameter=4.0, backend=backend)
        return double_backward(lambda t: loss(a.to(dtype), t, b.to(dtype), y.to(dtype)),
                               x.to(dtype), v.to(dtype))[1]  # fmt: skip

    want = hvp("torch", torch.float64)
    inside, calls = [], []  # (fused steps taken inside potential_lse: the replay's)
    with pytest.MonkeyPatch.context() as mp:
        step, lse = triton_backend.fused_step, TritonBackend.potential_lse

        def spied_lse(self, pot, stabilized=False):
            inside.append(1)
            try:
                return lse(self, pot, stabilized)
            finally:
                inside.pop()

        mp.setattr(TritonBackend, "potential_lse", spied_lse)

        def spied_step(*t, **k):
            calls.extend(inside[:1])
            return step(*t, **k)

        mp.setattr(triton_backend, "fused_step", spied_step)
        mp.setattr(replay, "_kept", lambda *t: None)  # (the replay's own passes)
        plain = hvp(TritonBackend())
        assert not calls
        mp.setattr(_configs, "STABILIZED_LSE_FROM", 0)
        fused = hvp(TritonBackend())
    steps = len(geomloss_schedule(4.0, 0.04, 0.6))  # (xy; the self problem is a mirror)
    assert len(calls) >= steps - 1, (len(calls), steps)
    assert rel(fused, plain) < 1e-5 and rel(fused, want) < 1e-4


def _hvp_cut_and_whole(loss, x, v):
    """``(HVP with the tail checks, HVP over the whole sweep, steps where sweeps stopped)``."""
    stops: list[int] = []
    done = replay._Tail.done

    def recorded(self, grads):
        out = done(self, grads)
        if out:
            stops.append(self.steps)
        return out

    with mock.patch.object(replay._Tail, "done", recorded):
        cut = double_backward(loss, x, v)[1]
    with mock.patch.object(replay, "TAIL_TOL", {}):
        whole = double_backward(loss, x, v)[1]
    return cut, whole, stops


def test_the_peers_schedule_stops_its_reverse_sweep_a_third_early():
    """At the peer's HVP setting (blur 0.3, scaling 0.9, d = 64: 51 steps from ε = the
    diameter²) the first steps' shares of the HVP are small: an eager reverse sweep stops
    there (flashot.autodiff.replay._Tail). At the default ``hvp_tol`` (1e-3) the HVP
    moves by less than a twentieth of it (measured 1.5e-5; its float32 error against
    float64 is ~3e-5); with ``hvp_tol=1e-6`` the sweep runs longer and the HVP moves by
    less than 2^-18, float32's rounding."""
    x, y, _, _, v = problem(0, 300, 250, 64, dtype=torch.float32)
    both = torch.cat([x, y])
    diameter = float((both.amax(0) - both.amin(0)).norm())  # (GeomLoss' own)
    iterations = len(geomloss_schedule(diameter, 0.09, 0.9))
    out = {}
    for tol in (None, 1e-6):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, diameter=diameter,
                                   backend="torch", hvp_tol=tol)  # fmt: skip
        out[tol] = _hvp_cut_and_whole(lambda z, loss=loss: loss(z, y), x, v)
    (cut, whole, stops), (cut_tight, whole_tight, stops_tight) = out[None], out[1e-6]
    assert len(stops) == 1 and len(stops_tight) == 1
    assert stops[0] < stops_tight[0] <= 0.75 * iterations, (stops, stops_tight, iterations)
    assert rel(cut, whole) <= 1e-3 / 20 and rel(cut_tight, whole_tight) <= 2.0**-18


def test_a_packed_batch_runs_its_whole_sweep():
    """A packed batch's sweep runs to its start: one bound against the largest problem's
    gradients would leave a small problem beside it without its own relative accuracy
    (its single problem's sweep stops)."""
    x, y, _, _, v = problem(0, 200, 200, 64, dtype=torch.float32)
    loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, backend="torch")
    xb, yb, vb = (torch.stack([t, 0.01 * t]) for t in (x, y, v))
    _, _, single = _hvp_cut_and_whole(lambda z: loss(z, y), x, v)
    cut, whole, packed = _hvp_cut_and_whole(lambda z: loss(z, yb).sum(), xb, vb)
    assert len(single) == 1 and packed == []
    assert torch.equal(cut, whole)


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
def test_the_tail_stops_the_triton_sweep_alike():
    """The Triton backend's reverse sweep (its one-launch symmetric reverse products, in
    the interpreter: eager on the CPU) stops where the torch backend's does, with the
    HVP moved by less than a twentieth of the default ``hvp_tol`` (the backends' own HVPs
    differ by their precision)."""
    x, y, _, _, v = problem(0, 24, 20, 16, dtype=torch.float32)
    out = {}
    for backend in ("torch", "triton"):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, backend=backend)
        out[backend] = _hvp_cut_and_whole(lambda z, loss=loss: loss(z, y), x, v)
    (_, _, stops), (cut, whole, stops_t) = out["torch"], out["triton"]
    assert stops == stops_t and len(stops) == 1
    assert rel(cut, whole) <= 1e-3 / 20


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(8, 40), d=st.sampled_from([2, 8, 64]),
       blur=st.sampled_from([0.1, 0.3, 1.0]), scaling=st.sampled_from([0.5, 0.8, 0.9]),
       debias=st.booleans(), reach=st.sampled_from([None, 2.0]),
       update=st.sampled_from(["symmetric", "alternating"]),
       hvp_tol=st.sampled_from([None, 1e-6]))  # fmt: skip
@example(seed=0, n=8, d=8, blur=0.1, scaling=0.8, debias=False, reach=None, update="symmetric",
         hvp_tol=None)  # (the amplified cut of the docstring)  # fmt: skip
def test_a_sweep_cut_at_its_tail_moves_the_hvp_within_its_tolerance(
    seed, n, d, blur, scaling, debias, reach, update, hvp_tol
):
    """Wherever a reverse sweep stops at its tail (balanced or not, debiased self problems
    as mirrors, symmetric or alternating steps), the HVP it returns is within a twentieth
    of ``hvp_tol`` (the default 1e-3) of the whole sweep's, or 2^-18 (float32's rounding)
    with ``hvp_tol=1e-6``, or where the HVP is small against its terms, within the float32
    HVP's own error against float64 (the torch backend, eager): the tail's bound is
    against the largest θ gradient, as rounding is, and such an HVP amplifies both alike
    (blur 0.1 at d = 64 and 20 points: 5e-2 off in float32; 8 points at d = 8, blur 0.1,
    scaling 0.8: the cut moved it 2.4e-4, its float32 error 4.4e-4, the θ gradients'
    change 2.2e-6 of the largest, within the tail's 1e-5)."""
    x, y, a, b, v = problem(seed, n, n + 3, d, dtype=torch.float64)

    def value(dtype):
        if update == "symmetric":
            loss = flashot.SamplesLoss(blur=blur, scaling=scaling, debias=debias, reach=reach,
                                       backend="torch", hvp_tol=hvp_tol)  # fmt: skip
            return lambda z: loss(a.to(dtype), z, b.to(dtype), y.to(dtype))
        return lambda z: flashot.sinkhorn(z, y.to(dtype), a.to(dtype), b.to(dtype),
                                          eps=blur**2, tol=None, max_iter=30, rho=reach,
                                          backend="torch", hvp_tol=hvp_tol).cost  # fmt: skip

    x32, v32 = x.float(), v.float()
    cut, whole, _ = _hvp_cut_and_whole(value(torch.float32), x32, v32)
    exact = double_backward(value(torch.float64), x, v)[1]
    bound = 1e-3 / 20 if hvp_tol is None else 2.0**-18
    assert rel(cut, whole) <= max(bound, rel(whole.double(), exact))


@settings(max_examples=40, deadline=None)
@given(rho=st.floats(0.3, 0.99), first=st.floats(1e-3, 1e3), steps=st.integers(12, 80),
       weak=st.floats(1e-12, 1.0))  # fmt: skip
def test_the_tail_check_bounds_a_geometric_tail_and_waits_on_a_slow_one(rho, first, steps, weak):
    """Shares decaying by ρ a step (two θ gradients, the second ``weak`` times the first):
    where the check stops, what the steps left would add is within TAIL_TOL of the
    largest sum; a decay slower than TAIL_RATIO per check never stops; a fast one stops
    once its shares are that small."""
    tail = replay._Tail(torch.float32)
    grads: list = [None] * 6
    tol = replay.TAIL_TOL[torch.float32]
    stopped = None
    for k in range(steps):
        share = first * rho**k
        for i, s in ((0, share), (1, weak * share)):
            t = torch.full((3,), s, dtype=torch.float64)
            tail.record(i, t)
            grads[i] = t if grads[i] is None else grads[i] + t
        if tail.done(grads):
            stopped = k
            break
    if stopped is None:
        per_check = rho**replay.TAIL_EVERY
        checked = steps - steps % replay.TAIL_EVERY  # (the last check's step)
        left = first * rho**checked / (1 - rho)
        total = first / (1 - rho)
        assert per_check > replay.TAIL_RATIO or left > 0.5 * tol * total or steps < 16
        return
    assert rho**replay.TAIL_EVERY <= replay.TAIL_RATIO * (1 + 1e-9)
    left = first * rho ** (stopped + 1) / (1 - rho)  # (per element; the sums' norm alike)
    assert left <= tol * float(grads[0].norm()) / 3**0.5 * (1 + 1e-6)


def test_the_tail_check_never_stops_on_nan_or_an_unknown_dtype():
    """A non-finite share, or a dtype without a tolerance (float16 weights), runs the
    sweep to its start."""
    for dtype, value in ((torch.float32, float("nan")), (torch.float16, 1.0)):
        tail = replay._Tail(dtype)
        grads: list = [None] * 6
        for k in range(40):
            t = torch.full((2,), value * 0.1**k, dtype=torch.float32)
            tail.record(0, t)
            grads[0] = t if grads[0] is None else grads[0] + t
            assert not tail.done(grads)


def _replayed_stacks(value, x, v):
    """``(HVP, forward stacks per replay, replays from kept iterates)`` of a double backward.

    The stacks are those of each :class:`replay._Sweep` forward (f_K, g_K, F, G, R_x, R_y).
    """
    stacks: list = []
    forward, from_kept = replay._Sweep.forward, replay._Sweep._from_kept
    kept: list = []

    def spied(self, *t):
        out = forward(self, *t)
        stacks.append((self.trajectory, [s.clone() for s in out]))
        return out

    def spied_kept(self, *t):
        kept.append(1)
        return from_kept(self, *t)

    with mock.patch.object(replay._Sweep, "forward", spied), \
            mock.patch.object(replay._Sweep, "_from_kept", spied_kept):  # fmt: skip
        h = double_backward(value, x, v)[1]
    return h, stacks, len(kept)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(2, 12), d=st.integers(1, 5),
       entry=st.sampled_from(["loss", "batch", "sinkhorn", "warm start"]), debias=st.booleans(),
       reach=st.sampled_from([None, 0.8]), scaling=st.sampled_from([0.5, 0.9]))  # fmt: skip
def test_a_double_backward_reads_the_solves_own_iterates(seed, n, d, entry, debias, reach,
                                                         scaling):  # fmt: skip
    """A differentiable fixed-iteration solve keeps its iterates (within its memory
    bound) and the replay reads them instead of running the schedule again: each step's
    LSE solved from two iterates equals the one a pass returns, and the HVP is the
    replayed one (float64; balanced or not, debiased self problems, a packed batch, a
    warm start)."""
    x, y, a, b, v = problem(seed, n, n + 2, d, dtype=torch.float64)
    if entry == "batch":  # (one packed solve: its self problems ride in it)
        loss = flashot.SamplesLoss(blur=0.3, scaling=scaling, debias=debias, reach=reach,
                                   backend="torch")  # fmt: skip

        def value(z):
            return loss(torch.stack([z, 0.5 * z]), torch.stack([y, y + 1.0])).sum()
    elif entry == "loss":
        loss = flashot.SamplesLoss(blur=0.3, scaling=scaling, debias=debias, reach=reach,
                                   backend="torch")  # fmt: skip

        def value(z):
            return loss(a, z, b, y)
    else:
        init = (0.1 * torch.randn(n, dtype=torch.float64), torch.zeros(n + 2, dtype=torch.float64))

        def value(z):
            return flashot.sinkhorn(z, y, a, b, eps=0.09, tol=None, max_iter=12, rho=reach,
                                    update="symmetric", backend="torch",
                                    init=init if entry == "warm start" else None).cost  # fmt: skip

    try:
        got, kept_stacks, used = _replayed_stacks(value, x, v)
    except NotImplementedError as exc:  # (a relaxed batch above a problem's cost range)
        if entry != "batch" or "relaxed batch" not in str(exc):
            raise
        reject()
    with mock.patch.object(replay, "_kept", lambda *t: None):
        want, own_stacks, unused = _replayed_stacks(value, x, v)
    pieces = 1 + (entry == "loss" and debias)  # (y takes no gradient: no yy piece)
    assert used == pieces and unused == 0
    for (traj, kept), (_, own) in zip(kept_stacks, own_stacks, strict=True):
        assert traj.iterates is not None
        first = 0 if traj.init is None else 1  # (a warm start's r_0 is never read)
        for i, (s, t) in enumerate(zip(kept, own, strict=True)):
            s, t = (s[first:], t[first:]) if i >= 4 else (s, t)
            assert (s - t).abs().max() <= 1e-12 * (1 + t.abs().max()), i
    assert rel(got, want) <= 1e-11


@pytest.mark.parametrize("blur,d,held", [(0.05, 32, False), (0.3, 4, True)])
def test_kept_iterates_are_read_only_where_their_lses_hold(blur, d, held):
    """Float32 iterates are rounded at the potentials' scale: against a small ε and wide
    norms the LSEs they imply would move the HVP by ~1e-3 (the exact pass at the last
    step sees it, and the schedule runs again); where they hold (within cg_tol) they are
    read, and the HVP is the rerun one to that tolerance."""
    g = torch.Generator().manual_seed(3)
    x, y, v = (torch.randn(200, d, generator=g) for _ in range(3))
    loss = flashot.SamplesLoss(blur=blur, scaling=0.5, backend="torch")
    verdicts = []
    within = replay._Sweep.kept_within_tol

    def spied(self, *t):
        verdicts.append(within(self, *t))
        return verdicts[-1]

    with mock.patch.object(replay._Sweep, "kept_within_tol", spied):
        got = double_backward(lambda t: loss(t, y), x, v)[1]
    assert verdicts and (all(verdicts) if held else not verdicts[0])  # (xy, then xx's own)
    with mock.patch.object(replay, "_kept", lambda *t: None):
        want = double_backward(lambda t: loss(t, y), x, v)[1]
    assert rel(got, want) <= (1e-4 if held else 1e-7)
    if not held:  # (read anyway, they would have moved it by far more than cg_tol)
        with mock.patch.object(replay._Sweep, "kept_within_tol", lambda *t: True):
            assert rel(double_backward(lambda t: loss(t, y), x, v)[1], want) > 1e-4


def test_iterates_are_kept_only_for_a_differentiable_solve_within_their_bound():
    """No iterates without a gradient to take, under no_grad, or past both the byte bound
    and the clouds' size; a warm start or weights that take the gradient count."""
    from flashot.autodiff import unrolled
    from flashot.geometry.costs import attention_form, get_cost

    x, y, a, _, _ = problem(0, 50, 40, 3, dtype=torch.float32)
    xg, cost = x.clone().requires_grad_(), get_cost("sqeuclidean")
    clouds = attention_form(cost, xg, y, torch.float32, None, None)
    fixed = attention_form(cost, x, y, torch.float32, None, None)
    assert unrolled.keeps_iterates(clouds, 30)
    assert not unrolled.keeps_iterates(fixed, 30)
    assert unrolled.keeps_iterates(fixed, 30, a.clone().requires_grad_(), None)
    with torch.no_grad():
        assert not unrolled.keeps_iterates(clouds, 30)
    size = 31 * 90 * 4
    with mock.patch.object(unrolled, "KEEP_ITERATES_BYTES", size):
        assert unrolled.keeps_iterates(clouds, 30)
    with mock.patch.object(unrolled, "KEEP_ITERATES_BYTES", size - 1):
        assert not unrolled.keeps_iterates(clouds, 30)  # (the clouds: 90 × 5 × 4 bytes)
        assert unrolled.keeps_iterates(clouds, 3)


@pytest.mark.parametrize("seed,reach", [(0, None), (1, 0.8), (5, 0.8)])
def test_iterates_kept_in_float32_give_the_replays_accuracy(seed, reach):
    """Float32 (torch backend): the LSEs solved from the kept iterates are within 16 ulp
    of their scale of the passes' (dividing by a small λ of an unbalanced step's warm-up
    scales both alike), and the HVP is as near float64's as the replayed one."""
    x, y, a, b, v = problem(seed, 30, 32, 4, dtype=torch.float32)

    def value(dtype):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, reach=reach, backend="torch")
        return lambda z: loss(a.to(dtype), z, b.to(dtype), y.to(dtype))

    got, kept_stacks, used = _replayed_stacks(value(torch.float32), x, v)
    with mock.patch.object(replay, "_kept", lambda *t: None):
        want, own_stacks, _ = _replayed_stacks(value(torch.float32), x, v)
    exact = double_backward(value(torch.float64), x.double(), v.double())[1]
    assert used == 2
    for (_, kept), (_, own) in zip(kept_stacks, own_stacks, strict=True):
        for i, (s, t) in enumerate(zip(kept, own, strict=True)):
            ulps = 16 if i >= 4 else 2
            assert float((s - t).abs().max()) <= ulps * 2.0**-24 * float(t.abs().max()), i
    assert rel(got, exact) <= 1.25 * rel(want, exact) + 2.0**-21


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
def test_the_triton_solves_iterates_give_the_replayed_hvp():
    """The Triton backend's fused steps (the interpreter) keep iterates from which the HVP
    is as near float64's (torch backend) as the replayed one: the two paths' iterates
    differ by their rounding at the warm-up temperatures, each consistent with itself."""
    x, y, a, b, v = problem(3, 20, 16, 8, dtype=torch.float32)
    loss = flashot.SamplesLoss(blur=0.3, scaling=0.8, debias=True, backend="triton")
    got, _, used = _replayed_stacks(lambda z: loss(a, z, b, y), x, v)
    with mock.patch.object(replay, "_kept", lambda *t: None):
        want, _, _ = _replayed_stacks(lambda z: loss(a, z, b, y), x, v)
    ref = flashot.SamplesLoss(blur=0.3, scaling=0.8, debias=True, backend="torch")
    exact = double_backward(lambda z: ref(a.double(), z, b.double(), y.double()), x.double(),
                            v.double())[1]  # fmt: skip
    assert used == 2
    # (2^-16: float32 rounding of the two paths, which moves with the machine's numpy; a
    # step's iterates read at the wrong temperature are off by 1e-3 and more)
    assert rel(got, exact) <= 1.25 * rel(want, exact) + 2.0**-16
