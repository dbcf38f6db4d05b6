"""The fused soft-minimum of pair costs (backends/triton/_pairwise.py) against float64
PyTorch tiles: values, first derivatives (streamed), second derivatives (recomputed), user
costs with their own Triton functions; in Triton's interpreter on CPU, natively on a GPU."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.backends.kernel_sums import cost_of, kernel_matvec, softmin
from flashot.geometry.pair_costs import KERNEL_COSTS, PairCost
from tests.conftest import nan_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _log_distance(s, t, a, b):  # a robust radial cost, log(1 + |x − y|²)
    return tl.log(1.0 + s)


@triton.jit
def _log_distance_grad(s, t, a, b):
    return 1.0 / (1.0 + s), 0.0, 0.0, 0.0


@triton.jit
def _angle(s, t, a, b):  # 1 − cos(x, y) from the product and both norms
    return 1.0 - t / tl.sqrt(a * b + 1e-12)


@triton.jit
def _angle_grad(s, t, a, b):
    r = 1.0 / tl.sqrt(a * b + 1e-12)
    return 0.0, -r, 0.5 * t * r * r * r * b, 0.5 * t * r * r * r * a


LOG_DISTANCE = PairCost(
    lambda s, t, a, b: torch.log1p(s),
    _log_distance,
    _log_distance_grad,
    translation_invariant=True,
    name="log_distance",
)
ANGLE = PairCost(
    lambda s, t, a, b: 1 - t / (a * b + 1e-12).sqrt(), _angle, _angle_grad, name="angle"
)
ANGLE_NO_GRAD = PairCost(ANGLE.torch_fn, _angle, name="angle, no Triton gradient")
COSTS = {
    "p=1": cost_of(1),
    "p=2": cost_of(2),
    "log": LOG_DISTANCE,
    "angle": ANGLE,
    "angle-no-grad": ANGLE_NO_GRAD,
}


def _data(seed, n, m, d, zeros, twins):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g) + 3.0, torch.randn(m, d, generator=g) + 3.0
    h = torch.randn(m, generator=g)
    if zeros and m > 1:
        h[torch.rand(m, generator=g) < 0.3] = -float("inf")
        h[0] = 0.0  # (not all −∞)
    if twins:
        k = min(n, m)
        x[: k // 2] = y[: k // 2]  # coincident points: |x − y| = 0 exactly (differences)
    return x, y, h


def _grads(x, y, h, eps, cost, backend, cot, create_graph=False):
    ins = [t.clone().to(DEVICE).requires_grad_(True) for t in (x, y)]
    ins.append(h.clone().to(DEVICE).requires_grad_(bool(torch.isfinite(h).all())))
    s = softmin(*ins, eps, cost, backend=backend)
    wanted = [t for t in ins if t.requires_grad]
    gs = torch.autograd.grad(s, wanted, cot.to(s), create_graph=create_graph)
    return s, gs, ins


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 40),
    m=st.integers(1, 40),
    d=st.sampled_from([1, 2, 3, 8, 9, 20, 70]),
    name=st.sampled_from(sorted(COSTS)),
    eps=st.sampled_from([0.1, 1.0, 10.0]),
    zeros=st.booleans(),
    twins=st.booleans(),
)
def test_fused_soft_minimum_and_gradients_match_float64(seed, n, m, d, name, eps, zeros, twins):
    """Within 4× the error of the same computation in float32 PyTorch tiles (and 2e-6)."""
    assume(not (name.startswith("angle") and d == 1))  # (1-D angles are constant: gradient 0)
    cost = COSTS[name]
    x, y, h = _data(seed, n, m, d, zeros, twins)
    cot = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))
    s, gs, _ = _grads(x, y, h, eps, cost, "triton", cot)
    s64, gs64, _ = _grads(x.double(), y.double(), h.double(), eps, cost, "torch", cot.double())
    s32, gs32, _ = _grads(x, y, h, eps, cost, "torch", cot)
    for got, ref, f32 in zip((s, *gs), (s64, *gs64), (s32, *gs32), strict=True):
        assert _rel(got, ref) <= 4 * _rel(f32, ref) + 2e-6, (_rel(got, ref), _rel(f32, ref))


@pytest.mark.parametrize("name", ["p=1", "angle"])
def test_second_derivatives_recompute_in_tiles(gen, name):
    """A double backward through the fused kernel equals the tiles' (same float32 data)."""
    x, y, h = _data(3, 17, 23, 3, zeros=False, twins=False)
    cot = torch.randn(17, generator=gen)
    v = torch.randn(17, 3, generator=gen).to(DEVICE)
    out = []
    for backend in ("triton", "torch"):
        _, gs, ins = _grads(x, y, h, 0.5, COSTS[name], backend, cot, create_graph=True)
        out.append(torch.autograd.grad((gs[0] * v).sum(), ins[:2]))
    for got, ref in zip(*out, strict=True):
        assert _rel(got, ref) < 1e-5


def test_auto_takes_the_kernel_on_cuda_float32_only(monkeypatch):
    """``auto``: the fused kernel for CUDA float32 clouds; tiles on CPU, in float64 and for
    a cost without a Triton function; ``torch`` always tiles."""
    from flashot.backends.triton import _pairwise

    calls = []
    real = _pairwise.fused_softmin
    monkeypatch.setattr(_pairwise, "fused_softmin", lambda *a: calls.append(1) or real(*a))
    x, y, h = _data(0, 9, 11, 2, zeros=False, twins=False)
    x, y, h = x.to(DEVICE), y.to(DEVICE), h.to(DEVICE)
    plain = PairCost(cost_of(1).torch_fn)
    for backend, cost, xx in (
        ("auto", cost_of(1), x),
        ("torch", cost_of(1), x),
        ("triton", cost_of(1), x.double()),
        ("triton", plain, x),
    ):
        softmin(xx, y.to(xx.dtype), h.to(xx.dtype), 0.3, cost, backend=backend)
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
    softmin(x, y, h, 0.3, cost_of(1), backend="triton")
    assert len(calls) == (2 if DEVICE == "cuda" else 1)
    with pytest.raises(ValueError, match="backend must be"):
        softmin(x, y, h, 0.3, cost_of(1), backend="cuda")


@pytest.mark.parametrize("debias,reach", [(True, None), (False, 0.5)])
def test_samples_loss_p1_on_the_kernel_matches_tiles(monkeypatch, debias, reach):
    """``SamplesLoss("sinkhorn", p=1)`` through the kernel: the tiles' value and gradient
    (same float32 data, GeomLoss' schedule), and a PairCost given as ``cost``."""
    x, y, _ = _data(5, 30, 25, 3, zeros=False, twins=True)
    out = []
    for backend in ("triton", "torch"):
        xs = x.clone().to(DEVICE).requires_grad_()
        loss = flashot.SamplesLoss(p=1, blur=0.1, reach=reach, debias=debias, backend=backend)
        value = loss(xs, y.to(DEVICE))
        out.append((value, torch.autograd.grad(value, xs)[0]))
    assert _rel(out[0][0], out[1][0]) < 1e-5 and _rel(out[0][1], out[1][1]) < 1e-5
    loss = flashot.SamplesLoss(
        p=1, blur=0.1, cost=LOG_DISTANCE, debias=debias, reach=reach, backend="triton"
    )
    ref = flashot.SamplesLoss(
        p=1, blur=0.1, cost=LOG_DISTANCE, debias=debias, reach=reach, backend="torch"
    )
    x, y = x.to(DEVICE), y.to(DEVICE)
    assert _rel(loss(x, y), ref(x, y)) < 1e-5
    from flashot.backends.triton import _pair_sums, _pairwise

    ran = []
    real, real_w = _pairwise.fused_softmin, _pair_sums.window_softmins
    monkeypatch.setattr(_pairwise, "fused_softmin", lambda *a: ran.append(a[4]) or real(*a))
    monkeypatch.setattr(_pair_sums, "window_softmins",
                        lambda *a: ran.append(a[7]) or real_w(*a))  # fmt: skip
    loss(x, y)
    assert ran and all(c is LOG_DISTANCE for c in ran)  # (the user's cost, on the kernel)


@pytest.mark.parametrize("d", [3, 20])
def test_column_splits_and_coincident_points_in_the_product_form(monkeypatch, d):
    """Three column splits (partial log-sum-exps and gradient sums) give the one-split
    result; a self problem at small ε (every point's twin at distance 0, which the
    product form ``|x|² + |y|² − 2⟨x, y⟩`` misses by √rounding) is exact to float32."""
    from flashot.backends.triton import _configs

    x, _, _ = _data(11, 40, 40, d, zeros=False, twins=False)
    h = torch.full((40,), -3.7)  # (log 1/40)
    cot = torch.randn(40, generator=torch.Generator().manual_seed(2))
    s64, gs64, _ = _grads(
        x.double(), x.double(), h.double(), 0.5, cost_of(1), "torch", cot.double()
    )
    one = _grads(x, x, h, 0.5, cost_of(1), "triton", cot)
    # (one tile per split: three splits of 16 columns under the interpreter)
    monkeypatch.setattr(_configs, "column_grid",
                        lambda blocks, size, block, device, splits=None: (
                            triton.cdiv(size, block), block))  # fmt: skip
    three = _grads(x, x, h, 0.5, cost_of(1), "triton", cot)
    for a, b, ref in zip((one[0], *one[1]), (three[0], *three[1]), (s64, *gs64), strict=True):
        assert _rel(a, b) < 1e-6 and _rel(a, ref) < 2e-6


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), m=st.integers(1, 40),
       d=st.sampled_from([1, 3, 8, 9, 20, 70]), name=st.sampled_from(sorted(KERNEL_COSTS)),
       twins=st.booleans())  # fmt: skip
def test_fused_kernel_sums_and_gradients_match_float64(seed, n, m, d, name, twins):
    """``Σ_j k_ij w_j`` with weights of any sign, and its gradients in x, y and w, within
    a few times float32's own error: PyTorch's in float32 summing in its order and in
    three shuffled ones (a sum whose terms cancel, as the gradient in y of one column
    with cotangents of both signs, owes its float32 error to the order: 1.8e-7 in one,
    3.1e-6 in another, for terms of similar size summing to a third of one)."""
    kernel = KERNEL_COSTS[name][0]
    x, y, _ = _data(seed, n, m, d, zeros=False, twins=twins)
    x, y = x / d**0.5, y / d**0.5  # (kernels of O(1) distances)
    w = torch.randn(m, generator=torch.Generator().manual_seed(seed + 2))
    cot = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1))

    def run(dtype, backend, rows=None, cols=None):
        """Output, gradients in x, y, w; with ``rows``/``cols`` the points summed in that
        order, the results put back in the given one."""
        rows = torch.arange(n) if rows is None else rows
        cols = torch.arange(m) if cols is None else cols
        ins = [t.to(DEVICE, dtype).requires_grad_() for t in (x[rows], y[cols], w[cols])]
        out = kernel_matvec(*ins, kernel, backend=backend)
        grads = torch.autograd.grad(out, ins, cot[rows].to(out))
        back_r, back_c = torch.argsort(rows), torch.argsort(cols)
        return out[back_r], (grads[0][back_r], grads[1][back_c], grads[2][back_c])

    got, ref = run(torch.float32, "triton"), run(torch.float64, "torch")
    g = torch.Generator().manual_seed(seed + 3)
    f32s = [run(torch.float32, "torch")] + [
        run(torch.float32, "torch", torch.randperm(n, generator=g), torch.randperm(m, generator=g))
        for _ in range(3)
    ]
    for k, (a, r) in enumerate(zip((got[0], *got[1]), (ref[0], *ref[1]), strict=True)):
        own = max(_rel((b[0], *b[1])[k], r) for b in f32s)
        assert _rel(a, r) <= 4 * own + 2e-6, (_rel(a, r), own)


@pytest.mark.parametrize("name", ["energy", "gaussian", "laplacian", "hausdorff"])
def test_samples_loss_kernel_norms_on_the_kernel_match_tiles(name):
    x, y, _ = _data(7, 30, 25, 3, zeros=False, twins=True)
    out = []
    for backend in ("triton", "torch"):
        xs = x.clone().to(DEVICE).requires_grad_()
        value = flashot.SamplesLoss(name, blur=0.5, backend=backend)(xs, y.to(DEVICE))
        out.append((value, torch.autograd.grad(value, xs)[0]))
    assert _rel(out[0][0], out[1][0]) < 1e-5 and _rel(out[0][1], out[1][1]) < 1e-5


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("d", [2, 12])
def test_block_sparse_kernel_matches_its_pytorch_reference(d, p):
    """The fused block-sparse soft-minimum (rows sorted in blocks, column intervals) and
    its row gradient against the PyTorch blocks of the same layout, in float64 (p = 2 at
    d = 2: the gradient's weight sums from the value product's ones column)."""
    from flashot.backends.kernel_sums import (
        _intervals_softmin,
        block_intervals,
        block_sparse_softmin,
    )

    g = torch.Generator().manual_seed(d)
    x, y = torch.rand(70, d, generator=g), torch.rand(90, d, generator=g)
    h = torch.randn(90, generator=g)
    row_starts, col_starts = torch.tensor([0, 20, 45, 70]), torch.tensor([0, 30, 31, 60, 90])
    keep = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=torch.bool)
    pairs = torch.nonzero(keep, as_tuple=True)
    # (gap 0: exactly the kept clusters; a wider gap would stream them all here)
    layout = block_intervals(row_starts, col_starts, pairs, 16, 0)
    on_device = block_intervals(row_starts.to(DEVICE), col_starts.to(DEVICE),
                                tuple(t.to(DEVICE) for t in pairs), 16, 0)  # fmt: skip
    cot = torch.randn(70, generator=g)
    xs = x.clone().to(DEVICE).requires_grad_()
    got = block_sparse_softmin(xs, y.to(DEVICE), h.to(DEVICE), 0.05, cost_of(p), on_device,
                               "triton")  # fmt: skip
    (gx,) = torch.autograd.grad(got, xs, cot.to(DEVICE))
    x64 = x.double().requires_grad_()
    ref = _intervals_softmin(x64, y.double(), h.double(), 0.05, cost_of(p), layout, 1 << 20)
    (rx,) = torch.autograd.grad(ref, x64, cot.double())
    assert _rel(got, ref) < 2e-6 and _rel(gx, rx) < 2e-5


@pytest.mark.parametrize("p", [1, 2])
def test_samples_loss_multiscale_on_the_kernel_matches_its_pytorch_blocks(monkeypatch, p):
    from flashot.backends.triton import _pairwise

    sparse_calls = []
    real = _pairwise.fused_softmin

    def spy(*a):
        sparse_calls.append(len(a) > 5 and a[5] is not None)
        return real(*a)

    monkeypatch.setattr(_pairwise, "fused_softmin", spy)
    g = torch.Generator().manual_seed(4)
    x, y = torch.rand(150, 3, generator=g), 0.8 * torch.rand(120, 3, generator=g) + 0.2
    out = []
    for backend in ("triton", "torch"):
        xs = x.clone().to(DEVICE).requires_grad_()
        loss = flashot.SamplesLoss(p=p, blur=0.05, cluster_scale=0.2, backend=backend)
        value = loss(xs, y.to(DEVICE))
        out.append((value, torch.autograd.grad(value, xs)[0]))
    assert _rel(out[0][0], out[1][0]) < 1e-5 and _rel(out[0][1], out[1][1]) < 1e-4
    assert any(sparse_calls)  # (the block-sparse kernel ran)


@pytest.mark.parametrize("name", ["angle", "p=1"])
@pytest.mark.parametrize("n,m,d", [(17, 23, 3), (33, 18, 20)])
def test_tail_tiles_read_no_row_past_the_clouds(name, n, m, d):
    """Clouds given as row prefixes of buffers holding NaN past their ends (the angle cost
    is not centred, so the kernels read the views themselves): the soft-minimum and both
    gradient sides equal those of the unpadded clouds, bit for bit (tail tiles clamp their
    rows to the last one, and never read past it)."""
    from flashot.backends.triton._pairwise import fused_grads, fused_softmin

    x, y, h = _data(5, n, m, d, zeros=False, twins=False)
    x, y, h = x.to(DEVICE), y.to(DEVICE), h.to(DEVICE)
    cot = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    cost = COSTS[name]
    results = []
    for xs, ys in ((x, y), (nan_rows(x), nan_rows(y))):
        s, lse = fused_softmin(xs, ys, h, 0.5, cost)
        results.append((s, lse, *fused_grads(xs, ys, h, 0.5, cost, lse, cot, True, True)))
    for plain, padded in zip(*results, strict=True):
        assert torch.isfinite(padded).all() and torch.equal(plain, padded)


@pytest.mark.parametrize("name", ["p=1", "angle"])
@pytest.mark.parametrize("d", [20, 70])
def test_split_score_operands_match_the_clouds_themselves(monkeypatch, name, d):
    """The product form reads the clouds split once into half parts (PRESPLIT) while they
    fit the cap, the clouds themselves past it: both within float32 tiles' error of the
    float64 soft-minimum and gradients, and of each other."""
    from flashot.backends.triton import _operands, _pair_operands

    x, y, h = _data(7, 37, 29, d, zeros=True, twins=True)
    cot = torch.randn(37, generator=torch.Generator().manual_seed(4))
    cost = COSTS[name]
    ref = _grads(x.double(), y.double(), h.double(), 0.5, cost, "torch", cot.double())
    f32 = _grads(x, y, h, 0.5, cost, "torch", cot)
    split = _grads(x, y, h, 0.5, cost, "triton", cot)
    monkeypatch.setattr(_operands, "PRESPLIT_MAX_BYTES", 0)
    whole = _grads(x, y, h, 0.5, cost, "triton", cot)
    assert _pair_operands.score_operands(x.contiguous(), y.contiguous(), False)[1] is False
    for a, b, r, t in zip((split[0], *split[1]), (whole[0], *whole[1]), (ref[0], *ref[1]),
                          (f32[0], *f32[1]), strict=True):  # fmt: skip
        bound = 4 * _rel(t, r) + 2e-6
        errors = (_rel(a, r), _rel(b, r), _rel(a, b), bound)  # (split, whole, between; bound)
        assert errors[0] <= bound and errors[1] <= bound and errors[2] <= 2 * bound, errors
