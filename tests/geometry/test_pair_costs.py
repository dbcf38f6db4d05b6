"""PairCost: the statistics of a tile, the block call, the checks of its arguments."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.geometry.pair_costs import PairCost, distance_cost, half_square_cost, pair_stats


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 9), m=st.integers(1, 9), d=st.integers(1, 6))
def test_statistics_and_built_in_costs_match_cdist(seed, n, m, d):
    g = torch.Generator().manual_seed(seed)
    x, y = (
        torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(m, d, generator=g, dtype=torch.float64),
    )
    y[0] = x[0]  # a coincident pair: s = 0 exactly
    s, t, a, b = pair_stats(x, y)
    assert s[0, 0] == 0 and a.shape == (n, 1) and b.shape == (1, m)
    torch.testing.assert_close(s, torch.cdist(x, y) ** 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a + b - 2 * t, s, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(distance_cost(x, y), torch.cdist(x, y), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(half_square_cost(x, y), 0.5 * s)


def test_distance_takes_the_subgradient_zero_at_coincident_points():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(distance_cost(x, x.detach()).sum(), x)
    assert torch.equal(g, torch.zeros_like(g))


def test_arguments_are_checked_by_name():
    with pytest.raises(TypeError, match="torch_fn"):
        PairCost(3.0)
    with pytest.raises(TypeError, match="triton_fn"):
        PairCost(lambda s, t, a, b: s, triton_fn=5)
    with pytest.raises(ValueError, match="triton_grad needs triton_fn"):
        PairCost(lambda s, t, a, b: s, triton_grad="distance")
    bad = PairCost(lambda s, t, a, b: s.sum(), name="summed")
    with pytest.raises(ValueError, match=r"'summed'.*\(2, 3\) tile"):
        bad(torch.zeros(2, 1), torch.zeros(3, 1))
    assert flashot.PairCost is PairCost
