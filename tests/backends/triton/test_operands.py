"""The score operands' forms (:mod:`flashot.backends.triton._operands`, ``._triples``):
TF32 rounding, triples, and which form a launch takes; in Triton's interpreter on CPU,
natively on a GPU."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends import available_backends
from flashot.backends.dual import Potentials
from flashot.backends.triton._triples import (
    TRIPLE_UP_TO,
    TRIPLE_WIDTH,
    triple_operand,
    triple_pair,
)
from tests.backends.test_base import dense_attend, problem
from tests.conftest import rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

finite = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0**127,
                   max_value=2.0**127)  # fmt: skip


def reference_tf32(v: float) -> float:
    """Nearest value with 11 significant bits, ties away from zero (float64 arithmetic)."""
    if v == 0.0:
        return v
    mant, exp = math.frexp(abs(v))  # |v| = mant·2^exp, mant in [0.5, 1)
    scaled = mant * 2.0**11
    rounded = math.floor(scaled + 0.5)
    if exp - 1 < -126:  # subnormal: the bits past 13 of the fixed-point subnormal scale
        step = 2.0 ** (-149 + 13)
        rounded_abs = math.floor(abs(v) / step + 0.5) * step
        return math.copysign(rounded_abs, v)
    return math.copysign(rounded * 2.0 ** (exp - 11), v)


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """The kernel's TF32 rounding of 1-D ``t``: the hi part of its one-feature triples."""
    return triple_pair(t.reshape(-1, 1).to(DEVICE))[0, :, 0].cpu()


@settings(max_examples=300, deadline=None)
@given(st.lists(finite, min_size=1, max_size=40))
def test_tf32_round_is_nearest_with_ties_away_from_zero(values):
    """Against the float64 definition, normal and subnormal, at and between ties; the low
    13 bits of every result are zero (what a TF32 MMA reads is exactly the value); lo is
    the rounded remainder (t − hi is exact in float32: hi is within 2^-11 of t)."""
    t = torch.tensor(values, dtype=torch.float32)
    pair = triple_pair(t.reshape(-1, 1).to(DEVICE)).cpu()
    got, lo = pair[0, :, 0], pair[0, :, 2]
    assert int((pair.view(torch.int32) & 0x1FFF).abs().max()) == 0
    for v, r, low in zip(t.tolist(), got.tolist(), lo.tolist(), strict=True):
        assert r == reference_tf32(v), (v, r)
        assert low == reference_tf32(v - r), (v, r, low)


def test_tf32_round_ties_and_sign():
    one_ulp = 2.0**-23
    t = torch.tensor([1 + 2**-11, 1 + 2**-11 - one_ulp, -(1 + 2**-11), 1 + 3 * 2**-11, 0.0, -0.0])
    got = tf32_round(t).tolist()
    assert got[:4] == [1 + 2**-10, 1.0, -(1 + 2**-10), 1 + 2 * 2**-10]
    assert got[4:] == [0.0, 0.0] and math.copysign(1, got[5]) == -1


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    d=st.integers(1, TRIPLE_UP_TO),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 7.0, 1e6, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_triples_give_three_tf32_terms_of_every_product(n, d, scale, seed):
    """q-side ``[hi, hi, lo]`` against k-side ``[hi, lo, hi]``: the float64 product of two
    triples is hi·hi' + hi·lo' + lo·hi' and within 2^-21 Σ|x y| of the float32 inputs'
    exact product; padding columns are zero; the parts are TF32 values."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=gen) * scale).float()
    y = (torch.randn(n, d, generator=gen) * scale).float()
    qt, kt = triple_operand(x.to(DEVICE), "q").cpu(), triple_operand(y.to(DEVICE), "k").cpu()
    assert qt.shape == kt.shape == (n, TRIPLE_WIDTH) and qt.dtype == torch.float32
    assert torch.equal(qt[:, 3 * d :], torch.zeros(n, TRIPLE_WIDTH - 3 * d))
    assert int((qt.view(torch.int32) & 0x1FFF).abs().max()) == 0
    got = (qt.double() * kt.double()).sum(1)
    exact = (x.double() * y.double()).sum(1)
    bound = 2.0**-21 * (x.double() * y.double()).abs().sum(1)
    assert bool(((got - exact).abs() <= bound).all())
    hx, hy = qt[:, :d].double(), kt[:, :d].double()
    lx, ly = qt[:, 2 * d : 3 * d].double(), kt[:, d : 2 * d].double()
    assert torch.equal(kt[:, 2 * d : 3 * d], kt[:, :d]) and torch.equal(qt[:, d : 2 * d], qt[:, :d])
    assert torch.allclose(got, (hx * hy + hx * ly + lx * hy).sum(1), rtol=0, atol=0)


def test_tf32_round_keeps_nan_and_infinities():
    """A NaN's bits plus the rounding carry can read as a finite number (0x7FFFFFFF
    becomes -0.0): non-finite entries must come back as they are, so a triple of a
    cloud holding NaN yields NaN scores, not finite ones."""
    t = torch.tensor([math.nan, math.inf, -math.inf, 3.4028235e38]).view(torch.int32)
    t[0] = 0x7FFFFFFF  # the NaN whose carry reaches the sign bit
    got = tf32_round(t.view(torch.float32))
    assert math.isnan(got[0]) and got[1] == math.inf and got[2] == -math.inf
    assert got[3] == math.inf  # the largest binade's top values round up to inf
    x = torch.tensor([[1.0, math.nan, 2.0]], device=DEVICE)
    prod = (triple_operand(x, "q").double() * triple_operand(x, "k").double()).sum()
    assert math.isnan(prod)


def test_triple_role_and_input_are_checked():
    with pytest.raises(ValueError, match="role"):
        triple_operand(torch.zeros(2, 2), "v")
    with pytest.raises(ValueError, match="at most 5 columns"):
        triple_pair(torch.zeros(2, TRIPLE_UP_TO + 1))
    with pytest.raises(ValueError, match="float32"):
        triple_pair(torch.zeros(2, 2, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(0, 3), (4, 0)])
def test_empty_clouds_give_empty_triples(shape):
    pair = triple_pair(torch.zeros(shape, device=DEVICE))
    assert pair.shape == (2, shape[0], TRIPLE_WIDTH) and not bool(pair.any())


def test_strided_input_and_rows_past_one_program():
    """A transposed (non-contiguous) cloud and more rows than one program converts: the
    same triples as its contiguous copy, and as the per-element definition."""
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1), device="cpu").T
    got = triple_pair(x.to(DEVICE).T.contiguous().T)
    assert torch.equal(got.cpu(), triple_pair(x.contiguous().to(DEVICE)).cpu())
    hi = torch.tensor([[reference_tf32(v) for v in row] for row in x.tolist()])
    assert torch.equal(got[0, :, :3].cpu(), hi) and torch.equal(got[1, :, 6:9].cpu(), hi)


triton_only = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


@triton_only
@pytest.mark.parametrize("d", [1, 3, TRIPLE_UP_TO, TRIPLE_UP_TO + 1])
@pytest.mark.parametrize("presplit", [None, False, True])
def test_fp32_launches_take_triples_up_to_five_features(gen, d, presplit):
    """presplit=None reads triples up to TRIPLE_UP_TO features (one TF32 MMA); False keeps
    3xTF32 per tile, True split parts; tf32 never. Row LSEs and fused plan sums of
    triples match float64 to float32's accuracy (scores of several hundred)."""
    from flashot.backends.triton import TritonBackend

    form, h = problem(gen, 40, 50, d, torch.float32, DEVICE, spread=6.0)
    be = TritonBackend(presplit=presplit)
    _, _, _, _, triples = be.operands.score_pair(form.q, form.k)
    assert triples == (presplit is None and d <= TRIPLE_UP_TO)
    assert not TritonBackend("tf32").operands.score_pair(form.q, form.k)[4]
    small = problem(gen, 40, 50, d, torch.float32, DEVICE)[0]  # sums within float32
    f, g = torch.randn(40, generator=gen).to(DEVICE), torch.randn(50, generator=gen).to(DEVICE)
    la, lb = torch.rand(40, generator=gen).log().to(DEVICE), torch.zeros(50, device=DEVICE)
    with be.operand_scope():
        lse, _ = be.row_attend(form, h, 0.5)
        r, c = be.plan_sums(Potentials(small, f, g, la, lb, 0.5))
    ref = dense_attend(form, h, 0.5, None)[0]
    scale = float(form.dense().double().abs().max())
    assert scale > 200 and float((lse.double().cpu() - ref.cpu()).abs().max()) < 4e-7 * scale
    E = torch.exp((f.double()[:, None] + g.double()[None] - small.dense().double()) / 0.5)
    assert rel(r.cpu(), (E @ lb.exp().double()).cpu()) < 1e-5
    assert rel(c.cpu(), (la.exp().double() @ E).cpu()) < 1e-5


@triton_only
def test_a_cloud_serves_both_sides_as_its_own_triple(gen):
    """A self problem (q is k): the q-side and k-side triples of one tensor are cached
    apart, never one served for the other."""
    from flashot.backends.triton import TritonBackend

    x = torch.randn(30, 3, generator=gen).to(DEVICE)
    be = TritonBackend()
    with be.operand_scope():
        qt, kt, *_ = be.operands.score_pair(x, x)
        again = be.operands.score_pair(x, x)
    assert torch.equal(qt, triple_operand(x, "q")) and torch.equal(kt, triple_operand(x, "k"))
    assert not torch.equal(qt, kt)  # one conversion serves both sides, kept for the next:
    assert again[0].data_ptr() == qt.data_ptr() and again[1].data_ptr() == kt.data_ptr()
