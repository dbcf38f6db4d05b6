"""The Triton kernels read a temperature's device row (:mod:`flashot.backends.temperature`) as they
would its scalars: the same bits for the attends (split or not, with values), the update
and a whole solve; the gate's limit scaled by the row's ratio. Run in Triton's
interpreter on CPU and natively on a GPU."""

import math

import pytest
import torch

from flashot.backends import available_backends
from flashot.backends.dual import Potentials
from flashot.backends.temperature import schedule_table, temperatures_on
from flashot.solver import loop as solver
from tests.backends.test_base import problem
from tests.backends.triton.test_backend import _step_setup, triton_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def _on_device(eps_list, damping=None):
    # a copy: these tests write rows, and schedule_table shares its tables
    table = schedule_table(eps_list, torch.device(DEVICE), damping=damping).clone()
    return temperatures_on(eps_list, table)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("p", [None, 5])
def test_attend_reads_the_row_as_its_scalars(gen, splits, p):
    """Row LSE and values with ε from the table equal those with ε as scalars, bit for
    bit, through the combine of split partials too; a wrong row gives another LSE."""
    form, h = problem(gen, 37, 50, 3, torch.float32, DEVICE)
    v = None if p is None else torch.randn(50, p, generator=gen).to(DEVICE)
    be = triton_backend(splits=splits)
    eps = 0.37
    plain = be.row_attend(form, h, eps, v)
    cold, hot = _on_device([2.0, eps])
    read = be.row_attend(form, h, hot, v)
    assert torch.equal(plain[0], read[0])
    if p is not None:
        assert torch.equal(plain[1], read[1])
    assert not torch.allclose(be.row_attend(form, h, cold, v)[0], plain[0])
    hot.cell[0] = 2.0  # the row is read, not the scalar: ε = 2 with log2(e)/0.37
    assert not torch.equal(be.row_attend(form, h, hot, v)[0], plain[0])


@pytest.mark.parametrize("rho", [(None, None), (0.5, 0.5)])
def test_a_step_reads_the_row_as_its_scalars(gen, rho):
    """A fused Jacobi step (plan sums, repairs, update) with ε and the damping λ from the
    table is the step with them as scalars, bit for bit."""
    form, f, g, la, lb, eps, lam = _step_setup(gen, rho)
    be = triton_backend()
    (temp,) = _on_device([eps], damping=lambda e: lam)
    outs = []
    for e in (eps, temp):
        state = be.fast_state(f.device)
        outs.append(
            be.jacobi_step(Potentials(form, f, g, la, lb, e), lam, rho, check=True, state=state)
        )
    for plain, read in zip(*outs, strict=True):
        assert torch.equal(plain, read)
    for column, value in ((0, 2 * eps), (3, 0.9 * lam[0])):  # ε, then λ_x, from the row
        if column == 3 and rho[0] is None:
            continue
        moved_temp = _on_device([eps], damping=lambda e: lam)[0]
        moved_temp.cell[column] = value
        moved = be.jacobi_step(Potentials(form, f, g, la, lb, moved_temp), lam, rho, check=True,
                               state=be.fast_state(f.device))  # fmt: skip
        assert not torch.equal(moved[0], outs[0][0]), column


def test_the_gate_limit_takes_the_rows_ratio(gen):
    """Plan sums with ``ratio``: the gate's limit is scaled by the row's ε/ε_prev on the
    device. A bound between limit·ratio and limit skips the pass with it, not without."""
    form, _ = problem(gen, 33, 45, 4, torch.float32, DEVICE)
    f, g = torch.zeros(33, device=DEVICE), torch.zeros(45, device=DEVICE)
    la = torch.full((33,), -math.log(33), device=DEVICE)
    lb = torch.full((45,), -math.log(45), device=DEVICE)
    be = triton_backend()
    _, temp = _on_device([2.8, 0.7])  # ratio 1/4
    for ratio, skipped in ((False, False), (True, True)):
        gate = (torch.tensor([3.0, 0.0], device=DEVICE), torch.zeros(2, device=DEVICE))
        r, c = be.plan_sums(Potentials(form, f, g, la, lb, temp), gate, 5.0, ratio=ratio)
        assert (float(r.abs().sum()) == 0.0) == skipped
        assert (float(c.abs().sum()) == 0.0) == skipped


@pytest.mark.parametrize("rho", [None, 0.7])
@pytest.mark.parametrize("update", ["symmetric", "alternating"])
def test_a_solve_with_its_table_equals_the_solve_with_scalars(gen, monkeypatch, update, rho):
    """A schedule's solve reading its table (the default on this backend) and the same
    solve with the temperatures as scalars: the same potentials. (The gate's limit and
    the probe's estimate may round apart by an ulp; the potentials do not move.)"""
    from flashot.backends.triton import TritonBackend

    form, _, _, la, lb, _, _ = _step_setup(gen, (None, None), n=60, m=50)
    temps = [8.0, 2.0, 0.5, 0.2]
    lam = (lambda e: 1.0) if rho is None else (lambda e: rho / (rho + e))

    def damping(e):
        return lam(e), lam(e)

    outs = []
    for reads in (True, False):
        monkeypatch.setattr(TritonBackend, "reads_temperatures", lambda self, form, r=reads: r)
        outs.append(solver.solve(form, la, lb, temps, damping, (rho, rho), triton_backend(),
                                 max_iter=8, tol=None, update=update))  # fmt: skip
    assert torch.equal(outs[0].f, outs[1].f) and torch.equal(outs[0].g, outs[1].g)
