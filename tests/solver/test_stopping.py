"""Stopping: a solve stops early only at the dtype's precision floor, and a miss names its
cause truthfully. Checked on the reported cases and as a property over random problems."""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashot
from flashot import ConvergenceWarning
from flashot.backends import available_backends
from flashot.solver.stopping import FloorTolerance
from tests.references import dense_cost, entropic_ot

F64 = torch.float64


def d0():
    torch.manual_seed(0)
    return torch.randn(20, 3).double(), torch.randn(15, 3).double()


def solve(*args, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = flashot.sinkhorn(*args, **kw)
    misses = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    return res, misses


def test_reported_plateau_runs_on_to_the_right_value():
    # was: stopped at iteration 300 (error 3.3e-2), "at the precision floor of float64"
    x, y = d0()
    a, b = torch.full((20,), 1 / 20, dtype=F64), torch.full((15,), 1 / 15, dtype=F64)
    ref = float(entropic_ot(x, y, a, b, 0.1))
    res, misses = solve(x, y, eps=0.1, max_iter=5000)
    assert res.converged and not misses
    assert abs(float(res.cost) - ref) <= 1e-8 * abs(ref)
    C = dense_cost(x, y)
    pot = pytest.importorskip("ot")
    plan = pot.sinkhorn(a.numpy(), b.numpy(), C.numpy(), 0.1, method="sinkhorn_log",
                        stopThr=1e-12, numItermax=100000)  # fmt: skip
    assert float(res.transport_cost) == pytest.approx(float((plan * C.numpy()).sum()), rel=1e-6)


def test_a_short_budget_says_max_iter_not_precision():
    x, y = d0()
    res, misses = solve(x, y, eps=0.1, max_iter=1000, update="symmetric")
    assert not res.converged and res.n_iter == 1000
    assert len(misses) == 1 and "max_iter was not enough" in misses[0]
    assert "precision" not in misses[0]


def test_float32_stall_at_the_floor_is_named_and_true():
    x, y = d0()
    x, y = x.float(), y.float()
    res, misses = solve(x, y, eps=0.1, tol=1e-9, max_iter=20000, update="alternating")
    assert not res.converged and res.n_iter < 20000  # stopped early: at the floor
    assert len(misses) == 1 and ("precision floor" in misses[0] or "too small" in misses[0])
    more, _ = solve(x, y, eps=0.1, tol=1e-9, max_iter=5000, update="alternating",
                    init=(res.f, res.g))  # fmt: skip
    assert not more.converged


def test_tiny_eps_in_float32_says_eps_is_too_small():
    x, y = d0()
    res, misses = solve(x.float(), y.float(), eps=1e-4, tol=1e-6, max_iter=20000,
                        update="alternating")  # fmt: skip
    assert not res.converged and len(misses) == 1
    assert "precision floor" in misses[0] or "eps is too small" in misses[0]


@st.composite
def problems(draw, dtype=F64, max_n=60):
    n, m = draw(st.integers(2, max_n)), draw(st.integers(2, max_n))
    d = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(m, d, generator=gen, dtype=F64) * draw(st.floats(0.3, 2)) + draw(
        st.floats(0, 2)
    )
    a = torch.rand(n, generator=gen, dtype=F64) + 0.05
    b = torch.rand(m, generator=gen, dtype=F64) + 0.05
    mean_cost = float(dense_cost(x, y).mean())
    eps = mean_cost * 10 ** draw(st.floats(-3, 3))
    rho = draw(st.sampled_from([None, None, "small", "large"]))
    rho = None if rho is None else mean_cost * (0.5 if rho == "small" else 50.0)
    if rho is None:
        a, b = a / a.sum(), b / b.sum()
    update = draw(st.sampled_from(["symmetric", "alternating"]))
    return x.to(dtype), y.to(dtype), a.to(dtype), b.to(dtype), eps, rho, update


def check_truthful(x, y, a, b, eps, rho, update, rtol, backend="torch", max_iter=1000,
                   more_iter=2000):  # fmt: skip
    """Converged and right, or a miss whose named cause holds."""
    res, misses = solve(x, y, a, b, eps=eps, rho=rho, update=update, max_iter=max_iter,
                        backend=backend)  # fmt: skip
    if res.converged:
        assert not misses
        rhos = (rho, rho)
        x64, y64, a64, b64 = x.double(), y.double(), a.double(), b.double()
        if rho is None:  # float32 weights' sums differ by ~1e-8: no balanced plan meets both
            a64, b64 = a64 / a64.sum(), b64 / b64.sum()  # (and the reference ran 200 000 its)
        ref = float(entropic_ot(x64, y64, a64, b64, eps, rho=rhos, init_g=res.g.double(),
                                max_iter=200_000))  # fmt: skip
        assert abs(float(res.cost) - ref) <= rtol * max(abs(ref), 1e-300)
        return "converged"
    assert len(misses) == 1
    text = misses[0]
    if "precision floor" in text or "too small" in text:
        # true only if more iterations of the same update do not reach tol
        more, _ = solve(x, y, a, b, eps=eps, rho=rho, update=update, max_iter=more_iter,
                        init=(res.f, res.g), tol=1e-6 / 4, backend=backend)  # fmt: skip
        assert not more.converged, text
        return "floor"
    if "after the final" in text:  # the loop met tol; the last measurement is above it
        # "auto" accepts up to SLACK × 1e-6 at the floor; the final step may add a little
        # (a float32 draw on the kernels: 1.13e-5 after a loop that met 1e-5)
        assert res.marginal_error <= 2 * FloorTolerance.SLACK * 1e-6
        return "final"
    assert "max_iter was not enough" in text or "oscillates" in text or "has not changed" in text
    assert res.n_iter == max_iter  # never an early stop without a floor
    return "max_iter"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_never_a_converged_wrong_answer_float64(problem):
    check_truthful(*problem, rtol=1e-8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(dtype=torch.float32))
def test_never_a_converged_wrong_answer_float32(problem):
    check_truthful(*problem, rtol=2e-5)


@pytest.mark.skipif("triton" not in available_backends("cpu"), reason="needs triton's interpreter")
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(dtype=torch.float32, max_n=16))
def test_never_a_converged_wrong_answer_on_the_kernels(problem):
    # the interpreter takes ~0.1 s per iteration: small caps keep a slow draw (hypothesis'
    # examples change with its version) within CI's budget; truthfulness holds at any cap
    check_truthful(*problem, rtol=2e-5, backend="triton", max_iter=100, more_iter=200)


@pytest.mark.parametrize(
    "errors, cause",
    [
        ([0.7646330013, 0.7646330009, 0.7646330014, 0.7646330005] * 2, "no_progress"),
        ([0.30, 0.36, 0.31, 0.37, 0.30, 0.36, 0.31, 0.37], "oscillation"),
        ([0.5, 0.45, 0.41, 0.37, 0.34, 0.31, 0.29, 0.27], "max_iter"),
    ],
)
def test_a_miss_at_max_iter_is_named_from_the_last_errors(errors, cause):
    from flashot.solver.stopping import _Stopping

    stop = _Stopping(1e-6, floor=lambda: 1e-12)
    for it, e in enumerate([1.0, *errors]):
        assert not stop.done(e, it)
    stop.finish()
    assert stop.cause == cause


def test_an_oscillation_miss_still_suggests_more_iterations():
    # seen: n = 100, eps = 0.05 with a schedule needed 2057 alternating iterations, and
    # the miss at 1000 read as an oscillation whose advice left max_iter out
    from flashot.solver.stopping import describe_miss

    text = describe_miss("oscillation", 1e-6, 7e-5, None, 1000, torch.float32, "alternating")
    assert "oscillates" in text and "increase max_iter" in text and "update='symmetric'" in text


def test_a_self_problem_is_recognized_a_block_of_rows_at_a_time(monkeypatch):
    """Same points (one storage, or equal copies compared a block of rows at a time:
    no boolean copy of the cloud), same weights and ρ: a self problem; one differing
    entry in the last block, other weights or another ρ: not one."""
    import flashot.geometry.costs
    from flashot.problem import make_problem
    from flashot.solver.stopping import _is_self_problem

    monkeypatch.setattr(flashot.geometry.costs, "_BLOCK", 12)  # 4 rows of 3 per block
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 3, generator=g, dtype=torch.float64)
    copy = x.clone()
    assert _is_self_problem(make_problem(x, x, eps=1.0))
    assert _is_self_problem(make_problem(x, copy, eps=1.0))
    copy[9, 2] += 1e-12
    assert not _is_self_problem(make_problem(x, copy, eps=1.0))
    b = torch.rand(10, generator=g, dtype=torch.float64) + 0.5
    assert not _is_self_problem(make_problem(x, x, None, b / b.sum(), eps=1.0))
    assert not _is_self_problem(make_problem(x, x, eps=1.0, rho=(1.0, 2.0)))


@given(n_temps=st.integers(1, 30), check_every=st.integers(1, 12), it=st.integers(1, 400))
def test_one_check_schedule(n_temps, check_every, it):
    """The rule every loop follows (solver, self problems, replayed schedules, the sharded
    solve): checks every check_every iterations at the final ε, counted from its first."""
    from flashot.solver.stopping import CheckSchedule

    s, last = CheckSchedule(n_temps, check_every), n_temps - 1
    grid = [j for j in range(1, 401) if s.on_grid(j)]
    assert grid == list(range(last + check_every, 401, check_every))
    assert s.on_grid(it) == (it - 1 >= last and (it - last) % check_every == 0)
    assert s.before(it) == (it >= last and (it + 1 - last) % check_every == 0)
    assert s.in_warmup(it) == (it - 1 < last and it % check_every == 0)


@pytest.mark.parametrize("tol", ["auto", 1e-6])
def test_a_stall_under_the_floor_ends_after_a_few_flat_checks(tol):
    # v49: OTDD's self problems sat at 0.3-0.45 of the floor from their 24th iteration and
    # ran to the 104th, eight flat checks later
    from flashot.solver.stopping import AT_FLOOR_PATIENCE, _Stopping, resolve_stopping

    tol, _ = resolve_stopping(tol, "symmetric")
    stop = _Stopping(tol, floor=lambda: 3.4e-6)
    errors = [1.5e-6, 1.1e-6] + [1.3e-6, 1.26e-6, 1.2e-6, 1.34e-6] * 3
    ends = [stop.done(e, it) for it, e in enumerate(errors)]
    assert ends.index(True) == 1 + AT_FLOOR_PATIENCE <= 3
    if type(tol) is float:  # a plain tol: a miss at the floor, named
        assert stop.converged is False and stop.cause == "precision_floor"
    else:  # "auto": the floor within its slack is convergence
        assert stop.converged is True and stop.cause is None


def test_a_stall_above_the_floor_goes_on():
    from flashot.solver.stopping import _Stopping

    stop = _Stopping(1e-6, floor=lambda: 1e-9)
    errors = [1.5e-4] + [1.6e-4, 1.55e-4] * 20
    assert not any(stop.done(e, it) for it, e in enumerate(errors))
    stop.finish()
    assert stop.converged is False and stop.cause is not None
