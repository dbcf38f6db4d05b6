"""The one Sinkhorn loop (flashot.solver.loop.solve): its iterates are the updates as
written, in float64 against a dense loop, and the near-uniform rule per temperature."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import TorchBackend
from flashot.geometry.costs import attention_form, get_cost
from flashot.solver.loop import solve
from tests.references import dense_cost, entropic_ot
from tests.solver.test_stopping import d0
from tests.solver.test_stopping import solve as solve_quietly

F64 = torch.float64


def dense_loop(c, log_a, log_b, temps, iters, update, lam):
    """The updates as written: GeomLoss' start, then averaged Jacobi or Gauss–Seidel steps."""

    def t_rows(g, e):  # λ T(g)_i = −λ ε LSE_j[(g_j − C_ij)/ε + log b_j]
        return -lam[0](e) * e * torch.logsumexp((g[None, :] - c) / e + log_b[None, :], 1)

    def t_cols(f, e):
        return -lam[1](e) * e * torch.logsumexp((f[:, None] - c) / e + log_a[:, None], 0)

    f, g = t_rows(torch.zeros_like(log_b), temps[0]), t_cols(torch.zeros_like(log_a), temps[0])
    for it in range(1, iters + 1):
        e = temps[min(it - 1, len(temps) - 1)]
        if update == "symmetric":
            f, g = 0.5 * (f + t_rows(g, e)), 0.5 * (g + t_cols(f, e))
        else:
            f = t_rows(g, e)
            g = t_cols(f, e)
    return f, g


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 12), m=st.integers(1, 12),
       update=st.sampled_from(["symmetric", "alternating"]),
       rho=st.sampled_from([None, 0.5, (None, 2.0)]), iters=st.integers(1, 12),
       scaled=st.booleans())  # fmt: skip
def test_the_iterates_are_the_updates_as_written(seed, n, m, update, rho, iters, scaled):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 2, generator=gen, dtype=F64), torch.randn(m, 2, generator=gen, dtype=F64)
    a, b = (
        torch.rand(n, generator=gen, dtype=F64) + 0.1,
        torch.rand(m, generator=gen, dtype=F64) + 0.1,
    )
    rx, ry = (rho, rho) if not isinstance(rho, tuple) else rho
    if rx is None and ry is None:
        a, b = a / a.sum(), b / b.sum()
    form = attention_form(get_cost("sqeuclidean"), x, y, F64)
    temps = [4.0, 1.0, 0.5] if scaled else [0.5]
    iters = max(iters, len(temps))

    def damping(e):
        return tuple(1.0 if r is None else r / (r + e) for r in (rx, ry))

    out = solve(form, a.log(), b.log(), temps, damping, (rx, ry), TorchBackend(),
                max_iter=iters, tol=None, update=update)  # fmt: skip
    lam = (lambda e: damping(e)[0], lambda e: damping(e)[1])
    f, g = dense_loop(dense_cost(x, y), a.log(), b.log(), temps, iters, update, lam)
    assert torch.allclose(out.f, f, atol=1e-10, rtol=1e-10)
    assert torch.allclose(out.g, g, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("update", ["symmetric", "alternating"])
def test_only_the_final_eps_takes_the_near_path(monkeypatch, update):
    """Warm-up temperatures up to a few times the cost's bound take the usual LSE (they
    only start the next temperature; far above it, see the SamplesLoss huge-diameter
    test); the final ε takes the near path from the bound, and either way the converged
    answer is the float64 reference's."""
    import flashot.backends.base as base

    calls = []
    real = base.near_attend
    monkeypatch.setattr(base, "near_attend", lambda *a, **k: calls.append(a[2]) or real(*a, **k))

    x, y = d0()
    bound = attention_form(get_cost("sqeuclidean"), x, y).cost_bound
    diameter = math.sqrt(2 * bound)  # the first temperature, D², is above the bound
    for eps, near_final in ((0.5, False), (1e3, True)):
        calls.clear()
        res, misses = solve_quietly(
            x,
            y,
            eps=eps,
            eps_schedule=flashot.EpsilonScaling(0.5, diameter=diameter),
            update=update,
            tol=1e-10,
            max_iter=3000,
        )
        assert not misses
        assert all(e == eps for e in calls) and bool(calls) == near_final
        n, m = len(x), len(y)
        a, b = torch.full((n,), 1 / n, dtype=F64), torch.full((m,), 1 / m, dtype=F64)
        ref = float(entropic_ot(x, y, a, b, eps))
        assert float(res.cost) == pytest.approx(ref, rel=1e-9, abs=1e-9)
