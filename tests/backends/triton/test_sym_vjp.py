"""The one-launch reverse of a symmetric step (:mod:`flashot.backends.triton._sym_vjp`)
against float64 dense plans, in Triton's interpreter on CPU and natively on a GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends import available_backends
from flashot.backends.temperature import schedule_table, temperatures_on
from flashot.geometry.costs import attention_form, get_cost

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def _dense(x, y, f, g, la, lb, u, up, eps):
    """(u ⊙ Π^x k, Π^xᵀ u, Π^yᵀ(u' ⊙ k), Π^yᵀ u') and (r_f, r_g), float64, by dense plans."""
    form = attention_form(get_cost("sqeuclidean"), x, y)
    q, k, al, be = form.q, form.k, form.alpha, form.beta
    s = q @ k.T
    r_f = -eps * torch.logsumexp((s + (g - be)[None, :]) / eps + lb[None, :], 1)
    r_g = -eps * torch.logsumexp((s + (f - al)[:, None]) / eps + la[:, None], 0)
    px = torch.exp((r_f[:, None] + (g - be)[None, :] + s) / eps + lb[None, :])
    py = torch.exp((r_g[None, :] + (f - al)[:, None] + s) / eps + la[:, None])  # Π^y_ji at (i, j)
    return (u[:, None] * (px @ k), px.T @ u, py @ (up[:, None] * k), py @ up), (r_f, r_g)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 50), m=st.integers(1, 50),
       d=st.sampled_from([1, 3, 5, 8, 20, 70]), log_eps=st.floats(-1.5, 0.5),
       zeros=st.booleans(), presplit=st.sampled_from([None, True, False]),
       splits=st.sampled_from([None, 2]),
       on_table=st.booleans())  # fmt: skip
def test_one_launch_matches_the_dense_plans(seed, n, m, d, log_eps, zeros, presplit, splits,
                                            on_table):  # fmt: skip
    """Both transforms' reverse products at any potentials (the LSEs their own), weights
    with zeros, split, triple or float32 operands, column splits (atomics), ε by value or read
    from a temperature table, to float32 tiles' accuracy."""
    from flashot.backends.triton import TritonBackend
    from flashot.backends.triton._sym_vjp import symmetric_vjp

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(m, d, generator=gen, dtype=torch.float64) + 0.5
    f, g, u = (torch.randn(s, generator=gen, dtype=torch.float64) for s in (n, m, n))
    up = torch.randn(m, generator=gen, dtype=torch.float64)
    la, lb = (torch.log(torch.rand(s, generator=gen, dtype=torch.float64) + 0.1) for s in (n, m))
    if zeros and n > 1 and m > 1:
        la[0], lb[-1] = -float("inf"), -float("inf")
    eps = 10.0**log_eps * d
    want, (r_f, r_g) = _dense(x, y, f, g, la, lb, u, up, eps)
    form = attention_form(get_cost("sqeuclidean"), x.float().to(DEVICE), y.float().to(DEVICE))
    e32 = eps
    if on_table:  # (a replayed schedule's temperature: ε read on the device)
        e32 = temperatures_on([eps], schedule_table([eps], torch.device(DEVICE)))[0]
    args = [t.float().to(DEVICE) for t in (f, g, r_f, r_g, la, lb, u, up)]
    got = symmetric_vjp(TritonBackend(presplit=presplit, splits=splits), form, *args, e32)
    scale = 1.0 + float(form.q.norm(dim=1).max()) * float(form.k.norm(dim=1).max()) / eps
    for o, w in zip(got, want, strict=True):  # (exponents of ~|q||k|/ε, rounded in float32)
        assert (o.double().cpu() - w).abs().max() <= 1e-5 * scale * (1 + float(w.abs().max()))
        assert torch.isfinite(o).all()


def test_the_backend_declines_where_it_does_not_fuse(monkeypatch):
    """On by default; off, for near-uniform ε or for features past SYM_VJP_UP_TO it
    declines: the replay then takes two reverse products."""
    from flashot.backends.triton import TritonBackend, _configs

    be = TritonBackend()
    x, y = torch.randn(6, 3, device=DEVICE), torch.randn(5, 3, device=DEVICE)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    args = [torch.zeros(s, device=DEVICE) for s in (6, 5, 6, 5, 6, 5, 6, 5)]
    assert be.symmetric_vjp(form, *args, 0.5) is not None
    monkeypatch.setattr(_configs, "SYM_VJP", False)
    assert be.symmetric_vjp(form, *args, 0.5) is None
    monkeypatch.setattr(_configs, "SYM_VJP", True)
    assert be.symmetric_vjp(form, *args, 1e6) is None  # (near-uniform)
    wide = attention_form(get_cost("sqeuclidean"), torch.randn(6, 65, device=DEVICE),
                          torch.randn(5, 65, device=DEVICE))  # fmt: skip
    assert be.symmetric_vjp(wide, *args, 0.5) is None


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 50), d=st.sampled_from([1, 3, 5, 8, 20]),
       log_eps=st.floats(-1.5, 0.5), presplit=st.sampled_from([None, True, False]),
       splits=st.sampled_from([None, 2]),
       cost=st.sampled_from(["sqeuclidean", "cosine"]))  # fmt: skip
def test_a_self_problems_reverse_in_one_launch_matches_the_dense_plan(
    seed, n, d, log_eps, presplit, splits, cost
):
    """A mirror replay's transform (one cloud, ``Π_ij = w_j e^{(r_i + h_j − β_j + s_ij)/ε}``
    with r its own LSE): ``u ⊙ Π k``, ``Πᵀ(u ⊙ q)`` and ``Πᵀ u`` from one launch, the
    column reductions read off the transposed plan's rows, against float64 dense plans."""
    from flashot.backends.triton import TritonBackend
    from flashot.geometry.costs import AttentionForm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    h, u = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))
    log_w = torch.log(torch.rand(n, generator=gen, dtype=torch.float64) + 0.1)
    eps = 10.0**log_eps * d
    form = attention_form(get_cost(cost), x, x)  # (q = 2s k: s_ij = s_ji)
    q, k, be = form.q, form.k, form.beta
    logits = (h - be)[None, :] / eps + log_w[None, :] + (q @ k.T) / eps
    r = -eps * torch.logsumexp(logits, 1)
    plan = torch.exp(r[:, None] / eps + logits)
    want = (u[:, None] * (plan @ k), plan.T @ (u[:, None] * q), plan.T @ u)
    f32 = attention_form(get_cost(cost), x.float().to(DEVICE), x.float().to(DEVICE))
    tf = AttentionForm(f32.q, f32.k, torch.zeros(n, device=DEVICE), f32.beta)
    args = [t.float().to(DEVICE) for t in (h, r, log_w, u)]
    got = TritonBackend(presplit=presplit, splits=splits).mirror_vjp(tf, *args, eps)
    scale = 1.0 + float(q.norm(dim=1).max()) * float(k.norm(dim=1).max()) / eps
    for o, w in zip(got, want, strict=True):
        assert (o.double().cpu() - w).abs().max() <= 1e-5 * scale * (1 + float(w.abs().max()))


def test_a_self_problem_declines_where_the_launch_does_not_serve():
    """Sides of different sizes (not a self problem) and near-uniform ε: None."""
    from flashot.backends.triton import TritonBackend

    be = TritonBackend()
    x = torch.randn(6, 3, device=DEVICE)
    form = attention_form(get_cost("sqeuclidean"), x, x)
    z = torch.zeros(6, device=DEVICE)
    assert be.mirror_vjp(form, z, z, z, z, 0.5) is not None
    assert be.mirror_vjp(form, z, z, z, z, 1e6) is None  # (near-uniform)
    other = attention_form(get_cost("sqeuclidean"), x, torch.randn(5, 3, device=DEVICE))
    assert be.mirror_vjp(other, z, torch.zeros(5, device=DEVICE), z, z, 0.5) is None
