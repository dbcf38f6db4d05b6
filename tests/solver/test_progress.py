"""Progress bars (flashot.solver.progress): tqdm's or a plain line, on stderr, only when
asked for, ending at the work done."""

import sys

import torch

import flashot
from tests.conftest import clouds


def test_progress_bar_writes_to_stderr(gen, capsys, monkeypatch):
    """tqdm's bar when tqdm is installed, else a line with the time left; nothing unasked."""
    x, y = clouds(gen, 10, 10, 2)
    flashot.sinkhorn(x, y, eps=0.5, progress=True, max_iter=20, tol=None)
    err = capsys.readouterr().err
    assert "sinkhorn: 100%" in err and "20/20" in err  # tqdm (a test dependency)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were missing
    flashot.sinkhorn(x, y, eps=0.5, progress=True, max_iter=20, tol=None)
    err = capsys.readouterr().err
    assert "sinkhorn [" in err and "20/20" in err and "left" in err
    flashot.sinkhorn(x, y, eps=0.5, max_iter=20, tol=None)
    assert capsys.readouterr().err == ""


def test_progress_total_is_the_work_done_when_tol_stops_early(capsys):
    """A solve that meets its tol at iteration 200 of max_iter 2000 ends its progress bar
    at 200/200 (it showed "/2000" and stopped at 200)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 2, generator=gen), torch.randn(150, 2, generator=gen)
    res = flashot.sinkhorn(x, y, eps=0.1, progress=True, max_iter=2000)
    assert res.n_iter < 2000
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert f"{res.n_iter}/{res.n_iter}" in last and "/2000" not in last
