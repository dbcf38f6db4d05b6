"""The one-pass step (``ONE_PASS_FROM_D``, :mod:`flashot.backends.triton._one_pass`): row
and column LSEs from the same score tiles, two exps per score, no gate and no repair.
Run in Triton's interpreter on CPU (the threshold lowered to these small d) and natively
on a GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.backends.dual import Potentials, log_residual
from flashot.backends.near import is_near_uniform
from flashot.backends.torch_backend import TorchBackend
from flashot.geometry.costs import attention_form, get_cost
from tests.conftest import clouds, rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


@pytest.fixture
def one_pass(monkeypatch):
    """Every step one pass (d ≥ 1); records which steps took it and which fell back (over
    the partials' budget)."""
    from flashot.backends.triton import _step

    monkeypatch.setattr(_step, "ONE_PASS_FROM_D", 1)
    taken = []
    exact = _step.exact_lse

    def spy(*args, **kw):
        out = exact(*args, **kw)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(_step, "exact_lse", spy)
    return taken


def _far_step(gen, n=45, m=38, d=5, eps=0.05):
    """Potentials far from each other's transforms: |ln R| in the hundreds (no fused
    window holds them), weights spread over two decades, y shifted."""
    x, y = clouds(gen, n, m, d, dtype=torch.float64)
    y = y + 0.5
    la = torch.log(torch.rand(n, generator=gen, dtype=torch.float64) * 10 + 0.1)
    lb = torch.log(torch.rand(m, generator=gen, dtype=torch.float64) * 10 + 0.1)
    la, lb = la - la.logsumexp(0), lb - lb.logsumexp(0)
    f = 4.0 * torch.randn(n, generator=gen, dtype=torch.float64)
    g = 4.0 * torch.randn(m, generator=gen, dtype=torch.float64)
    return x, y, f, g, la, lb, eps


def _forms(x, y):
    cost = get_cost("sqeuclidean")
    return (attention_form(cost, x, y).detach(),
            attention_form(cost, x.float().to(DEVICE), y.float().to(DEVICE)).detach())  # fmt: skip


@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("rho", [(None, None), (0.5, None)])
def test_one_pass_step_matches_the_float64_step(gen, one_pass, splits, rho):
    """A Jacobi step, an extrapolation and the marginals from far potentials (|ln R| up to
    ~10^3: the fused pass would be gated off) equal float64's to float32 accuracy."""
    from flashot.backends.triton import TritonBackend

    x, y, f, g, la, lb, eps = _far_step(gen)
    ref_form, form = _forms(x, y)
    be, ref = TritonBackend(splits=splits), TorchBackend()
    args32 = [t.float().to(DEVICE) for t in (f, g, la, lb)]
    lam = tuple(1.0 if r is None else r / (r + eps) for r in rho)
    state = be.fast_state(form.q.device)
    ours = be.jacobi_step(Potentials(form, *args32, eps), lam, rho, check=True, state=state)
    want = ref.jacobi_step(Potentials(ref_form, f, g, la, lb, eps), lam, rho, check=True)
    # the new potentials move by ε·|ln R| ≈ 50: compare to float32's rounding of that
    for o, w in zip(ours[:2], want[:2], strict=True):
        assert (o.double().cpu() - w).abs().max() < 64 * 2.0**-24 * float(w.abs().max() + 50)
    if float(want[2]) < 1e30:  # (the update's float32 terms a·e^{ln R} overflow past e^88)
        assert float(ours[2]) == pytest.approx(float(want[2]), rel=1e-4)
    ours = be.extrapolate(Potentials(form, *args32, eps), (0.9, 0.8))
    want = ref.extrapolate(Potentials(ref_form, f, g, la, lb, eps), (0.9, 0.8))
    for o, w in zip(ours, want, strict=True):
        assert (o.double().cpu() - w).abs().max() < 64 * 2.0**-24 * float(w.abs().max() + 50)
    near = [t.clone() for t in args32]  # close to the fixed point: marginals within range
    res = flashot.sinkhorn(x, y, la.exp(), lb.exp(), eps=0.3, tol=1e-9, backend="torch")
    near[0], near[1] = res.f.float().to(DEVICE), res.g.float().to(DEVICE)
    ours = be.marginals(Potentials(form, *near, 0.3))
    want = ref.marginals(Potentials(ref_form, res.f, res.g, la, lb, 0.3))
    assert rel(ours[0].double().cpu(), want[0]) < 2e-5
    assert rel(ours[1].double().cpu(), want[1]) < 2e-5
    assert one_pass and all(one_pass)


def test_one_pass_step_records_its_residual_range_for_the_gate(gen, one_pass):
    """The update still writes the step's largest ln R and −ln R into the next slot (a
    later fused step of another width reads it); the slot was cleared first."""
    from flashot.backends.triton import TritonBackend

    x, y, f, g, la, lb, eps = _far_step(gen)
    ref_form, form = _forms(x, y)
    be = TritonBackend()
    state = be.fast_state(form.q.device)
    state.slots.fill_(1e30)  # stale values that a missing clear would keep
    args32 = [t.float().to(DEVICE) for t in (f, g, la, lb)]
    be.jacobi_step(Potentials(form, *args32, eps), (1.0, 1.0), (None, None), state=state)
    lse_r, lse_c = TorchBackend().potential_lse(Potentials(ref_form, f, g, la, lb, eps))
    logs = torch.cat([log_residual(f, lse_r, ref_form.alpha, eps),
                      log_residual(g, lse_c, ref_form.beta, eps)])  # fmt: skip
    want = [max(0.0, float(logs.max())), max(0.0, float(-logs.min()))]
    written = state.slots[2 * state.parity : 2 * state.parity + 2].tolist()
    assert written == pytest.approx(want, rel=1e-5)
    assert max(want) > 200  # far from any fused window


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 70),
    m=st.integers(1, 70),
    d=st.integers(1, 9),
    log_eps=st.floats(-3.0, 1.0),
    update=st.sampled_from(["symmetric", "alternating"]),
)
@pytest.mark.slow
def test_one_pass_solves_equal_float64(n, m, d, log_eps, update):
    """Fixed-iteration solves (ε from 10^-3 to 10 of clouds ~2d apart) on the one-pass
    steps equal the float64 torch solve to float32 accuracy on the cost."""
    from flashot.backends.triton import _step

    gen = torch.Generator().manual_seed(n * 1000 + m * 10 + d)
    x, y = clouds(gen, n, m, d, dtype=torch.float64)
    kw = dict(eps=10.0**log_eps, tol=None, max_iter=12, update=update)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    old = _step.ONE_PASS_FROM_D
    _step.ONE_PASS_FROM_D = 1
    try:
        res = flashot.sinkhorn(x.float().to(DEVICE), y.float().to(DEVICE), backend="triton", **kw)
    finally:
        _step.ONE_PASS_FROM_D = old
    scale = float((torch.cdist(x, y) ** 2).max() / 2 + ref.cost.abs())
    assert abs(float(res.cost) - float(ref.cost)) < 2e-6 * scale


def test_partials_past_their_budget_take_the_two_pass_step(gen, one_pass, monkeypatch):
    """Column partials are (n / BLOCK_M)·m pairs: above the budget (here: any) the step
    falls back to the fused pass and its repair, with the same result."""
    from flashot.backends import triton as backend

    x, y, f, g, la, lb, eps = _far_step(gen)
    _, form = _forms(x, y)
    args32 = [t.float().to(DEVICE) for t in (f, g, la, lb)]
    be = backend.TritonBackend()
    one = be.jacobi_step(Potentials(form, *args32, eps), (1.0, 1.0), (None, None))
    from flashot.backends.triton import _one_pass

    monkeypatch.setattr(_one_pass, "partials_budget", lambda n, m, d: 0)
    two = be.jacobi_step(Potentials(form, *args32, eps), (1.0, 1.0), (None, None))
    assert one_pass == [True, False]
    assert rel(one[0], two[0]) < 1e-5 and rel(one[1], two[1]) < 1e-5


@pytest.mark.parametrize(
    "d, options, expected",
    [(5, {}, False), (6, {}, True), (6, {"precision": "tf32"}, False),
     (6, {"fused": False}, False)],
)  # fmt: skip
def test_the_default_takes_the_one_pass_from_its_width_in_fp32_only(gen, one_pass, monkeypatch, d,
                                                                    options, expected):  # fmt: skip
    """From ``ONE_PASS_FROM_D`` features (here 6), in "fp32" with the fused kernel on, every
    step is one pass; narrower clouds, one-MMA precisions (tf32, bf16: exps bound there)
    and ``fused=False`` (two exact passes asked for) keep the fused/two-pass path."""
    from flashot.backends import triton as backend
    from flashot.backends.triton import _step

    monkeypatch.setattr(_step, "ONE_PASS_FROM_D", 6)
    x, y = clouds(gen, 40, 33, d, dtype=torch.float32)
    be = backend.TritonBackend(**options)
    flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), eps=0.1, tol=None, max_iter=4, backend=be)
    assert one_pass == ([True] * len(one_pass) if expected else [])
    assert len(one_pass) >= (4 if expected else 0)


@pytest.mark.parametrize("spare", [0, -1])
def test_row_partials_take_one_float_per_row_and_column_block(gen, one_pass, monkeypatch, spare):
    """A row partial is the block's base-2 LSE, one float (a (max, sum) pair took twice the
    memory, so 50k d256 and 100k d512 exceeded the budget): a budget of exactly
    4·⌈m / BLOCK_N⌉·n bytes takes the one pass, one byte less falls back."""
    from flashot.backends import triton as backend
    from flashot.backends.triton import _launch, _one_pass

    x, y, f, g, la, lb, eps = _far_step(gen)
    _, form = _forms(x, y)
    be = backend.TritonBackend()
    op = _one_pass.ExactLaunch(
        be, Potentials(form, *(t.float().to(DEVICE) for t in (f, g, la, lb)), eps)
    )
    block_n = _launch.table_tiles(op.key[:-1], op.nb, op.mb, op.device, False).kwargs["BLOCK_N"]
    need = 4 * -(-op.m // block_n) * op.n
    monkeypatch.setattr(_one_pass, "partials_budget", lambda n, m, d: need + spare)
    args32 = [t.float().to(DEVICE) for t in (f, g, la, lb)]
    be.jacobi_step(Potentials(form, *args32, eps), (1.0, 1.0), (None, None))
    assert one_pass == [spare == 0]


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 60), m=st.integers(1, 60), d=st.integers(1, 70),
       log_eps=st.floats(-2.5, 0.5), spread=st.floats(0.0, 6.0),
       precision=st.sampled_from(["fp32", "bf16"]))  # fmt: skip
def test_potential_lse_is_one_exact_pass_in_fp32(n, m, d, log_eps, spread, precision):
    """``TritonBackend.potential_lse`` (a solve's first step, a replayed schedule's steps):
    both LSEs equal float64's at any potentials (far ones included: no window), from one
    pass in "fp32" and two row passes otherwise, or with ``ONE_PASS_LSE`` off."""
    from flashot.backends.triton import TritonBackend, _configs, _one_pass, backend

    gen = torch.Generator().manual_seed(n * 7919 + m * 31 + d)
    x, y = clouds(gen, n, m, d, dtype=torch.float64)
    f, g = (spread * torch.randn(s, generator=gen, dtype=torch.float64) for s in (n, m))
    la, lb = (torch.log(torch.rand(s, generator=gen, dtype=torch.float64) + 0.05)
              for s in (n, m))  # fmt: skip
    eps = 10.0**log_eps * d
    ref_form, form = _forms(x, y)
    want = TorchBackend().potential_lse(Potentials(ref_form, f, g, la, lb, eps))
    args32 = [t.float().to(DEVICE) for t in (f, g, la, lb)]
    for enabled in (True, False):
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_configs, "ONE_PASS_LSE", enabled)
            spy = lambda *a, calls=calls: calls.append(1) or _one_pass.exact_lse(*a)  # noqa: E731
            mp.setattr(backend, "exact_lse", spy)
            got = TritonBackend(precision=precision).potential_lse(Potentials(form, *args32, eps))
        near = is_near_uniform(form, eps)  # (ε above the cost's range: the near path)
        assert len(calls) == (enabled and precision == "fp32" and not near)
        for o, w in zip(got, want, strict=True):  # LSEs of scores up to ~|q||k|: their rounding
            scale = float(w.abs().max()) + float(ref_form.q.norm(dim=1).max() ** 2) + 1.0
            tol = 64 * 2.0**-24 if precision == "fp32" else 2.0**-6
            assert (o.double().cpu() - w).abs().max() < tol * scale


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 60), m=st.integers(1, 60), d=st.integers(1, 20),
       log_eps=st.floats(-2.5, 0.5), spread=st.floats(0.0, 6.0), steps=st.integers(0, 4),
       precision=st.sampled_from(["fp32", "bf16"]))  # fmt: skip
def test_stabilized_potential_lse_is_a_fused_step(n, m, d, log_eps, spread, steps, precision):
    """``potential_lse(stabilized=True)`` (a replayed step) from ``STABILIZED_LSE_FROM``
    score elements: a fused step's sums, one exponential a score for both sides, rows out
    of the window recomputed. Both LSEs equal float64's at far potentials (repaired) and
    at a solve's iterates, as the row passes' do."""
    from flashot.backends.triton import TritonBackend, _configs, backend

    gen = torch.Generator().manual_seed(n * 7919 + m * 31 + d + 101 * steps)
    x, y = clouds(gen, n, m, d, dtype=torch.float64)
    la, lb = (torch.log(torch.rand(s, generator=gen, dtype=torch.float64) + 0.05)
              for s in (n, m))  # fmt: skip
    eps = 10.0**log_eps * d
    ref_form, form = _forms(x, y)
    ref = TorchBackend()
    f, g = (spread * torch.randn(s, generator=gen, dtype=torch.float64) for s in (n, m))
    for _ in range(steps):  # (a solve's iterates: near the step's fixed point)
        f, g, _ = ref.jacobi_step(Potentials(ref_form, f, g, la, lb, eps), (1.0, 1.0),
                                  (None, None))  # fmt: skip
    want = ref.potential_lse(Potentials(ref_form, f, g, la, lb, eps))
    args32 = [t.float().to(DEVICE) for t in (f, g, la, lb)]
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_configs, "STABILIZED_LSE_FROM", 0)
        step = backend.fused_step
        mp.setattr(backend, "fused_step", lambda *a, **k: calls.append(1) or step(*a, **k))
        be = TritonBackend(precision=precision)
        got = be.potential_lse(Potentials(form, *args32, eps), stabilized=True)
        plain = be.potential_lse(Potentials(form, *args32, eps))
    assert len(calls) == (not is_near_uniform(form, eps))
    for o, p, w in zip(got, plain, want, strict=True):
        scale = float(w.abs().max()) + float(ref_form.q.norm(dim=1).max() ** 2) + 1.0
        tol = 64 * 2.0**-24 if precision == "fp32" else 2.0**-6
        assert (o.double().cpu() - w).abs().max() < tol * scale
        assert (o - p).abs().max() < tol * scale
