"""The pair kernels' operands made once per scope (backends/triton/_pair_operands.py):
the same bits as unscoped calls, one preparation and one split per cloud and pair, and a
miss after an in-place change; in Triton's interpreter on CPU, natively on a GPU."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.backends.kernel_sums import cost_of, pair_scope, softmin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def _clouds(seed, n, m, d):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g) + 2.0, torch.randn(m, d, generator=g)
    return x.to(DEVICE), y.to(DEVICE), torch.randn(m, generator=g).to(DEVICE)


@contextlib.contextmanager
def _counted_splits():
    """The number of split_operand calls made inside (a list holding one count)."""
    from flashot.backends.triton import _pair_operands

    calls, real = [0], _pair_operands.split_operand

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pair_operands, "split_operand", counting)
        yield calls


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), m=st.integers(1, 40),
       d=st.sampled_from([2, 3, 9, 20]))  # fmt: skip
def test_scoped_soft_minima_are_bit_for_bit_the_unscoped_ones(seed, n, m, d):
    """Every side of a debiased schedule (xy, yx, xx, yy), repeated, inside a scope gives
    exactly the unscoped values: the scope only skips repeated preparations."""
    x, y, h = _clouds(seed, n, m, d)
    hx = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    cost = cost_of(1)
    sides = [(x, y, h), (y, x, hx), (x, x, hx), (y, y, h), (x, y, 0.5 * h)]

    def run():
        return [softmin(r, c, w, 0.3, cost, backend="triton") for r, c, w in sides]

    plain = run()
    with pair_scope(x, y, cost, "triton"):
        scoped = run() + run()
    for a, b in zip(plain + plain, scoped, strict=True):
        assert torch.equal(a, b)


def test_a_scope_splits_each_cloud_once_per_pair():
    """At d = 20 (the product form, split operands): a schedule's repeated xy, yx, xx and
    yy soft-minima split four clouds in all (x and y centred for the pair, each cloud
    centred for its self problem) however often they run; unscoped, every call splits."""
    x, y, h = _clouds(0, 24, 17, 20)
    hx = torch.zeros(24, device=DEVICE)
    cost = cost_of(1)

    def schedule(steps):
        for _ in range(steps):
            for r, c, w in ((x, y, h), (y, x, hx), (x, x, hx), (y, y, h)):
                softmin(r, c, w, 0.3, cost, backend="triton")

    with _counted_splits() as calls:
        schedule(2)
        unscoped = calls[0]
        with pair_scope(x, y, cost, "triton"):
            schedule(3)
        scoped = calls[0] - unscoped
    assert unscoped == 2 * (2 + 2 + 1 + 1)
    assert scoped == 4


def test_an_in_place_change_inside_a_scope_is_seen():
    """A cloud changed in place (a new version) is prepared again, not read stale."""
    x, y, h = _clouds(1, 21, 19, 20)
    cost = cost_of(1)
    with pair_scope(x, y, cost, "triton"):
        before = softmin(x, y, h, 0.3, cost, backend="triton")
        x.mul_(0.5)
        after = softmin(x, y, h, 0.3, cost, backend="triton")
    assert not torch.equal(before, after)
    assert torch.equal(after, softmin(x, y, h, 0.3, cost, backend="triton"))


@pytest.mark.parametrize("d", [3, 20])
def test_samples_loss_p1_value_and_gradient_unchanged_by_the_scope(monkeypatch, d):
    """SamplesLoss(p=1) (debiased, its schedule inside one scope) returns the same value
    and gradient bits as with the scope turned off."""
    import flashot.samples_loss as samples_loss

    x, y, _ = _clouds(2, 26, 22, d)
    loss = flashot.SamplesLoss(p=1, blur=0.1, scaling=0.5, backend="triton")

    def value_and_grad():
        xs = x.clone().requires_grad_()
        v = loss(xs, y)
        return v, torch.autograd.grad(v, xs)[0]

    scoped = value_and_grad()
    monkeypatch.setattr(samples_loss, "pair_scope", lambda *a, **k: contextlib.nullcontext())
    plain = value_and_grad()
    assert torch.equal(scoped[0], plain[0]) and torch.equal(scoped[1], plain[1])


def test_the_scope_is_a_no_op_off_the_fused_path():
    """A plain callable cost (or backend 'torch') opens no scope: nothing is kept."""
    from flashot.backends.triton import _pair_operands

    x, y, _ = _clouds(3, 5, 4, 3)
    with pair_scope(x, y, lambda a, b: torch.cdist(a, b), "triton"):
        assert _pair_operands._SCOPE.memo is None
    with pair_scope(x, y, cost_of(1), "torch"):
        assert _pair_operands._SCOPE.memo is None
    with pair_scope(x, y, cost_of(1), "triton"):
        assert _pair_operands._SCOPE.memo == {}
    assert _pair_operands._SCOPE.memo is None


def test_samples_loss_p1_runs_under_inference_mode():
    """Inference tensors keep no version counter: the scope keys them without one, and
    the value equals the one computed outside inference mode."""
    x, y, _ = _clouds(4, 30, 25, 20)
    loss = flashot.SamplesLoss(p=1, blur=0.1, scaling=0.5, backend="triton")
    ref = loss(x, y)
    with torch.inference_mode():
        xi, yi = x.clone(), y.clone()
        assert xi.is_inference()
        got = loss(xi, yi)
    assert torch.equal(got, ref)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), m=st.integers(1, 40),
       d=st.sampled_from([1, 3, 8, 9]), p=st.sampled_from([1, 2]))  # fmt: skip
def test_feature_major_clouds_give_the_row_major_results_bit_for_bit(seed, n, m, d, p):
    """Clouds with differences (d ≤ 8) reach the kernels feature-major, others row-major
    (``_pair_operands.FEATURE_MAJOR``): the same soft-minima and gradients, bit for bit,
    as with row-major clouds (only the loads' addresses change)."""
    from flashot.backends.triton import _pair_operands

    x, y, h = _clouds(seed, n, m, d)
    cost = cost_of(p)

    def run():
        xs = x.clone().requires_grad_()
        out = softmin(xs, y, h, 0.3, cost, backend="triton")
        (gx,) = torch.autograd.grad(out, xs, torch.ones_like(out))
        return out, gx, _pair_operands.prepared(x, y, cost)[0]

    *feature_major, xs = run()
    assert xs.t().is_contiguous() if d <= 8 else xs.is_contiguous()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pair_operands, "FEATURE_MAJOR", False)
        *row_major, xs = run()
        assert xs.is_contiguous()
    for a, b in zip(feature_major, row_major, strict=True):
        assert torch.equal(a, b)
