"""The streaming PyTorch backend (flashot.backends.torch_backend): tiles of any budget give
the dense row LSE and softmax average; -inf columns (zero weights) count for nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.backends import TorchBackend
from flashot.geometry.costs import attention_form, get_cost

F64 = torch.float64


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 13), m=st.integers(1, 13),
       budget=st.integers(1, 200), eps=st.floats(0.01, 10.0),
       dropped=st.integers(0, 12))  # fmt: skip
def test_any_tile_budget_gives_the_dense_rows(seed, n, m, budget, eps, dropped):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 2, generator=gen, dtype=F64), torch.randn(m, 2, generator=gen, dtype=F64)
    h = torch.randn(m, generator=gen, dtype=F64)
    h[: min(dropped, m - 1)] = -torch.inf  # (at least one column keeps its weight)
    v = torch.randn(m, 3, generator=gen, dtype=F64)
    form = attention_form(get_cost("sqeuclidean"), x, y, F64)
    s = (form.q @ form.k.T + h) / eps
    lse, out = TorchBackend(budget=budget).row_attend(form, h, eps, v)
    assert torch.allclose(lse, eps * torch.logsumexp(s, 1), rtol=1e-12, atol=1e-12)
    assert torch.allclose(out, torch.softmax(s, 1) @ v, rtol=1e-10, atol=1e-12)


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="budget"):
        TorchBackend(budget=0)
