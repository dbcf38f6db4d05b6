"""GeomLoss' loop over tiled soft-minima against the streamed p = 2 engine."""

import pytest
import torch

import flashot
from flashot.autodiff.functions import dual_term
from flashot.backends.kernel_sums import cost_of
from flashot.solver.schedule import geomloss_schedule
from flashot.solver.tiled_loop import geomloss_potentials


def _measures(seed, n, m, d, shift, b_scale=1.0):
    """``(a, x, b, y)``, float64, positive weights (a of mass about n/2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(m, d, generator=g, dtype=torch.float64) + shift
    a = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    b = b_scale * torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    return a, x, b, y


@pytest.mark.parametrize("debias", [True, False])
def test_p2_tiles_give_the_streamed_potentials_and_gradients(debias):
    a, x, b, y = _measures(0, 23, 17, 3, 0.4)
    a, b = a / a.sum(), b / b.sum()
    diameter = 4.0
    loss = flashot.SamplesLoss(blur=0.3, scaling=0.7, debias=debias, diameter=diameter,
                               backend="torch")  # fmt: skip
    temps = geomloss_schedule(diameter, 0.09, 0.7)
    xl, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    pots = geomloss_potentials(a, xl, b, y, cost_of(2), temps, debias)
    f, gg = pots.f_ba, pots.g_ab
    if debias:
        f, gg = f - pots.f_aa, gg - pots.g_bb
    ref_f, ref_g = flashot.SamplesLoss(blur=0.3, scaling=0.7, debias=debias, diameter=diameter,
                                       backend="torch", potentials=True)(a, x, b, y)  # fmt: skip
    torch.testing.assert_close(f.detach(), ref_f, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gg.detach(), ref_g, rtol=1e-10, atol=1e-12)
    value = (a * f).sum() + (b * gg).sum()
    ref = loss(a, xr, b, y)
    assert float(value) == pytest.approx(float(ref), rel=1e-10)
    (mine,) = torch.autograd.grad(value, xl)
    (theirs,) = torch.autograd.grad(ref, xr)
    torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("debias", [True, False])
def test_relaxed_p2_tiles_give_the_streamed_values_and_gradients(debias):
    a, x, b, y = _measures(3, 19, 15, 2, 0.5, b_scale=2.0)
    opts = dict(blur=0.4, reach=0.8, scaling=0.6, debias=debias, diameter=5.0, backend="torch")
    temps = geomloss_schedule(5.0, 0.16, 0.6)
    leaves = [t.clone().requires_grad_(True) for t in (a, x, b, y)]
    pots = geomloss_potentials(*leaves, cost_of(2), temps, debias, rho=0.64)
    la, _, lb, _ = leaves
    value = dual_term(pots.f_ba, la, 0.16, 0.64) + dual_term(pots.g_ab, lb, 0.16, 0.64)
    if debias:
        value = value - dual_term(pots.f_aa, la, 0.16, 0.64) - dual_term(pots.g_bb, lb, 0.16, 0.64)
    ref_leaves = [t.clone().requires_grad_(True) for t in (a, x, b, y)]
    ref = flashot.SamplesLoss(**opts)(*ref_leaves)
    assert float(value) == pytest.approx(float(ref), rel=1e-10)
    for mine, theirs in zip(torch.autograd.grad(value, leaves),
                            torch.autograd.grad(ref, ref_leaves), strict=True):  # fmt: skip
        torch.testing.assert_close(mine, theirs, rtol=1e-8, atol=1e-11)
