"""The ``flashot bench`` command (flashot.cli.bench): rows, refusals, --largest, named providers."""

import json

import pytest
import torch

from flashot.cli import main

CPU = torch.device("cpu")


def test_cli_bench_writes_rows_with_versions_and_plots(tmp_path, capsys):
    code = main(["bench", "--sizes", "80,160", "--dims", "2", "--workloads", "forward",
                 "--providers", "flashot-torch,dense-torch,flash-sinkhorn", "--out",
                 str(tmp_path), "--quiet"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "| forward | 160 | 2 | flashot-torch |" in out and "flash-sinkhorn" in out
    payload = json.loads((tmp_path / "bench.json").read_text())
    env = payload["environment"]
    assert env["versions"]["torch"] == torch.__version__
    assert env["command"].startswith("flashot bench --sizes 80,160 --dims 2")
    rows = payload["rows"]
    assert len(rows) == 6 and {r["provider"] for r in rows if r["skipped"]} == {"flash-sinkhorn"}
    timed = [r for r in rows if not r["skipped"]]
    assert all(r["ms"] > 0 and r["rel_error"] < 1e-5 for r in timed)
    assert (tmp_path / "bench.csv").read_text().startswith("workload,provider,")
    assert json.loads((tmp_path / "bench.meta.json").read_text())["environment"]["device"]
    assert (tmp_path / "bench_forward.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args,match",
    [(["--providers", "keops"], "--providers"), (["--workloads", "heat"], "--workloads"),
     (["--eps", "-1"], "--eps"), (["--eps", "nan"], "--eps"), (["--tol", "0"], "--tol"),
     (["--tol", "inf"], "--tol"), (["--iters", "0"], "--iters")],
)  # fmt: skip
def test_cli_bench_refuses_unknown_names_and_bad_numbers(args, match, capsys, tmp_path):
    assert main(["bench", "--out", str(tmp_path), *args]) == 1
    assert match in capsys.readouterr().err


def test_cli_largest_doubles_n_within_the_budget(tmp_path, capsys):
    """--largest: the largest n (doubling from the smallest size, up to the cap) each
    provider runs in one call under the budget; a generous budget reaches the cap."""
    code = main(["bench", "--sizes", "50", "--dims", "2", "--workloads", "forward",
                 "--providers", "flashot-torch,dense-torch", "--largest", "30",
                 "--largest-cap", "200", "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    largest = [r for r in rows if r["workload"] == "forward:largest"]
    assert {r["provider"] for r in largest} == {"flashot-torch", "dense-torch"}
    assert all(r["n"] == 200 and r["ms"] > 0 for r in largest)  # 50 → 100 → 200, the cap
    assert main(["bench", "--largest", "-1", "--out", str(tmp_path)]) == 1


def test_cli_runs_a_named_triton_provider_on_any_device(tmp_path, capsys):
    """--providers names any known provider on any device: the default CPU suite leaves the
    Triton rows out, but a named one runs or says why (it was a KeyError). A size given
    twice runs once."""
    code = main(
        [
            "bench",
            "--sizes",
            "40,40",
            "--dims",
            "2",
            "--workloads",
            "forward",
            "--providers",
            "flashot-triton-tf32,flashot-torch",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--quiet",
            "--no-floor",
        ]
    )
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["provider"] for r in rows] == ["flashot-triton-tf32", "flashot-torch"]
    # (the interpreter offers the backend on the CPU, so the precision is what is missing;
    # on a GPU machine the backend itself is not offered for CPU tensors)
    reasons = ("needs the triton backend on a GPU", "'triton' is not available on cpu")
    assert any(r in rows[0]["skipped"] for r in reasons), rows[0]["skipped"]
    assert rows[1]["ms"] > 0
