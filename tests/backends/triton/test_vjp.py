"""The fused plan product's backward (backends/triton/_vjp.py) on the operands the solver's
passes read (split half parts, triples, float32 with 3xTF32) and, for one value column of
a row softmax (the replay's transforms), with the weights split into half parts; against
the dense float64 plan. In Triton's interpreter on CPU, natively on a GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends import available_backends
from tests.backends.test_base import dense_attend, dense_plan_vjp, problem
from tests.conftest import nan_rows, rel, triton_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def softmax_potentials(form, h, log_w, eps):
    """``r = −LSE_j`` of the row softmax ``Π_ij = w_j e^{(r_i + h_j − β_j + ⟨q_i, k_j⟩)/ε}``,
    in float64 then rounded (every row of Π sums to 1)."""
    bias = (h - form.beta).double() + eps * log_w.double()
    return -dense_attend(form, bias, eps, None)[0].float()


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 70),
    m=st.integers(1, 70),
    d=st.sampled_from([1, 3, 5, 8, 20]),
    eps=st.sampled_from([0.05, 0.3, 2.0]),
    presplit=st.sampled_from([None, True, False]),
    splits=st.sampled_from([None, 3]),
    seed=st.integers(0, 2**16),
)
def test_one_value_column_of_a_softmax_matches_dense(n, m, d, eps, presplit, splits, seed):
    """The replay's plan_vjp (p = 1, values a ones column, ``bounded``): ``row_k``,
    ``col_q``, ``col`` and their per-weight forms within float32 rounding of the scores'
    exponents (X/ε ulps), whichever operands the scores read."""
    gen = torch.Generator().manual_seed(seed)
    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    log_w = torch.log(torch.rand(m, generator=gen) + 0.1).to(DEVICE)
    r = softmax_potentials(form, h, log_w, eps).to(DEVICE)
    u = torch.randn(n, generator=gen).to(DEVICE)
    ones, w = torch.ones_like(r), torch.exp(log_w)
    backend = triton_backend(presplit=presplit, splits=splits)
    zero = torch.zeros_like(r)
    flat = type(form)(nan_rows(form.q), nan_rows(form.k), zero, form.beta)  # (NaN past the ends)
    args = (flat, r, h, ones, w, eps, u.new_ones(m, 1), u[:, None])
    out = backend.plan_vjp(*args, frozenset({"row_k", "col_q", "col"}))
    want = dense_plan_vjp(*args)
    size = float(form.q.norm(dim=1).max() * form.k.norm(dim=1).max() + r.abs().max()
                 + (h - form.beta).abs().max())  # fmt: skip
    tol = max(2e-5, 2.0**-21 * size / eps)
    for key in ("row_k", "col_q", "col", "per_b"):
        assert rel(getattr(out, key).double().cpu(), want[key]) < tol, key


@pytest.mark.parametrize("mid", [None, (128, 64, 8, 2)])
@pytest.mark.parametrize("presplit", [None, True])
@pytest.mark.parametrize("p,d0", [(1, False), (1, True), (7, True), (40, False), (64, True)])
def test_split_scores_match_dense_for_any_values(gen, monkeypatch, presplit, p, d0, mid):
    """Wider values and a row-sum cotangent take the general path (values by MMA, not
    split); its scores read the split parts too. ``VJP_MID_TILES`` (on a GPU: 17…64
    values in one chunk of 64) gives the same reductions."""
    from flashot.backends.triton import _configs

    monkeypatch.setattr(_configs, "VJP_MID_TILES", mid)
    n, m, d, eps = 45, 61, 24, 0.2
    form, h = problem(gen, n, m, d, torch.float32, DEVICE)
    log_w = torch.log(torch.rand(m, generator=gen) + 0.1).to(DEVICE)
    r = softmax_potentials(form, h, log_w, eps).to(DEVICE)
    # operands and values with NaN past their last rows: tail tiles must not read there
    flat = type(form)(nan_rows(form.q), nan_rows(form.k), torch.zeros_like(r), form.beta)
    v, dd = torch.randn(m, p, generator=gen).to(DEVICE), torch.randn(n, p, generator=gen).to(DEVICE)
    v, dd = nan_rows(v), nan_rows(dd)
    row_sums = torch.randn(n, generator=gen).to(DEVICE) if d0 else None
    args = (flat, r, h, torch.ones_like(r), torch.exp(log_w), eps, v, dd)
    out = triton_backend(presplit=presplit).plan_vjp(*args, d0=row_sums)
    want = dense_plan_vjp(*args, row_sums)
    for key, ref in want.items():
        assert rel(getattr(out, key).double().cpu(), ref) < 1e-4, key


class _LaunchSpy:
    """Stands in for ``_plan_vjp_kernel``: records each launch's COLS, then launches it."""

    def __init__(self, kernel, record: list):
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.record.append(kwargs["COLS"])
            return self.kernel[grid](*args, **kwargs)

        return launch


@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(1, 60),
    m=st.integers(1, 60),
    d=st.sampled_from([1, 3, 8, 20]),
    eps=st.sampled_from([0.05, 0.3, 2.0]),
    presplit=st.sampled_from([None, True, False]),
    splits=st.sampled_from([None, 3]),
    rows=st.sampled_from(["row_k", "row"]),
    seed=st.integers(0, 2**16),
)
def test_column_sums_in_the_rows_launch_match_dense(n, m, d, eps, presplit, splits, rows, seed):
    """VJP_FUSED_COLUMNS: one value column whose column sums ride along the rows' launch
    (one launch instead of two) gives the dense float64 reductions, ``per_b`` included
    where a column weight is 0, at potentials off the fixed point (rows pushed by up to
    e^±2) and with a zero row weight."""
    from flashot.backends.triton import _configs, _vjp
    from tests.backends.test_base import off_fixed_point

    gen = torch.Generator().manual_seed(seed)
    form, _ = problem(gen, n, m, d, torch.float32, DEVICE)
    a, b, _, f, g = off_fixed_point(gen, form, eps, steps=3, push=2.0, zero_b=m > 1)
    u = torch.randn(n, generator=gen, dtype=torch.float64)
    args = [t.to(DEVICE, torch.float32) for t in (f, g, a, b)]
    v, dd = torch.randn(m, 1, generator=gen), u[:, None].float()
    need = frozenset({rows, "col"})
    launches: list = []
    backend = triton_backend(presplit=presplit, splits=splits)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_vjp, "_plan_vjp_kernel", _LaunchSpy(_vjp._plan_vjp_kernel, launches))
        mp.setattr(_configs, "VJP_FUSED_COLUMNS", True)
        out = backend.plan_vjp(form, *args, eps, v.to(DEVICE), dd.to(DEVICE), need)
        assert launches == [True]  # one launch for both sides
        mp.setattr(_configs, "VJP_FUSED_COLUMNS", False)
        launches.clear()
        apart = backend.plan_vjp(form, *args, eps, v.to(DEVICE), dd.to(DEVICE), need)
        assert launches == [False, False]  # (the two launches it replaces)
    want = dense_plan_vjp(form, *args, eps, v, dd)
    offsets = (form.alpha.abs().max() + form.beta.abs().max()).cpu()
    size = float(form.q.norm(dim=1).max() * form.k.norm(dim=1).max() + f.abs().max()
                 + g.abs().max() + offsets)  # fmt: skip
    tol = max(2e-5, 2.0**-21 * size / eps)
    keys = ("col", "per_b", "row_k" if rows == "row_k" else "row", "per_a")
    for key in keys:
        assert rel(getattr(out, key).double().cpu(), want[key]) < tol, key
    for key in keys:
        assert rel(getattr(out, key).cpu(), getattr(apart, key).cpu()) < tol, key


def test_replayed_hvp_is_the_same_with_the_columns_in_the_rows_launch(monkeypatch):
    """End to end: the HVP of a debiased ε-scaled SamplesLoss (its replay takes fused row
    transforms and unfused column and self transforms) with VJP_FUSED_COLUMNS equals the
    two-launch HVP, and both the float64 torch backend's (SYM_VJP off: with it a
    symmetric step's reverse products are one launch of their own)."""
    import flashot
    from flashot.autodiff.replay import REPLAY_GRAPHS
    from flashot.backends.triton import _configs

    gen = torch.Generator().manual_seed(5)
    x, y, v = (torch.randn(n, 3, generator=gen) for n in (14, 11, 14))
    y = y + 0.4

    def hvp(backend, dtype):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.5, backend=backend)
        xs = x.to(DEVICE, dtype).requires_grad_()
        (g,) = torch.autograd.grad(loss(xs, y.to(DEVICE, dtype)), xs, create_graph=True)
        return torch.autograd.grad((g * v.to(DEVICE, dtype)).sum(), xs)[0].double().cpu()

    from flashot.backends.triton import _vjp

    launches: list = []
    monkeypatch.setattr(_vjp, "_plan_vjp_kernel", _LaunchSpy(_vjp._plan_vjp_kernel, launches))
    monkeypatch.setattr(_configs, "SYM_VJP", False)
    want = hvp("torch", torch.float64)
    got, fused_launches = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(_configs, "VJP_FUSED_COLUMNS", fused)
        REPLAY_GRAPHS.clear()
        launches.clear()
        got[fused] = hvp("triton", torch.float32)
        fused_launches[fused] = (sum(launches), len(launches))
    assert fused_launches[False][0] == 0 and fused_launches[True][0] > 0
    assert fused_launches[True][1] < fused_launches[False][1]  # fewer launches in all
    assert rel(got[True], got[False]) < 1e-5
    assert rel(got[True], want) < 1e-4
