"""Diagnostics of the dual solves (flashot.autodiff.dual_log): blocks nest, records are
the solves', an unreached tolerance warns and is recorded as such."""

import pytest
import torch

import flashot
from flashot.autodiff.dual_log import DualSolveInfo, log_solve, record_dual_solves
from flashot.hessian import hvp
from tests.test_hessian import problem


def test_blocks_nest_and_each_sees_the_solves_inside_it():
    info = DualSolveInfo(5, 1e-4, 1e-3, True, 1, 0.1, (3, 2))
    log_solve(info)  # (outside every block: recorded nowhere)
    with record_dual_solves() as outer:
        assert outer.last is None
        log_solve(info)
        with record_dual_solves() as inner:
            log_solve(info)
        log_solve(info)
    assert len(outer) == 3 and len(inner) == 1 and inner.last is info


def test_an_hvp_records_its_solve():
    torch.manual_seed(0)
    x, y, v = torch.randn(12, 2, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64), None
    v = torch.randn_like(x)
    with flashot.record_dual_solves() as log:
        flashot.hvp(x, y, v, eps=0.5)
    assert len(log) == 1 and log.last.converged and log.last.shape == (12, 9)
    assert log.last.residual <= log.last.tol and log.last.eps == 0.5


def test_an_unreached_dual_tolerance_warns_naming_the_cause(monkeypatch):
    from flashot.autodiff import dense_dual
    from flashot.numerics.linalg import CGWarning

    monkeypatch.setattr(dense_dual, "DENSE_UP_TO", 0)  # (the CG, not a direct solve)

    x, y, a, b, vx, _ = problem(12, n=30, m=25, d=3)
    with flashot.record_dual_solves() as log, pytest.warns(CGWarning, match="iteration") as rec:
        hvp(x, y, vx, a, b, eps=0.02, cg_max_iter=3, tol=1e-11, max_iter=50_000)
    assert len(rec) == 1 and "condition number" in str(rec[0].message)
    assert not log.last.converged and log.last.n_iter == 3
