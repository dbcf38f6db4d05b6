"""The accurate mode's split operands (flashot.backends.triton._split)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import TorchBackend, available_backends
from flashot.backends.device import triton_interpreted
from flashot.geometry.costs import attention_form, get_cost
from tests.conftest import rel, triton_backend

pytestmark = pytest.mark.skipif("triton" not in available_backends(), reason="needs triton")
#: the kernels' device: CPU tensors in the interpreter (CI), the GPU otherwise
DEV = "cpu" if triton_interpreted() else "cuda"


ROLES = ("score", "value")


def lo_bits_of(role: str) -> int:
    from flashot.backends.triton import _split

    return _split.SCORE_LO_BITS if role == "score" else _split.VALUE_LO_BITS


@settings(max_examples=60, deadline=None)
@given(log_scale=st.floats(-30, 30), n=st.integers(1, 20), d=st.integers(1, 9),
       seed=st.integers(0, 2**31 - 1), zeros=st.booleans(),
       role=st.sampled_from(ROLES))  # fmt: skip
def test_split_parts_rebuild_the_features(log_scale, n, d, seed, zeros, role):
    """hi + 2^-lo_bits lo equals 2^e x to 2^-22 of the largest entry, both parts fit in
    float16 and the scale is a power of two bringing the largest entry to (2^13, 2^14]."""
    from flashot.backends.triton._split import split_operand

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * 2.0**log_scale
    if zeros:
        x[0] = 0.0
    s = split_operand(x.to(DEV), lo_bits=lo_bits_of(role))
    assert s.lo_bits == lo_bits_of(role)
    hi, lo = s.parts.double().cpu()
    assert s.parts.dtype == torch.float16 and torch.isfinite(s.parts).all()
    scale = 1.0 / float(s.inv)
    assert float(torch.log2(torch.tensor(scale))) == round(float(torch.log2(torch.tensor(scale))))
    top = float(x.abs().max()) * scale
    assert top == 0.0 or 2.0**13 < top <= 2.0**14
    err = (hi + lo * 2.0**-s.lo_bits - x.double() * scale).abs().max()
    assert err <= 2.0**-22 * max(top, 1e-300) * 1.01


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), role=st.sampled_from(ROLES),
       tiny=st.integers(12, 40))  # fmt: skip
def test_split_errors_of_small_entries_stay_within_their_role_s_bound(seed, role, tiny):
    """Entries far below the largest: a score operand's are exact to 2^-22 of themselves
    or 2^-39 of the largest (its low part's float16 subnormals), a value's to 2^-22 of
    themselves down to 2^-28 of the largest (the 2^11 scale keeps its low part normal)."""
    from flashot.backends.triton._split import split_operand

    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(8, 3, generator=gen) * 2.0**-tiny + 2.0 ** -(tiny + 1)
    x[0, 0] = 1.0  # the largest entry: scaled to 2^14
    s = split_operand(x.to(DEV), lo_bits=lo_bits_of(role))
    hi, lo = s.parts.double().cpu()
    scaled = x.double() / float(s.inv)
    err = (hi + lo * 2.0**-s.lo_bits - scaled).abs()[1:]
    if role == "score":  # (2^-25 = 2^14 · 2^-39)
        assert (err <= torch.clamp(2.0**-22 * scaled[1:].abs(), min=2.0**-25) * 1.0001).all()
    elif tiny <= 27:
        assert (err <= 2.0**-22 * scaled[1:].abs() * 1.0001).all()


def reference_split(x: torch.Tensor, lo_bits: int):
    """The module's definition in float64: the exponent by frexp, parts by rounding."""
    top = float(x.abs().max()) if x.numel() else 0.0
    mantissa, exponent = math.frexp(top)  # top = mantissa·2^exponent, mantissa ∈ [0.5, 1)
    e = 0 if top == 0 else min(max(14 - (exponent - (mantissa == 0.5)), -120), 120)
    scaled = x.double() * 2.0**e
    hi = scaled.to(torch.float16)
    lo = ((scaled - hi.double()) * 2.0**lo_bits).to(torch.float16)
    return torch.stack([hi, lo]), 2.0**-e


@settings(max_examples=80, deadline=None)
@given(k=st.integers(-140, 120), ulps=st.sampled_from([-1, 0, 1, 2**20]), n=st.integers(1, 9),
       d=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), transposed=st.booleans(),
       role=st.sampled_from(ROLES))  # fmt: skip
def test_split_kernel_matches_the_definition_bit_for_bit(k, ulps, n, d, seed, transposed, role):
    """Largest entries at, one ulp below and above a power of two (where a rounded log2
    picks the wrong exponent), subnormal to huge, any layout: the parts and the scale
    equal the float64 definition exactly."""
    from flashot.backends.triton._split import split_operand

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(d, n, generator=gen).T if transposed else torch.randn(n, d, generator=gen)
    peak = torch.tensor(2.0**k, dtype=torch.float64)
    if ulps:  # the float32 neighbours of 2^k
        peak = torch.nextafter(peak.float(), torch.tensor(math.copysign(math.inf, ulps)))
        peak = peak.double() * (1 + (ulps == 2**20) * 2.0**-3)
    x = x / x.abs().max() * peak.float() if float(peak) > 0 else x * 0
    if not torch.isfinite(x).all():
        return
    s = split_operand(x.to(DEV), lo_bits=lo_bits_of(role))
    parts, inv = reference_split(x, lo_bits_of(role))
    assert torch.equal(s.parts.cpu().view(torch.int16), parts.view(torch.int16))
    assert float(s.inv) == inv


def test_split_of_zeros_is_zero():
    from flashot.backends.triton._split import split_operand

    s = split_operand(torch.zeros(4, 3, device=DEV))
    assert torch.equal(s.parts.float().cpu(), torch.zeros(2, 4, 3)) and float(s.inv) == 1.0


@pytest.mark.parametrize("scale,presplit", [(1e-3, True), (300.0, True), (1.0, False)])
def test_presplit_and_per_tile_3xtf32_agree_with_float64(scale, presplit):
    """The default fp32 mode (split once per solve) and 3xTF32 per tile (presplit=False)
    both solve within 1e-6 of float64, whatever the clouds' magnitude (the split's scale)."""
    from flashot.backends.triton import TritonBackend

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 5, generator=gen) * scale).to(DEV)
    y = ((torch.randn(30, 5, generator=gen) + 0.5) * scale).to(DEV)
    eps = 0.5 * scale**2
    ref = flashot.sinkhorn(x.double(), y.double(), eps=eps, max_iter=40, tol=None,
                           backend="torch").cost  # fmt: skip
    res = flashot.sinkhorn(x, y, eps=eps, max_iter=40, tol=None,
                           backend=TritonBackend(presplit=presplit))  # fmt: skip
    assert rel(res.cost.double(), ref) < 1e-6  # the default precision's promise


def test_split_operands_live_only_while_a_solve_runs():
    """Split copies are shared by a solve's launches and dropped after it (memory)."""
    from flashot.backends.triton import TritonBackend
    from flashot.backends.triton._split import SplitOperand

    backend = TritonBackend(presplit=True)  # (None would not split at this size)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 4, generator=gen).to(DEV), torch.randn(20, 4, generator=gen).to(DEV)
    seen = []
    real = backend.operands.split_parts

    def spy(t):
        seen.append(t)
        return real(t)

    backend.operands.split_parts = spy
    flashot.sinkhorn(x, y, eps=0.5, max_iter=30, tol=None, backend=backend)
    assert backend.operands.cache == [] and len(seen) == 2  # q and k once (aliases hit: final step)
    with backend.operand_scope():
        form = attention_form(get_cost("sqeuclidean"), x, y)
        first = backend.operands.operand(form.q)
        assert isinstance(first, SplitOperand) and backend.operands.operand(form.q) is first
    assert backend.operands.cache == []


def test_the_differentiated_step_splits_q_and_k_once():
    """With a gradient, the final step's row and column passes run in the solve's scope
    and share its split of q and of k: 2 splits in all (4 when they ran apart, 6 with a
    split per pass)."""
    from flashot.backends.triton import TritonBackend

    backend = TritonBackend(presplit=True)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, 4, generator=gen).to(DEV).requires_grad_()
    y = torch.randn(20, 4, generator=gen).to(DEV)
    seen = []
    real = backend.operands.split_parts
    backend.operands.split_parts = lambda t: seen.append(t) or real(t)
    cost = flashot.sinkhorn(x, y, eps=0.5, max_iter=30, tol=None, backend=backend).cost
    (grad,) = torch.autograd.grad(cost, x)
    assert len(seen) == 2 and backend.operands.cache == []
    ref_x = x.detach().double().requires_grad_()
    ref = flashot.sinkhorn(ref_x, y.double(), eps=0.5, max_iter=30, tol=None, backend="torch")
    (ref_grad,) = torch.autograd.grad(ref.cost, ref_x)
    assert rel(grad.double(), ref_grad) < 1e-5


@settings(max_examples=8, deadline=None)
@given(log_v=st.floats(-20, 20), eps=st.sampled_from([0.02, 0.5, 20.0]),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_split_values_average_like_float64(log_v, eps, seed):
    """Within a solve's scope the values are split too (V_SPLIT, three half MMAs): the
    softmax average of values of any magnitude, at weights spanning many orders of
    magnitude (small ε), is within the first-order bound of its errors: 2^-20 of the
    values' range (the split weights) plus the scores' (22 bits: δ ≤ 2^-21 Σ_d |q_d k_d|
    per element), which move each weight by at most 2δ/ε relative; on top of that what
    the same kernel without splits misses (IEEE float32 dots here). At small ε the
    scores' term dominates: relative to the IEEE kernel's error alone, 60 seeds at
    ε = 0.02 measured up to 30× (the bound's slack: ≥ 25× on the same seeds)."""
    from flashot.backends.triton import TritonBackend

    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(37, 5, generator=gen).to(DEV), torch.randn(29, 5, generator=gen).to(DEV)
    v = (torch.randn(29, 3, generator=gen) * 2.0**log_v).to(DEV)
    v[:, 0] = 0.0
    h = torch.randn(29, generator=gen).to(DEV)
    cost = get_cost("sqeuclidean")
    backend = TritonBackend(presplit=True)
    splits, values = [], []
    real, real_values = backend.operands.split_parts, backend.operands.value_parts
    backend.operands.split_parts = lambda t: splits.append(t) or real(t)
    backend.operands.value_parts = lambda t: values.append(t) or real_values(t)
    with backend.operand_scope():
        lse, out = backend.row_attend(attention_form(cost, x, y), h, eps, v)
    assert len(splits) == 2 and len(values) == 1  # q, k and the values: the split path ran
    form64 = attention_form(cost, x.double(), y.double())
    ref_lse, ref = TorchBackend().row_attend(form64, h.double(), eps,
                                                 v.double())  # fmt: skip
    plain = TritonBackend(presplit=False)
    f32 = plain.row_attend(attention_form(cost, x, y), h, eps, v)[1]
    err32 = float((f32.double() - ref).abs().max())
    form = attention_form(cost, x, y)
    delta = 2.0**-21 * float((form.q.abs() @ form.k.abs().T).max())
    bound = 2.0**-20 + 2.0 * delta / eps
    assert (out.double() - ref).abs().max() <= 4.0 * err32 + bound * float(v.abs().max())
    assert (lse.double() - ref_lse).abs().max() <= 1e-6 * (1.0 + float(ref_lse.abs().max()))


def test_default_presplit_follows_the_launch_size():
    """presplit=None splits launches of split_work ≥ PRESPLIT_FROM only; True always,
    False never."""
    from flashot.backends.triton import TritonBackend
    from flashot.backends.triton._operands import PRESPLIT_FROM, split_work

    auto, always = TritonBackend(), TritonBackend(presplit=True)
    never = TritonBackend(presplit=False)
    assert not auto.operands.splits(PRESPLIT_FROM - 1) and auto.operands.splits(PRESPLIT_FROM)
    assert always.operands.splits(1) and not never.operands.splits(PRESPLIT_FROM)
    assert not TritonBackend(precision="tf32").operands.splits(PRESPLIT_FROM)
    # the measured sides of the rule (H200): 10k d = 3 unsplit, 10k d = 64, 50k d = 3 split
    assert not auto.operands.splits(split_work(10_000**2, 3))
    assert auto.operands.splits(split_work(10_000**2, 64)) and auto.operands.splits(
        split_work(50_000**2, 3)
    )
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 4, generator=gen).to(DEV), torch.randn(20, 4, generator=gen).to(DEV)
    seen = []
    real = auto.operands.split_parts
    auto.operands.split_parts = lambda t: seen.append(t) or real(t)
    flashot.sinkhorn(x, y, eps=0.5, max_iter=5, tol=None, backend=auto)
    assert seen == []  # a small solve reads float32 with 3xTF32 per tile
    with pytest.raises(TypeError, match="presplit"):
        TritonBackend(presplit="yes")


def test_default_presplit_makes_no_copies_past_their_memory_cap(monkeypatch):
    """presplit=None splits only while both operands' copies fit PRESPLIT_MAX_BYTES:
    OTDD at 60k with d' = 804 (386 MB of copies) reads 3xTF32 per tile, 50k d = 64 and
    50k d = 512 split. A solve past the cap makes no copy and gives the answer of one
    under it."""
    from flashot.backends.triton import TritonBackend, _operands
    from flashot.backends.triton._operands import PRESPLIT_FROM, PRESPLIT_MAX_BYTES, split_work

    ops = TritonBackend().operands

    def copies(n, m, d):
        return 4 * (n + m) * d

    assert not ops.splits(split_work(60_000**2, 804), copies(60_000, 60_000, 804))
    assert ops.splits(split_work(50_000**2, 64), copies(50_000, 50_000, 64))
    assert ops.splits(split_work(50_000**2, 512), copies(50_000, 50_000, 512))
    assert not ops.splits(PRESPLIT_FROM, PRESPLIT_MAX_BYTES + 1)
    assert TritonBackend(presplit=True).operands.splits(PRESPLIT_FROM, PRESPLIT_MAX_BYTES + 1)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(30, 8, generator=gen).to(DEV), torch.randn(20, 8, generator=gen).to(DEV)
    monkeypatch.setattr(_operands, "PRESPLIT_FROM", 1)  # every launch large enough
    costs = []
    for cap, made in ((copies(30, 20, 8), True), (copies(30, 20, 8) - 1, False)):
        monkeypatch.setattr(_operands, "PRESPLIT_MAX_BYTES", cap)
        be, seen = TritonBackend(), []
        real = be.operands.split_parts
        be.operands.split_parts = lambda t, real=real, seen=seen: seen.append(t) or real(t)
        costs.append(flashot.sinkhorn(x, y, eps=0.5, max_iter=5, tol=None, backend=be).cost)
        assert bool(seen) == made
    assert torch.allclose(costs[0], costs[1], rtol=1e-6)


def test_a_packed_batch_counts_the_work_of_its_diagonal_blocks():
    """presplit=None on a packed batch weighs Σ n_s m_s, not the packed N·M."""
    from flashot.geometry.segments import Segments

    seg = Segments((0, 3, 10), (0, 4, 6))
    assert seg.elements == 3 * 4 + 7 * 2 == seg.T.elements


def test_split_chunks_are_summed_outside_the_mma():
    """The split scores' feature chunks add up in rounded float32, never in an MMA's
    accumulator, which truncates (H200 v22: a 13-chunk sum drifted by 6.6e-4 on scores of
    250 and stalled OTDD's float32 solves). Triton folds ``s += dot(a, b)`` into the MMA
    when the dot's own accumulator is zero, so the sm_90 IR is what is checked: inside
    the chunk loop no MMA accumulates onto the loop-carried sum, and a float add does.
    Compiled for sm_90 on this machine (no GPU needed), outside the interpreter."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[3])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    # (a script beside tests/backends/triton/ would import that folder as triton)
    run = subprocess.run([sys.executable, os.path.join(root, "tests", "probes",
                                                       "split_ir_probe.py")],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"Triton cannot compile for sm_90 here: {run.stderr.strip()[-300:]}")
    ir = run.stdout
    loop = re.search(r"scf\.for .*iter_args\((%[\w]+) = [^)]*\)", ir)
    assert loop, ir
    carried = loop.group(1)
    body = ir[loop.end() :]
    mma = r"(?:ttng\.warp_group_dot|triton_nvidia_gpu\.warp_group_dot|tt\.dot)"
    dots = re.findall(mma + r" (%[\w#]+), (%[\w#]+), (%[\w#]+)", body)
    assert len(dots) == 3, dots  # hi·lo', lo·hi', hi·hi' per chunk
    assert all(acc != carried for _, _, acc in dots), (carried, dots)
    assert re.search(rf"arith\.addf {carried}, ", body) or re.search(
        rf"arith\.addf %[\w#]+, {carried}\b", body), body  # fmt: skip


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
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
            got = dataset_distance(xa, ya, xb, yb, backend=triton_backend(presplit=presplit), **kw)
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


@pytest.mark.gpu
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
        got = block_scores(triton_backend(presplit=presplit), form)
        errors[presplit] = float((got - ref).abs().max())
    scale = float(ref.abs().max())
    assert errors[True] <= 2.0 * errors[False] + 2.0**-22 * scale, (errors, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_split_kernel_matches_the_definition_bit_for_bit_on_cuda(device):
    """The split kernel compiled for this GPU (the interpreter's test runs the same code
    on numpy): largest entries at and one ulp above powers of two, tiny to huge, on the
    current GPU and on another one."""
    from flashot.backends.triton._split import split_operand

    if torch.device(device).index == 1 and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    gen = torch.Generator().manual_seed(0)
    for k in (-130, -20, 0, 4, 14, 20, 100):
        for n, d in ((1, 1), (10_000, 64), (777, 3)):
            for above, role in ((False, "score"), (True, "score"), (False, "value")):
                x = torch.randn(n, d, generator=gen)
                x = x / x.abs().max() * 2.0**k
                if above:
                    x.view(-1)[0] = torch.nextafter(torch.tensor(2.0**k), torch.tensor(1e38))
                xd = x.to(device)
                s = split_operand(xd, lo_bits=lo_bits_of(role))
                parts, inv = reference_split(x, lo_bits_of(role))
                assert s.parts.device == xd.device  # "cuda" resolves to the current index
                assert torch.equal(s.parts.cpu().view(torch.int16), parts.view(torch.int16))
                assert float(s.inv) == inv
