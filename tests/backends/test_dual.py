"""Dual-potential helpers (flashot.backends.dual) against the plan written out densely."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends import TorchBackend
from flashot.backends.dual import (
    Potentials,
    marginal_error,
    phi_sum,
    plan_times,
    relaxed_weight,
    row_mass,
)
from flashot.geometry.costs import attention_form, get_cost
from tests.references import dense_cost

F64 = torch.float64


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9), m=st.integers(1, 9),
       eps=st.floats(0.05, 5.0), rho=st.sampled_from([None, 0.3, 4.0]))  # fmt: skip
def test_row_masses_errors_and_products_are_the_dense_plans(seed, n, m, eps, rho):
    """At any potentials: r = P 1 from one row pass, the L1 error against a (or its relaxed
    target a e^{−f/ρ}), P v from a pass with values, and Σ a φ(f)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, generator=gen, dtype=F64), torch.randn(m, 3, generator=gen, dtype=F64)
    a, b = torch.rand(n, generator=gen, dtype=F64) + 0.1, torch.rand(m, generator=gen, dtype=F64)
    f, g = torch.randn(n, generator=gen, dtype=F64), torch.randn(m, generator=gen, dtype=F64)
    v = torch.randn(m, 2, generator=gen, dtype=F64)
    form = attention_form(get_cost("sqeuclidean"), x, y, F64)
    plan = a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - dense_cost(x, y)) / eps)
    lse, _ = TorchBackend().row_attend(form, g - form.beta, eps, log_w=b.log())
    r = row_mass(f, lse, form.alpha, a.log(), eps)
    assert torch.allclose(r, plan.sum(1), rtol=1e-10, atol=1e-300)
    target = a if rho is None else a * torch.exp(-f / rho)
    assert torch.allclose(relaxed_weight(f, a, rho), target, rtol=1e-12)
    err = marginal_error(f, r, a.log(), rho)
    want = float((plan.sum(1) - target).abs().sum())
    assert float(err) == pytest.approx(want, rel=1e-9, abs=1e-300)
    pv = plan_times(TorchBackend(), Potentials(form, f, g, a.log(), b.log(), eps), v)
    assert torch.allclose(pv, plan @ v, rtol=1e-9, atol=1e-12)
    phi = f if rho is None else rho * (1 - torch.exp(-f / rho))
    assert float(phi_sum(f, a, rho)) == pytest.approx(float((a * phi).sum()), rel=1e-12)
