"""GeomLoss' loop over tiled soft-minima against the streamed p = 2 engine."""

import pytest
import torch

import flashot
from flashot.backends.kernel_sums import cost_of
from flashot.solver.schedule import geomloss_schedule
from flashot.solver.tiled_loop import geomloss_potentials


@pytest.mark.parametrize("debias", [True, False])
def test_p2_tiles_give_the_streamed_potentials_and_gradients(debias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 3, generator=g, dtype=torch.float64)
    y = torch.randn(17, 3, generator=g, dtype=torch.float64) + 0.4
    a = torch.rand(23, generator=g, dtype=torch.float64) + 0.1
    b = torch.rand(17, generator=g, dtype=torch.float64) + 0.1
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
