"""Both soft-minima of a symmetric step from one window pass (backends/triton/_pair_sums.py)
against float64 PyTorch tiles: any stabilizer (inside the window, or so far off that every
row needs the exact repair), self problems, tails; and where the solver takes it. In
Triton's interpreter on CPU, natively on a GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends import available_backends
from flashot.backends.kernel_sums import cost_of, softmin, window_step
from tests.conftest import nan_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def _problem(seed, n, m, d, empty=False):
    """Clouds and log-weights; ``empty``: some points of zero weight (−∞), not all."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g) + 1.0, torch.randn(m, d, generator=g)
    la = torch.log_softmax(torch.randn(n, generator=g), 0)
    lb = torch.log_softmax(torch.randn(m, generator=g), 0)
    if empty:
        la[1::3], lb[::4] = -float("inf"), -float("inf")
        la[0], lb[-1] = 0.0, 0.0
    return x, y, la, lb, g


def _ref(x, y, lw, eps, cost):
    return softmin(x.double(), y.double(), lw.double(), eps, cost, backend="torch")


def _close(got, ref, pots):
    """Float32 accuracy of a soft-minimum: relative to the largest |value| involved."""
    size = max(float(ref.abs().max()), *(float(p.abs().max()) for p in pots), 1.0)
    return float((got.double().cpu() - ref).abs().max()) <= 2e-6 * size


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 45), m=st.integers(1, 45),
       d=st.sampled_from([1, 3, 8, 20]), eps=st.sampled_from([0.05, 0.3, 2.0]),
       offset=st.sampled_from([0.0, 0.5, 200.0]), p=st.sampled_from([1, 2]),
       empty=st.booleans())  # fmt: skip
def test_both_sides_match_two_exact_soft_minima(seed, n, m, d, eps, offset, p, empty):
    """``window_step`` gives softmin(x, y, lb + g/ε) and softmin(y, x, la + f/ε) to
    float32 accuracy for any stabilizers: the converged potentials, a perturbation, or an
    offset so large that no row's sum fits the window (all repaired exactly); with
    points of zero weight too."""
    x, y, la, lb, g = _problem(seed, n, m, d, empty)
    cost = cost_of(p)
    f0 = _ref(x, y, lb, eps, cost).float()
    g0 = _ref(y, x, la, eps, cost).float()
    f = f0 + offset * torch.randn(n, generator=g).abs()
    gg = g0 - offset * torch.randn(m, generator=g).abs()
    got_f, got_g = window_step(x.to(DEVICE), y.to(DEVICE), la.to(DEVICE), lb.to(DEVICE),
                               f.to(DEVICE), gg.to(DEVICE), eps, cost, "triton")  # fmt: skip
    assert _close(got_f, _ref(x, y, lb + gg / eps, eps, cost), (f, gg))
    assert _close(got_g, _ref(y, x, la + f / eps, eps, cost), (f, gg))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 50), d=st.sampled_from([2, 3, 20]),
       offset=st.sampled_from([0.0, 100.0]))  # fmt: skip
def test_a_self_problem_streams_half_and_matches(seed, n, d, offset):
    """x against x with one potential: the columns' sums alone give the rows' soft-minimum
    (the cost is symmetric), returned twice."""
    x, _, la, _, g = _problem(seed, n, 1, d)
    cost = cost_of(1)
    f = _ref(x, x, la, 0.3, cost).float() + offset * torch.rand(n, generator=g)
    xd, lad, fd = x.to(DEVICE), la.to(DEVICE), f.to(DEVICE)
    a, b = window_step(xd, xd, lad, lad, fd, fd, 0.3, cost, "triton")
    assert a is b
    assert _close(a, _ref(x, x, la + f / 0.3, 0.3, cost), (f,))


def test_rows_past_the_tail_are_not_read():
    """NaN rows stored after the clouds' last rows change nothing."""
    x, y, la, lb, _ = _problem(3, 37, 21, 20)
    cost = cost_of(1)
    f, g = _ref(x, y, lb, 0.3, cost).float(), _ref(y, x, la, 0.3, cost).float()
    xs, ys = nan_rows(x.to(DEVICE)), nan_rows(y.to(DEVICE))
    got = window_step(xs, ys, la.to(DEVICE), lb.to(DEVICE), f.to(DEVICE), g.to(DEVICE), 0.3,
                      cost, "triton")  # fmt: skip
    assert _close(got[0], _ref(x, y, lb + g / 0.3, 0.3, cost), (f, g))
    assert _close(got[1], _ref(y, x, la + f / 0.3, 0.3, cost), (f, g))


def test_window_step_declines_where_it_does_not_apply():
    """None (the caller takes exact soft-minima) for the torch backend, a plain callable,
    float64, inputs needing gradients, and deterministic algorithms."""
    x, y, la, lb, _ = _problem(4, 6, 5, 3)
    f, g = torch.zeros(6), torch.zeros(5)
    args = (la, lb, f, g, 0.3)
    assert window_step(x, y, *args, cost_of(1), "torch") is None
    assert window_step(x, y, *args, lambda a, b: torch.cdist(a, b), "triton") is None
    assert window_step(x.double(), y.double(), *args, cost_of(1), "triton") is None
    assert window_step(x.requires_grad_(), y, *args, cost_of(1), "triton") is None
    x = x.detach()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert window_step(x, y, *args, cost_of(1), "triton") is None
    if DEVICE == "cpu":
        assert window_step(x, y, *args, cost_of(1), "triton") is not None


def test_the_schedule_takes_the_window_pass(monkeypatch):
    """SamplesLoss(p=1) forms each step's two sides (and each self problem) by the window
    pass, and so its final extrapolation (differentiated: the gradient kernel reads the
    pass's LSEs), and its value and gradient match the exact steps' to float32
    accuracy."""
    import flashot
    import flashot.solver.tiled_loop as loop

    x, y, *_ = _problem(5, 30, 26, 3)
    x, y = x.to(DEVICE), y.to(DEVICE)
    calls, real = [0], loop.window_step

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    def value_and_grad():
        xs = x.clone().requires_grad_()
        v = flashot.SamplesLoss(p=1, blur=0.1, scaling=0.5, backend="triton")(xs, y)
        return v, torch.autograd.grad(v, xs)[0]

    finals, real_t = [0], loop.window_transforms

    def counted_t(*args, **kwargs):
        finals[0] += 1
        return real_t(*args, **kwargs)

    monkeypatch.setattr(loop, "window_step", counted)
    monkeypatch.setattr(loop, "window_transforms", counted_t)
    windowed = value_and_grad()
    steps = calls[0]
    monkeypatch.setattr(loop, "window_step", lambda *a, **k: None)
    monkeypatch.setattr(loop, "window_transforms", lambda *a, **k: None)
    exact = value_and_grad()
    assert steps > 0 and steps % 3 == 0  # (per step: both sides, then two self problems)
    assert finals[0] == 3  # (the pair, then each self problem)
    assert abs(float(windowed[0] - exact[0])) <= 1e-6 * max(1.0, abs(float(exact[0])))
    assert float((windowed[1] - exact[1]).norm()) <= 1e-5 * float(exact[1].norm())


def _masked_softmin(x, y, lw, eps, cost, keep):
    """float64 ``−ε log Σ_j [keep_ij] e^{lw_j − C_ij/ε}`` (n,): the kept pairs only."""
    c = cost(x.double(), y.double())
    z = torch.where(keep, lw.double()[None, :] - c / eps, -float("inf"))
    return -eps * torch.logsumexp(z, 1)


def _cluster_mask(gen, rows: int, cols: int, symmetric: bool):
    """A random cluster-pair mask (rows, cols) keeping each row and column cluster once at
    least (a symmetric one for a self problem)."""
    keep = torch.rand(rows, cols, generator=gen) < 0.5
    keep[torch.arange(rows), torch.randint(cols, (rows,), generator=gen)] = True
    keep[torch.randint(rows, (cols,), generator=gen), torch.arange(cols)] = True
    return keep | keep.T if symmetric else keep


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(17, 60), m=st.integers(17, 60),
       d=st.sampled_from([2, 3, 20]), offset=st.sampled_from([0.0, 200.0]),
       self_problem=st.booleans())  # fmt: skip
def test_block_sparse_sides_match_masked_soft_minima(seed, n, m, d, offset, self_problem):
    """With block-sparse layouts (a cluster-pair mask and its transpose; clusters of one
    row block each, so the layouts cover exactly the kept pairs) the window pass and its
    repairs give each side's soft-minimum over its kept pairs, against a float64 masked
    reference: stabilizers at that reference (every sum in its window) or far off (every
    row repaired); a self problem's symmetric mask from half a pass."""
    from flashot.backends.kernel_sums import block_intervals
    from flashot.backends.triton._pair_sums import window_softmins

    x, y, la, lb, g = _problem(seed, n, m, d)
    if self_problem:
        y, lb, m = x, la, n
    bm = 16  # (a cluster a block: the rows of a block keep the same columns)
    rs, cs = (torch.arange(0, size + bm, bm).clamp(max=size) for size in (n, m))
    keep_c = _cluster_mask(g, len(rs) - 1, len(cs) - 1, self_problem)
    keep = keep_c.repeat_interleave(bm, 0)[:n].repeat_interleave(bm, 1)[:, :m]
    pairs = torch.nonzero(keep_c).T
    pairs_t = torch.nonzero(keep_c.T).T
    rows = block_intervals(rs.to(DEVICE), cs.to(DEVICE), pairs.to(DEVICE), bm=bm, gap=0)
    cols = block_intervals(cs.to(DEVICE), rs.to(DEVICE), pairs_t.to(DEVICE), bm=bm, gap=0)
    cost, eps = cost_of(1), 0.3
    f = _masked_softmin(x, y, lb, eps, cost, keep).float()
    gg = f if self_problem else _masked_softmin(y, x, la, eps, cost, keep.T).float()
    if offset:
        f = f + offset * torch.rand(n, generator=g)
        gg = f if self_problem else gg - offset * torch.rand(m, generator=g)
    xd, lad, fd = x.to(DEVICE), la.to(DEVICE), f.to(DEVICE)
    yd, lbd, gd = (xd, lad, fd) if self_problem else (y.to(DEVICE), lb.to(DEVICE), gg.to(DEVICE))
    got_f, got_g = window_softmins(xd, yd, lad, lbd, fd, gd, eps, cost, sparse=(rows, cols))
    assert _close(got_f, _masked_softmin(x, y, lb + gg / eps, eps, cost, keep), (f, gg))
    assert _close(got_g, _masked_softmin(y, x, la + f / eps, eps, cost, keep.T), (f, gg))
