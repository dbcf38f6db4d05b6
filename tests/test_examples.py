"""The examples/ gallery runs and does what its docstring says (small sizes)."""

import importlib.util
from pathlib import Path

import pytest
import torch

import flashot

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytest.importorskip("matplotlib")


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_registration_newton_recovers_the_map_adam_does_not(tmp_path):
    out = tmp_path / "reg.png"
    results = load("registration").main(["--n", "40", "--newton-steps", "6", "--adam-steps",
                                          "20", "--out", str(out)])  # fmt: skip
    _, _, (A_true, t_true) = load("registration").problem(40)
    A, t, newton = results["newton"]
    assert float((A - A_true).norm() + (t - t_true).norm()) < 1e-5
    assert newton[-1] < 1e-3 * results["adam"][2][-1]
    assert out.stat().st_size > 10_000


def test_color_transfer_moves_the_palette(tmp_path):
    out = tmp_path / "ct.png"
    before, after = load("color_transfer").main(["--n", "300", "--side", "32", "--out", str(out)])
    assert 0.0 <= after < 0.1 * before and out.stat().st_size > 10_000
    assert torch.isfinite(torch.tensor([before, after])).all()


def test_quickstart_map_is_the_plans_barycenter(tmp_path):
    out = tmp_path / "qs.png"
    res, mapped = load("quickstart").main(["--n", "80", "--out", str(out)])
    x, y = load("quickstart").clouds(80)
    ref = flashot.sinkhorn(x.double(), y.double(), eps=0.05, eps_schedule="geomloss", tol=1e-9,
                           max_iter=20_000)  # fmt: skip
    dense = ref.plan @ torch.eye(80, dtype=torch.float64)
    want = dense @ y.double() / dense.sum(1, keepdim=True)
    assert torch.allclose(mapped.double(), want, atol=1e-4)
    assert abs(float(res.cost) / float(ref.cost) - 1) < 1e-5 and out.stat().st_size > 10_000


@pytest.mark.slow
def test_shuffled_regression_hybrid_recovers_w_where_adam_does_not(tmp_path):
    out = tmp_path / "sr.png"
    prob, results = load("shuffled_regression").main(["--n", "100", "--steps", "8", "--monitor",
                                                      "0", "--out", str(out)])  # fmt: skip
    adam, budget, hybrid = results.values()
    assert adam.converged and len(adam.history) == 1  # the saddle passes the gradient test
    assert prob.relative_error(budget.W) > 0.5 and prob.relative_error(hybrid.W) < 0.05
    assert hybrid.history[0]["lambda_min"] < 0 < hybrid.history[-1]["lambda_min"]
    assert out.stat().st_size > 10_000


def test_distributed_example_as_a_one_rank_job_matches_sinkhorn(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29531")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    res = load("distributed_sinkhorn").main(["--points", "300", "--dim", "4", "--iters", "5"])
    gen = torch.Generator().manual_seed(1000)
    x = torch.randn(300, 4, generator=gen) / 2
    y = torch.randn(300, 4, generator=gen) / 2 + 0.2
    one = flashot.sinkhorn(x, y, eps=0.1, tol=None, max_iter=5, update="symmetric")
    assert float(res.cost) == pytest.approx(float(one.cost), rel=1e-5)
