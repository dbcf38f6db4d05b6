"""Triton-specific paths (column splits, feature chunks, the one-exp fast path), run in
Triton's interpreter on CPU and natively on a GPU."""

import itertools
import math
import weakref

import pytest
import torch

import flashot
from flashot.backends import available_backends
from flashot.backends.dual import Potentials
from flashot.geometry.costs import attention_form, get_cost
from tests.backends.test_base import dense_attend, problem
from tests.conftest import clouds, cuda_clouds, nan_rows, rel, triton_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def nan_padded(form):
    """The same form with q and k as strided views of buffers holding NaN past column d
    and in the rows past their ends (a load must neither ignore d nor read past the last
    row: the kernels clamp tail rows instead of masking them)."""
    d = form.q.shape[1]
    views = []
    for t in (form.q, form.k):
        buf = torch.full((len(t) + 16, d + 16), math.nan, device=t.device)
        buf[: len(t), :d] = t
        views.append(buf[: len(t), :d])
    return type(form)(*views, form.alpha, form.beta)


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize(
    "n,m,d,p",
    [(1, 37, 3, 1), (40, 300, 5, 20), (9, 50, 37, 3), (3, 20, 1000, 2), (9, 40, 7, 300),
     (20, 70, 16, 5), (70, 40, 3, 130)],
)  # fmt: skip
def test_row_attend_splits_chunks_and_value_tiles(gen, splits, n, m, d, p):
    """Whole and partial column tiles, feature chunks, value chunks; NaN beyond the
    features (strided views) catches a load that ignores d."""
    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    form = nan_padded(form)
    v = nan_rows(torch.randn(m, p, generator=gen).to(DEVICE))
    lse, out = triton_backend(splits=splits).row_attend(form, h, 0.4, v)
    ref_lse, ref_out = dense_attend(form, h, 0.4, v)
    assert rel(lse.cpu(), ref_lse.cpu()) < 2e-5 and rel(out.cpu(), ref_out.cpu()) < 2e-5


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("n,m,d,p", [(40, 300, 5, 40), (9, 520, 37, 33), (70, 40, 3, 130)])
def test_looped_value_chunks_match_a_program_per_chunk(gen, monkeypatch, splits, n, m, d, p):
    """VALUE_LOOP_FROM: one program loops over every value chunk with its running products
    in the output (or its split's partials), each tile's weights computed once; the LSE
    and the average agree with the dense reference and with a program per chunk."""
    from flashot.backends.triton import _configs

    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    form = nan_padded(form)
    v = nan_rows(torch.randn(m, p, generator=gen).to(DEVICE))
    # chunks of 16 on every device (a GPU takes up to VALUE_TILE_CAP: one chunk of 40)
    monkeypatch.setattr(_configs, "VALUE_TILE_CAP", 16)
    chunked = triton_backend(splits=splits).row_attend(form, h, 0.4, v)
    monkeypatch.setattr(_configs, "VALUE_LOOP_FROM", 1)
    assert _configs.value_loop(p) == math.ceil(p / _configs.block_p(p)) > 1
    lse, out = triton_backend(splits=splits).row_attend(form, h, 0.4, v)
    ref_lse, ref_out = dense_attend(form, h, 0.4, v)
    assert rel(lse.cpu(), ref_lse.cpu()) < 2e-5 and rel(out.cpu(), ref_out.cpu()) < 2e-5
    assert torch.allclose(out, chunked[1], rtol=1e-5, atol=1e-6) and torch.equal(lse, chunked[0])


def test_split_merge_of_wide_values_runs_in_bounded_tiles(gen, monkeypatch):
    """The merge of column-split partials takes its values in chunks of COMBINE_TILE:
    one program over all 784 columns of a flow's barycenters (a (128, 1024) tile) took
    Triton 3.6 over 70 s to compile for sm_90, on every first flow step."""
    from flashot.backends.triton import _attend as tb

    n, m, d, p = 70, 300, 3, 784 if DEVICE == "cuda" else 130
    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    v = torch.randn(m, p, generator=gen).to(DEVICE)
    real, launches = tb._combine_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs["BLOCK"], kwargs["BLOCK_P"]))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(tb, "_combine_kernel", Spy())
    lse, out = triton_backend(splits=2).row_attend(form, h, 0.4, v)
    ref_lse, ref_out = dense_attend(form, h, 0.4, v)
    assert rel(lse.cpu(), ref_lse.cpu()) < 2e-5 and rel(out.cpu(), ref_out.cpu()) < 2e-5
    ((grid, rows, cols),) = launches
    assert rows * cols <= math.prod(tb.COMBINE_TILE)
    assert grid == (-(-n // rows), -(-p // cols))  # every row and value column merged


def test_value_partials_stay_within_their_budget(gen, monkeypatch):
    """Each split of a pass with values holds an (n, p) partial: no more of them than
    VALUE_PARTIALS floats (a 60k flow's 794-wide barycenters take no split; two splits
    were two more copies of the output), the same result."""
    from flashot.backends.triton import _attend, _configs, _launch

    monkeypatch.setattr(_configs, "column_splits", lambda *args: 8)  # untuned: 8 splits
    n, m, d, p = 20, 1024, 5, 6
    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    v = torch.randn(m, p, generator=gen).to(DEVICE)
    ref = dense_attend(form, h, 0.4, v)[1].cpu()
    backend, made = triton_backend(), []
    split = _launch.splits_for

    def recorded(*args, **kwargs):
        made.append(split(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_launch, "splits_for", recorded)
    for budget, most in ((1 << 24, 8), (3 * n * p, 3), (n * p - 1, 1)):
        monkeypatch.setattr(_attend, "VALUE_PARTIALS", budget)
        made.clear()
        _, out = backend.row_attend(form, h, 0.4, v)
        assert rel(out.cpu(), ref) < 2e-5
        splits = max(s for s, _ in made)
        assert splits == most if DEVICE == "cpu" else splits <= most


def test_non_contiguous_inputs(gen):
    form, h = problem(gen, 30, 40, 6, torch.float32, DEVICE)
    qt = form.q.T.contiguous().T  # same values, column-major strides
    kt = torch.stack([form.k, form.k], 2)[..., 0]  # stride (2d, 2)
    strided = type(form)(qt, kt, form.alpha, form.beta)
    assert not kt.is_contiguous()
    lse, _ = triton_backend().row_attend(strided, h, 0.3)
    assert rel(lse.cpu(), dense_attend(form, h, 0.3, None)[0].cpu()) < 2e-5


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("n,m,d", [(33, 45, 4), (32, 20, 16), (7, 30, 16), (40, 19, 40)])
def test_plan_sums_match_dense(gen, splits, n, m, d):
    """Whole row tiles, a partial last tile, both, and feature chunks; NaN
    beyond the features (a strided view) catches a load that ignores d."""
    form = nan_padded(problem(gen, n, m, d, torch.float32, DEVICE)[0])
    f, g = torch.randn(n, generator=gen).to(DEVICE), torch.randn(m, generator=gen).to(DEVICE)
    a, b = torch.rand(n, generator=gen).to(DEVICE), torch.rand(m, generator=gen).to(DEVICE)
    a[3] = 0.0
    r, c = triton_backend(splits=splits).plan_sums(Potentials(form, f, g, a.log(), b.log(), 0.7))
    E = torch.exp((f.double()[:, None] + g.double()[None] - form.dense().double()) / 0.7)
    assert rel(r.cpu(), (E @ b.double()).cpu()) < 2e-5
    assert rel(c.cpu(), (a.double() @ E).cpu()) < 2e-5


def test_plan_sums_gate_skips_the_pass_and_clears_the_next_slot(gen):
    form, _ = problem(gen, 33, 45, 4, torch.float32, DEVICE)
    f, g = torch.zeros(33, device=DEVICE), torch.zeros(45, device=DEVICE)
    la, lb = torch.full((33,), -math.log(33)), torch.full((45,), -math.log(45))
    be = triton_backend()
    # (largest ln R, largest −ln R), the bound: their larger, or half their sum (span)
    for limit_hit, gate_in, span in (
        (True, (math.inf, 0.0), False),
        (False, (3.0, 1.0), False),
        (True, (1.0, 9.0), False),
        (False, (1.0, 9.0), True),
        (True, (1.0, 11.0), True),
    ):
        gate_in_t = torch.tensor(gate_in, device=DEVICE)
        gate_out = torch.tensor([7.0, 7.0], device=DEVICE)
        gate = (gate_in_t, gate_out)
        r, c = be.plan_sums(
            Potentials(form, f, g, la.to(DEVICE), lb.to(DEVICE), 0.7), gate, 5.0, span
        )
        assert gate_out.tolist() == [0.0, 0.0]
        assert (float(r.abs().sum()) == 0.0) == limit_hit
        assert (float(c.abs().sum()) == 0.0) == limit_hit


def test_plan_sums_shift_scales_the_sums(gen):
    form, _ = problem(gen, 33, 45, 4, torch.float32, DEVICE)
    f, g = torch.randn(33, generator=gen).to(DEVICE), torch.randn(45, generator=gen).to(DEVICE)
    la, lb = torch.full((33,), -math.log(33)), torch.full((45,), -math.log(45))
    be = triton_backend()
    plain = be.plan_sums(Potentials(form, f, g, la.to(DEVICE), lb.to(DEVICE), 0.7))
    shifted = be.plan_sums(Potentials(form, f, g, la.to(DEVICE), lb.to(DEVICE), 0.7), shift=18.0)
    for p, s in zip(plain, shifted, strict=True):
        assert rel(s, p * 2.0**18) < 1e-6


def _step_setup(gen, rho, n=40, m=30, eps=0.3):
    x, y = clouds(gen, n, m, 3, dtype=torch.float32)
    res = flashot.sinkhorn(
        x, y, eps=eps, tol=1e-3, backend="torch", rho=rho[0] if rho[0] == rho[1] else rho
    )
    form = attention_form(get_cost("sqeuclidean"), x.to(DEVICE), y.to(DEVICE)).detach()
    la, lb = torch.full((n,), -math.log(n)), torch.full((m,), -math.log(m))
    lam = tuple(1.0 if r is None else r / (r + eps) for r in rho)
    return form, res.f.to(DEVICE), res.g.to(DEVICE), la.to(DEVICE), lb.to(DEVICE), eps, lam


@pytest.mark.parametrize("rho", [(None, None), (0.5, 0.5), (0.5, None)])
def test_fast_jacobi_step_matches_exact_step(gen, rho):
    form, f, g, la, lb, eps, lam = _step_setup(gen, rho)
    be = triton_backend()
    args = (Potentials(form, f, g, la, lb, eps), lam, rho)
    exact = be.jacobi_step(*args, check=True)
    state = be.fast_state(f.device)
    fast = be.jacobi_step(*args, check=True, state=state)  # gate starts closed: exact
    again = be.jacobi_step(*args, check=True, state=state)  # now fused
    r, c = be.plan_sums(Potentials(form, f, g, la, lb, eps))
    assert (r > be.valid_range(30)[0]).all() and (c > be.valid_range(40)[0]).all()
    for out in (fast, again):
        assert rel(out[0], exact[0]) < 1e-5 and rel(out[1], exact[1]) < 1e-5
        # the error is a sum of small differences: compare it absolutely, to 16 ulps of
        # the mass it sums over (2): the fused sums round differently by a few ulps each
        assert abs(float(out[2]) - float(exact[2])) < 32 * 2.0**-24 < float(exact[2])
    # the gate now holds the step's largest ln R, ln C and −ln R, −ln C (from 0)
    logs = torch.cat([r.log(), c.log()])
    top, bottom = max(0.0, float(logs.max())), max(0.0, float(-logs.min()))
    written = state.slots[2 * state.parity : 2 * state.parity + 2].tolist()
    # logs of float32 sums of about 1, each side within 32 ulps (as the error above)
    assert written == pytest.approx([top, bottom], rel=1e-4, abs=64 * 2.0**-24)


def test_averaged_step_keeps_residuals_within_half_their_span(gen):
    """The gate's bound, in float64: after f' = f − ½ε ln R, g' = g − ½ε ln C, every
    |ln R'|, |ln C'| is at most half the span of the old ln R, ln C (far potentials)."""
    n, m, eps = 60, 50, 0.2
    x, y = clouds(gen, n, m, 3, dtype=torch.float64)
    cost = torch.cdist(x, y) ** 2
    la = torch.log(torch.rand(n, generator=gen, dtype=torch.float64) + 0.1)
    lb = torch.log(torch.rand(m, generator=gen, dtype=torch.float64) + 0.1)
    la, lb = la - la.logsumexp(0), lb - lb.logsumexp(0)
    f = 3.0 * torch.randn(n, generator=gen, dtype=torch.float64)
    g = 3.0 * torch.randn(m, generator=gen, dtype=torch.float64)

    def residuals(f, g):
        z = (f[:, None] + g[None, :] - cost) / eps
        return (z + lb).logsumexp(1), (z + la[:, None]).logsumexp(0)

    for _ in range(6):
        ln_r, ln_c = residuals(f, g)
        logs = torch.cat([ln_r, ln_c])
        half_span = 0.5 * float(logs.max() - logs.min())
        f, g = f - 0.5 * eps * ln_r, g - 0.5 * eps * ln_c
        new = torch.cat(residuals(f, g))
        assert float(new.abs().max()) <= half_span * (1 + 1e-9)
        assert float(new.abs().max()) > 0.2 * half_span  # and not a loose bound here


def test_balanced_solve_runs_only_fused_passes_that_need_no_repair(gen, monkeypatch):
    """The span bound is rigorous for balanced steps: a fused pass that the gate lets
    run has every sum inside its window (shifted by SUM_SHIFT)."""
    from flashot.backends.triton import TritonBackend
    from flashot.backends.triton._step import SUM_SHIFT

    runs = []
    plan_sums = TritonBackend.plan_sums

    def spy(self, *args, **kw):
        r, c = plan_sums(self, *args, **kw)
        if (r != 0).any():
            lo_r, hi = self.valid_range(len(c))
            lo_c, _ = self.valid_range(len(r))
            runs.append(bool(((r > lo_r) & (r < hi)).all() & ((c > lo_c) & (c < hi)).all()))
        return r, c

    monkeypatch.setattr(TritonBackend, "plan_sums", spy)
    # residual ranges of the states (float64): 335…1144, −169…1, −84…1, −42…1, …
    x, y = clouds(gen, 40, 30, 8, dtype=torch.float32)
    y = y + 1.0
    kw = dict(eps=0.01, max_iter=12, tol=None)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), backend="triton", **kw)
    assert SUM_SHIFT > 0 and len(runs) > 3 and all(runs)
    assert rel(res.cost.cpu(), ref.cost) < 1e-5


def test_probe_writes_the_sampled_residual_extremes(gen, monkeypatch):
    from flashot.backends.triton import _step

    monkeypatch.setattr(_step, "PROBE_ROWS", 8)
    form, f, g, la, lb, eps, _ = _step_setup(gen, (None, None))
    f, g = f + 0.3 * torch.randn(40, generator=gen).to(DEVICE), g - 0.2
    slot = torch.full((2,), -1.0, device=DEVICE)
    _step.probe(triton_backend(), Potentials(form, f, g, la, lb, eps), slot)
    z = (f.double()[:, None] + g.double()[None, :] - form.dense().double()) / eps
    ln_r, ln_c = (z + lb.double()).logsumexp(1)[::5], (z + la.double()[:, None]).logsumexp(0)[::3]
    logs = torch.cat([ln_r, ln_c])  # rows 0, 5, …, 35 of 40; columns 0, 3, …, 27 of 30
    margin = _step.PROBE_MARGIN
    want = [max(0.0, float(logs.max())) * margin, max(0.0, float(-logs.min())) * margin]
    assert slot.tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert want[1] > 1.0  # the shift made the residuals negative: a real check


def test_packed_probe_samples_each_problem_against_its_own_columns(gen, monkeypatch):
    """A packed batch's probe: every problem's sampled rows (and columns) against its own
    block only, as the float64 block-diagonal residuals of those rows say."""
    from flashot.backends import triton as backend
    from flashot.backends.triton import _step
    from flashot.batched import sinkhorn_varlen

    monkeypatch.setattr(_step, "PROBE_ROWS", 8)
    monkeypatch.setattr(_step, "PROBE_FROM", 16)
    seen = []
    probe = _step.probe

    def spy(be, pot, slot):
        probe(be, pot, slot)
        seen.append((pot.form, pot.f.clone(), pot.g.clone(), pot.log_a, pot.log_b, pot.eps,
                     slot.clone()))  # fmt: skip

    monkeypatch.setattr(_step, "probe", spy)
    sizes = [(30, 20), (5, 19), (27, 24)]  # rows 0, 7, …; a small problem; blocks cut mid
    xs = [torch.randn(n, 4, generator=gen) for n, _ in sizes]
    ys = [torch.randn(m, 4, generator=gen) + 2.0 * s for s, (_, m) in enumerate(sizes)]
    offsets = [torch.tensor([0, *itertools.accumulate(len(t) for t in ts)]) for ts in (xs, ys)]
    sinkhorn_varlen(torch.cat(xs).to(DEVICE), torch.cat(ys).to(DEVICE), *offsets, eps=0.05,
                    tol=None, max_iter=3, backend=backend.TritonBackend(graphs=False))  # fmt: skip
    assert len(seen) == 1
    form, f, g, la, lb, eps, slot = seen[0]
    z = (f.double()[:, None] + g.double()[None, :] - form.dense().double()) / eps
    ln_r = (z + lb.double()).logsumexp(1)
    ln_c = (z + la.double()[:, None]).logsumexp(0)
    rows = torch.cat([torch.arange(a, b, 62 // 8) for a, b in itertools.pairwise(offsets[0])])
    cols = torch.cat([torch.arange(a, b, 63 // 8) for a, b in itertools.pairwise(offsets[1])])
    logs = torch.cat([ln_r[rows], ln_c[cols]])
    margin = _step.PROBE_MARGIN
    want = [max(0.0, float(logs.max())) * margin, max(0.0, float(-logs.min())) * margin]
    assert slot.tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert max(want) > 1.0  # far from the window: a real check


@pytest.mark.slow
def test_packed_launches_split_like_one_problems_launches(gen, monkeypatch):
    """A packed batch's attend (columns) and plan-sums (rows) launches split their moving
    side as a single problem's do, cut by the widest problem (a narrower problem's
    programs past its end stream nothing): the same potentials and costs as the float64
    solve, with both kernels launched split. Forward and gradient."""
    from flashot.backends import triton as backend
    from flashot.backends.triton import _launch
    from flashot.batched import sinkhorn_varlen

    made = []
    split = _launch.splits_for

    def spy(op, *args, **kw):
        out = split(op, *args, **kw)
        raw = op.kernel
        made.append((raw.fn.__name__ if hasattr(raw, "fn") else raw.__name__, out[0]))
        return out

    monkeypatch.setattr(_launch, "splits_for", spy)
    sizes = [(290, 300), (40, 150), (140, 20)]  # the widest and the tallest: 3 splits
    xs = [torch.randn(n, 3, generator=gen) for n, _ in sizes]
    ys = [torch.randn(m, 3, generator=gen) + 0.5 for _, m in sizes]
    offsets = [torch.tensor([0, *itertools.accumulate(len(t) for t in ts)]) for ts in (xs, ys)]
    x, y = torch.cat(xs), torch.cat(ys)
    kw = dict(eps=0.1, max_iter=8, tol=None, update="symmetric")
    x64 = x.double().requires_grad_()
    ref = sinkhorn_varlen(x64, y.double(), *offsets, backend="torch", **kw)
    (ref_grad,) = torch.autograd.grad(ref.cost.sum(), x64)
    x32 = x.to(DEVICE).requires_grad_()
    res = sinkhorn_varlen(x32, y.to(DEVICE), *offsets,
                          backend=backend.TritonBackend(splits=3, graphs=False), **kw)  # fmt: skip
    (grad,) = torch.autograd.grad(res.cost.sum(), x32)
    assert ("_attend_kernel", 3) in made and ("_plan_sums_kernel", 3) in made
    assert torch.allclose(res.cost.cpu().double(), ref.cost.detach(), rtol=1e-5, atol=1e-6)
    assert rel(res.f.cpu().double(), ref.f.detach()) < 1e-5
    assert rel(grad.cpu().double(), ref_grad) < 1e-4


def _fused_steps(monkeypatch, probe):
    """Probes on (on 16+ points, 8 rows) or off; the list that records, per plan-sums
    pass, whether its sums ran fused (any nonzero)."""
    from flashot.backends import triton as backend
    from flashot.backends.triton import _step

    monkeypatch.setattr(_step, "PROBE_ROWS", 8)
    monkeypatch.setattr(_step, "PROBE_FROM", 16 if probe else 10**9)
    ran = []
    plan_sums = backend.TritonBackend.plan_sums

    def spy(self, *args, **kw):
        r, c = plan_sums(self, *args, **kw)
        ran.append(bool((r != 0).any()))
        return r, c

    monkeypatch.setattr(backend.TritonBackend, "plan_sums", spy)
    return ran


@pytest.mark.parametrize("probe", [True, False])
def test_packed_second_step_runs_fused_when_the_probe_finds_the_window(gen, monkeypatch, probe):
    """As for one problem (below): a packed batch's second step runs fused once its probe
    finds the window (it stayed exact before packed forms had a probe), same answers."""
    from flashot.backends import triton as backend
    from flashot.batched import sinkhorn_varlen

    ran = _fused_steps(monkeypatch, probe)
    sizes = [(40, 30), (25, 33)]
    xs = [torch.randn(n, 3, generator=gen) for n, _ in sizes]
    ys = [torch.randn(m, 3, generator=gen) + 1.0 for _, m in sizes]
    offsets = [torch.tensor([0, *itertools.accumulate(len(t) for t in ts)]) for ts in (xs, ys)]
    x, y = torch.cat(xs), torch.cat(ys)
    kw = dict(eps=0.01, max_iter=6, tol=None, update="symmetric")
    ref = sinkhorn_varlen(x.double(), y.double(), *offsets, backend="torch", **kw)
    res = sinkhorn_varlen(x.to(DEVICE), y.to(DEVICE), *offsets,
                          backend=backend.TritonBackend(graphs=False), **kw)  # fmt: skip
    assert ran[:3] == [False, probe, True]
    assert torch.allclose(res.cost.cpu().double(), ref.cost, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("probe", [True, False])
def test_second_step_runs_fused_when_the_probe_finds_the_window(gen, monkeypatch, probe):
    """After the initialization the span bound exceeds the sums' window here (the
    second step stays exact without the probe); the sampled estimate finds state 1
    inside it and the second step runs fused, with the same answer."""
    from flashot.backends import triton as backend

    ran = _fused_steps(monkeypatch, probe)
    x, y = clouds(gen, 40, 30, 3, dtype=torch.float32)
    y = y + 1.0
    kw = dict(eps=0.02, max_iter=6, tol=None)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    # no CUDA graph: the spy reads its sums on the host, which a capture forbids
    be = backend.TritonBackend(graphs=False)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), backend=be, **kw)
    assert ran[:3] == [False, probe, True]
    assert rel(res.cost.cpu(), ref.cost) < 1e-5


def test_gate_limit_follows_eps_scaling(gen, monkeypatch):
    """|ln R| scales as 1/ε: after ε drops 4x, a gate value of 50 nats predicts 200."""
    from flashot.backends.triton import TritonBackend

    form, f, g, la, lb, eps, lam = _step_setup(gen, (None, None))
    ran = []
    plan_sums = TritonBackend.plan_sums

    def spy(self, *args, **kw):
        r, c = plan_sums(self, *args, **kw)
        ran.append(bool((r != 0).any()))
        return r, c

    monkeypatch.setattr(TritonBackend, "plan_sums", spy)
    be = triton_backend()
    state = be.fast_state(f.device)
    for step_eps in (eps, eps / 4):
        state.slots.fill_(50.0)
        be.jacobi_step(Potentials(form, f, g, la, lb, step_eps), lam, (None, None), state=state)
    assert ran == [True, False]


def test_out_of_range_rows_and_columns_are_repaired_exactly(gen):
    form, f, g, la, lb, eps, lam = _step_setup(gen, (None, None))
    f, g = f.clone(), g.clone()
    f[[3, 17]] += 60.0  # these rows' sums overflow, and every column sum with them
    g[5] -= 60.0  # this column's sum underflows
    be = triton_backend()
    r, c = be.plan_sums(Potentials(form, f, g, la, lb, eps))
    lo_r, hi = be.valid_range(30)
    bad = ~((r > lo_r) & (r < hi))
    assert bad[[3, 17]].all() and bad.sum() == 2
    assert not ((c > be.valid_range(40)[0]) & (c < hi)).all()
    args = (Potentials(form, f, g, la, lb, eps), lam, (None, None))
    exact = be.jacobi_step(*args, check=True)
    state = be.fast_state(f.device)
    state.slots.zero_()  # open the gate at once
    fast = be.jacobi_step(*args, check=True, state=state)
    assert rel(fast[0], exact[0]) < 1e-5 and rel(fast[1], exact[1]) < 1e-5
    assert float(fast[2]) == float(exact[2]) == math.inf  # e^200 mass: float32 overflows
    # the residual gate saw the far rows (ln R ≈ 60/ε)
    top, _ = state.slots[2 * state.parity : 2 * state.parity + 2].tolist()
    assert top > 60.0 / eps * 0.9


@pytest.mark.parametrize("fused", [True, False])
def test_extrapolate_and_marginals_match_the_torch_backend(gen, fused):
    from flashot.backends.torch_backend import TorchBackend

    form, f, g, la, lb, eps, _ = _step_setup(gen, (None, None))
    f, g = f.clone(), g.clone()
    # sums out of the fused range (e^85, e^-83) yet finite: repaired, then compared
    f[4] += 85.5 * eps
    g[5] -= 83.0 * eps
    be, ref = triton_backend(fused=fused), TorchBackend()
    # exponents reach 86 nats, where one float32 ulp of the exponent is 86·2^-24 of
    # the sum: allow 8 such ulps (the GPU's scores round differently from the CPU's)
    tol = 8 * 86 * 2.0**-24
    ours = be.extrapolate(Potentials(form, f, g, la, lb, eps), (0.9, 0.8))
    want = ref.extrapolate(Potentials(form, f, g, la, lb, eps), (0.9, 0.8))
    assert rel(ours[0], want[0]) < 1e-5 and rel(ours[1], want[1]) < 1e-5
    ours = be.marginals(Potentials(form, f, g, la, lb, eps))
    want = ref.marginals(Potentials(form, f, g, la, lb, eps))
    assert rel(ours[0], want[0]) < tol and rel(ours[1], want[1]) < tol


@pytest.mark.parametrize("update", ["symmetric", "alternating"])
@pytest.mark.parametrize("rho", [None, 0.7])
def test_solver_on_triton_matches_torch(gen, update, rho):
    x, y = clouds(gen, 30, 24, 3, dtype=torch.float32)
    kw = dict(eps=0.5, tol=1e-4, rho=rho, update=update, max_iter=2000)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), backend="triton", **kw)
    assert res.converged and rel(res.cost.cpu(), ref.cost) < 1e-5


@pytest.mark.slow
def test_fast_path_recovers_from_a_far_warm_start(gen, monkeypatch):
    """A warm start far from the fixed point: the gate keeps the first steps exact, the
    fused pass takes over once the residual is small, and the answer is the torch one."""
    from flashot.backends.triton import TritonBackend

    fused = []
    plan_sums = TritonBackend.plan_sums

    def counted(self, *args, **kw):
        r, c = plan_sums(self, *args, **kw)
        fused.append(bool((r > 0).all()))
        return r, c

    monkeypatch.setattr(TritonBackend, "plan_sums", counted)
    x, y = clouds(gen, 20, 20, 2, dtype=torch.float32)
    init = (torch.full((20,), 40.0), torch.full((20,), 40.0))
    kw = dict(eps=0.5, tol=1e-4, check_every=5, init=init, update="symmetric")
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    kw["init"] = tuple(t.to(DEVICE) for t in init)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), backend="triton", **kw)
    assert not fused[0] and sum(fused) > 5  # gated off at first, then fused
    assert res.converged and rel(res.cost.cpu(), ref.cost) < 1e-5


def test_gradients_on_triton_match_torch(gen):
    x, y = clouds(gen, 25, 20, 4, dtype=torch.float32)
    grads = []
    for backend, dev in (("torch", "cpu"), ("triton", DEVICE)):
        xs, ys = x.to(dev).requires_grad_(), y.to(dev).requires_grad_()
        cost = flashot.sinkhorn(xs, ys, eps=0.3, tol=1e-5, backend=backend).cost
        grads.append([t.cpu() for t in torch.autograd.grad(cost, [xs, ys])])
    for g_t, g_r in zip(grads[1], grads[0], strict=True):
        assert rel(g_t, g_r) < 1e-4


def test_features_past_4096_solve_like_float64(gen):
    """d = 4099: 65 feature chunks per tile, the last one partial. (The gradient's
    value chunks times feature chunks are too slow for the interpreter at this d; the
    value chunks are tested at p = 300 above.)"""
    d = 4099
    x, y = clouds(gen, 4, 6, d)
    kw = dict(eps=0.5 * d, tol=None, max_iter=5)
    ref = flashot.sinkhorn(x, y, backend="torch", **kw)
    res = flashot.sinkhorn(x.float().to(DEVICE), y.float().to(DEVICE), backend="triton", **kw)
    assert rel(res.cost.cpu().double(), ref.cost) < 1e-5
    assert rel(res.f.cpu().double(), ref.f) < 1e-5


def test_samples_loss_on_triton_matches_torch(gen):
    x, y = clouds(gen, 40, 30, 3, dtype=torch.float32)
    ref = flashot.SamplesLoss(blur=0.1, backend="torch")(x, y)
    out = flashot.SamplesLoss(blur=0.1, backend="triton")(x.to(DEVICE), y.to(DEVICE))
    assert rel(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("precision,lo,hi", [("bf16", 1e-4, 3e-2), ("fp16", 1e-5, 5e-3)])
def test_half_precision_modes(gen, precision, lo, hi):
    form, h = problem(gen, 40, 50, 8, torch.float32, DEVICE)
    lse, _ = triton_backend(precision=precision).row_attend(form, h, 1.0)
    err = rel(lse.cpu(), dense_attend(form, h, 1.0, None)[0].cpu())
    assert lo < err < hi


def test_float64_is_refused_with_a_clear_error(gen):
    x, y = clouds(gen, 5, 5, 2)
    with pytest.raises(ValueError, match="float64"):
        flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), eps=0.5, backend="triton")


def test_half_operand_cache_never_serves_another_tensor(gen):
    """Two tensor objects at one address and one version (as after a free and reuse):
    the cached bf16 copy of the first must not be served for the second."""
    be = triton_backend(precision="bf16")
    storage = torch.randn(64 * 4, generator=gen).to(DEVICE).untyped_storage()

    def view():
        return torch.empty(0, device=DEVICE).set_(storage, 0, (64, 4), (4, 1))

    q1 = view()
    first = be.operands.operand(q1).float().clone()
    view().copy_(torch.randn(64, 4, generator=gen))  # new data; q1's version is untouched
    q2 = view()
    assert q2._version == q1._version and q2.data_ptr() == q1.data_ptr()
    again = be.operands.operand(q2).float()
    assert torch.equal(again, q2.to(torch.bfloat16).float())
    assert not torch.equal(again, first)


def test_half_operand_copies_die_with_their_sources(gen):
    """A result keeps its backend (lazy plans), and with it the operand cache: a copy
    must not outlive its source (v59: OTDD's bf16 results held 184 MiB of dead q, k
    copies each)."""
    be = triton_backend(precision="bf16")
    q = torch.randn(64, 4, generator=gen, dtype=torch.float32).to(DEVICE)
    copy = weakref.ref(be.operands.operand(q))
    assert copy() is not None and len(be.operands.cache) == 1  # cached while q lives
    del q
    assert copy() is None and be.operands.cache == []
    x, y = clouds(gen, 24, 20, 3, dtype=torch.float32)
    res = flashot.sinkhorn(x.to(DEVICE), y.to(DEVICE), eps=0.5, backend=be)
    assert res.plan._backend is be and be.operands.cache == []  # the form's operands died


def test_exact_range_of_sums_scales_with_the_largest_weight():
    """A term w_j E_ij with a large weight may matter while E_ij itself underflows
    (flushed to zero on GPUs): the lower end of the exact range grows with max w."""
    be = triton_backend()
    la = torch.log(torch.tensor([1e-3, 2.0, 0.5]))
    lb = torch.log(torch.tensor([2.0**20, 1.0]))
    from flashot.backends.triton._gate import sum_ranges

    lo, hi = sum_ranges(la.to(DEVICE), lb.to(DEVICE))
    assert lo.device.type == DEVICE  # computed where the kernels read it: nothing waits
    lo_r, lo_c = lo.tolist()
    assert lo_r == pytest.approx(2 * 2.0**20 * 2.0**-100)
    assert lo_c == pytest.approx(3 * 2.0 * 2.0**-100)
    assert be.valid_range(3, 0.25) == be.valid_range(3)  # weights below 1 cannot hurt
    assert hi == 2.0**120


class _FakeAutotuner:
    """Stands in for ``triton.autotune``'s object: ranks four tile shapes."""

    def __init__(self, configs, timings, cached=False):
        self.cache = {"key": configs[0]} if cached else {}
        self.configs_timings = timings
        self.best_config = min(timings, key=timings.get)
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.cache["key"] = self.best_config
            self.launches.append(kwargs)

        return run


class _FakeKernel:
    def __init__(self):
        self.block_m, self.arg_names = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.block_m.append(kwargs["BLOCK_M"])


@pytest.mark.parametrize("cached", [False, True])
def test_tuning_times_the_finalists_again_at_their_own_splits(monkeypatch, cached):
    """The autotuner ranks tiles at the first-guess split count; the fastest three are
    then timed at their own balanced splits, and the winner is what later calls run."""
    import triton

    from flashot.backends.triton import _launch

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": 64}) for bm in (16, 32, 64, 128)]
    first = dict(zip(configs, ([3.0], [1.0], [2.0], [1.5]), strict=True))  # 32 < 128 < 64 < 16
    again = {16: 0.1, 32: 1.2, 64: 1.1, 128: 0.9}  # balanced: 128 wins (16 is no finalist)
    tuned, raw, resets = _FakeAutotuner(configs, first, cached), _FakeKernel(), []
    monkeypatch.setattr(_launch, "_BEST", {})
    monkeypatch.setattr(_launch, "_RETIMED", {})
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or again[raw.block_m[-1]])

    class Op(_launch.Launch):
        kernel, autotuned, key, full = raw, tuned, ("k",), {"FULL": True}

        def sizes(self, tiles):
            return 1, 1, None

        def plan(self, splits, per, tiles, probe=False):
            at = None if tiles is None else tiles.kwargs["BLOCK_M"]
            return _launch.Plan(lambda meta: (1,), {}, {"SPLITS": at})

        def reset(self):
            resets.append(1)

    cpu = torch.device("cpu")
    plan = _launch.launch(Op(), None, cpu)
    assert tuned.launches == [{"SPLITS": None, "FULL": True}]  # tuned at the first guess
    winner = 32 if cached else 128  # a cached ranking (no new timings) is kept as it is
    assert _launch._BEST[("k",)].kwargs["BLOCK_M"] == winner
    assert raw.block_m == ([] if cached else [32, 128, 64]) + [winner]  # retimed, then run
    assert plan.consts["SPLITS"] == winner and resets == [1]
    # a later call that finds the ranking kept (no new timings) takes the retimed winner
    _launch._BEST.clear()
    _launch.launch(Op(), None, cpu)
    assert _launch._BEST[("k",)].kwargs["BLOCK_M"] == winner


@pytest.mark.parametrize(
    "kwargs,error,match",
    [(dict(splits=0), ValueError, "splits"), (dict(splits=-1), ValueError, "splits"),
     (dict(splits=2.5), ValueError, "splits"), (dict(splits=True), ValueError, "splits"),
     (dict(fused="yes"), TypeError, "fused"), (dict(autotune=1), TypeError, "autotune"),
     (dict(graphs=None), TypeError, "graphs"), (dict(precision="fp8"), ValueError, "precision")],
)  # fmt: skip
def test_constructor_arguments_are_checked_and_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        triton_backend(**kwargs)
    assert triton_backend(splits=3).splits == 3


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cold_start_fast_path_equals_exact_path(precision):
    """ε = 0.1 at d = 64 from a cold start: the first steps overflow the fused pass
    (gated off or repaired), later ones use it; the iterates must equal the exact ones."""
    x, y = cuda_clouds(8192, 6000, 64)
    kw = dict(eps=0.1, max_iter=10, tol=None)
    fast = flashot.sinkhorn(x, y, backend=triton_backend(precision, autotune=False), **kw)
    exact = triton_backend(precision, fused=False, autotune=False)
    ref = flashot.sinkhorn(x, y, backend=exact, **kw)
    assert rel(fast.f, ref.f) < 1e-5 and rel(fast.g, ref.g) < 1e-5
    assert rel(fast.cost, ref.cost) < 1e-6


@pytest.mark.gpu
def test_gate_views_at_any_offset_share_one_compiled_kernel():
    """A fused pass's gates are views of a small state buffer at various offsets; the
    kernel is not compiled again per offset (CONTROL_POINTERS: the GeomLoss call's first
    call built one set of constexprs three times)."""
    from flashot.backends.triton import _plan_sums
    from flashot.geometry.costs import attention_form, get_cost

    be = triton_backend("fp32", autotune=False)
    x, y = cuda_clouds(512, 384, 8)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    f, g = torch.zeros(512, device="cuda"), torch.zeros(384, device="cuda")
    la, lb = torch.full_like(f, -math.log(512)), torch.full_like(g, -math.log(384))
    buf = torch.zeros(16, device="cuda")

    def builds():
        return sum(len(cache[0]) for cache in _plan_sums._plan_sums_kernel.device_caches.values())

    sums = [be.plan_sums(Potentials(form, f, g, la, lb, 1.0), gate=(buf[0:2], buf[2:4]))]
    before = builds()
    for off in (2, 4, 6, 1, 3):  # 8-, 16- and 4-byte aligned views
        buf.zero_()
        sums.append(
            be.plan_sums(
                Potentials(form, f, g, la, lb, 1.0),
                gate=(buf[off : off + 2], buf[off + 8 : off + 10]),
            )
        )
    assert builds() == before
    for r, c in sums[1:]:  # and the sums are the same, but for the atomics' order
        torch.testing.assert_close(r, sums[0][0], rtol=1e-5, atol=0)
        torch.testing.assert_close(c, sums[0][1], rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 4])
def test_looped_value_chunks_match_float64_on_the_gpu(monkeypatch, splits):
    """Running products kept in the output across tiles (VALUE_LOOP_FROM): what the
    interpreter cannot check, the GPU's ordering of one program's stores and loads."""
    from flashot.backends.triton import _configs

    x, y = cuda_clouds(3000, 2600, 1024)
    v = torch.randn(2600, 700, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    be = triton_backend("fp32", autotune=False, splits=splits)
    res = flashot.sinkhorn(x, y, eps=200.0, max_iter=5, tol=None, backend=be)
    monkeypatch.setattr(_configs, "VALUE_LOOP_FROM", None)
    chunked = res.plan @ v
    monkeypatch.setattr(_configs, "VALUE_LOOP_FROM", 256)
    looped = res.plan @ v
    ref = flashot.sinkhorn(x.double(), y.double(), eps=200.0, max_iter=5, tol=None,
                           backend="torch").plan @ v.double()  # fmt: skip
    assert rel(looped.double(), ref) < 1e-5 and rel(chunked.double(), ref) < 1e-5
    assert rel(looped, chunked) < 1e-6
