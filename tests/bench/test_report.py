"""flashot.bench.report: results read back as written, and runs merged into one suite."""

import json

import pytest

from flashot.bench.harness import Row
from flashot.bench.report import COLUMNS, SCHEMA_VERSION, merge, read, write
from flashot.cli import main

ENV = dict(device="NVIDIA H200", versions={"flashot": "0.1", "torch": "2.11"},
           command="flashot bench --sizes 10000", date="2026-12-02 10:00")  # fmt: skip


def _row(n, provider="flashot-triton", ms=1.0, skipped=None):
    return Row("forward", provider, n, 64, ms=None if skipped else ms, skipped=skipped,
               floor_ms=0.5, rel_error=1e-7, value=3.0)  # fmt: skip


def test_rows_read_back_as_written(tmp_path):
    rows = [_row(1000), _row(2000, "flash-sinkhorn", skipped="not installed")]
    write(rows, ENV, tmp_path)
    got, env = read(tmp_path)
    assert got == rows and env == ENV and got[0].x_floor == 2.0


def test_rows_read_back_from_the_csv_and_its_metadata(tmp_path):
    """A remote run may bring back only its CSV and sidecar: the same rows and environment;
    the CSV is a header and rows, nothing else (schema 2)."""
    rows = [_row(1000), _row(2000, "flash-sinkhorn", skipped="not installed"),
            Row("gradient", "flashot-triton", 50_000, 3, ms=25.25, first_s=5.5, peak_mb=96.0,
                value=0.601989030838, floor_ms=10.1, rel_error=6.1e-07,
                computes="OT_eps, with a comma")]  # fmt: skip
    write(rows, {**ENV, "partial": True}, tmp_path)
    (tmp_path / "bench.json").unlink()
    got, env = read(tmp_path)
    assert got == rows and env == {**ENV, "partial": True}
    assert read(tmp_path / "bench.csv") == (got, env)
    lines = (tmp_path / "bench.csv").read_text().splitlines()
    assert lines[0].split(",") == list(COLUMNS) and len(lines) == 1 + len(rows)
    meta = json.loads((tmp_path / "bench.meta.json").read_text())
    assert meta["schema_version"] == SCHEMA_VERSION and meta["columns"] == COLUMNS
    (tmp_path / "bench.csv").write_text("workload,provider\nforward,x\n")
    with pytest.raises(ValueError, match=r"bench\.csv: not a flashot bench result"):
        read(tmp_path)


def test_later_timed_rows_replace_earlier_ones_and_skips_never_replace_times():
    first = [_row(1000, ms=5.0), _row(1000, "peer", ms=7.0), _row(2000, "peer", skipped="x")]
    later = [_row(1000, ms=4.0), _row(1000, "peer", skipped="not installed"),
             _row(2000, "peer", ms=9.0), _row(4000, ms=20.0)]  # fmt: skip
    env2 = {**ENV, "date": "2026-12-03 09:00", "command": "flashot bench --sizes 4000",
            "versions": {"torch": "2.11", "flash_sinkhorn": "0.4.1"}}  # fmt: skip
    rows, env = merge([(first, ENV), (later, env2)])
    got = {(r.provider, r.n): (r.ms, r.skipped) for r in rows}
    assert got == {("flashot-triton", 1000): (4.0, None), ("peer", 1000): (7.0, None),
                   ("peer", 2000): (9.0, None), ("flashot-triton", 4000): (20.0, None)}  # fmt: skip
    assert env["versions"] == {"flashot": "0.1", "torch": "2.11", "flash_sinkhorn": "0.4.1"}
    assert env["date"] == "2026-12-02 10:00 … 2026-12-03 09:00"
    assert env["command"] == "flashot bench --sizes 10000 ; flashot bench --sizes 4000"


@pytest.mark.parametrize(
    "change, match",
    [({"device": "NVIDIA A100"}, "different devices"),
     ({"versions": {"torch": "2.13"}}, "versions of torch")],
)  # fmt: skip
def test_runs_that_do_not_compare_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        merge([([_row(1000)], ENV), ([_row(2000)], {**ENV, **change})])


def test_cli_merges_two_runs_of_a_split_sweep(tmp_path, capsys):
    """Two real CPU runs (one size each) merge into one table, CSV, JSON and plot."""
    for n in (40, 60):
        assert main(["bench", "--sizes", str(n), "--dims", "2", "--workloads", "forward",
                     "--providers", "flashot-torch", "--out", str(tmp_path / f"run{n}"),
                     "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    out = tmp_path / "merged"
    assert main(["bench", "--merge", str(tmp_path / "run40"), str(tmp_path / "run60"),
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "| forward | 40 | 2 | flashot-torch |" in text
    assert "| forward | 60 | 2 | flashot-torch |" in text
    payload = json.loads((out / "bench.json").read_text())
    assert sorted(r["n"] for r in payload["rows"]) == [40, 60]
    assert payload["environment"]["command"].count("flashot bench --sizes") == 2
    assert (out / "bench_forward.png").stat().st_size > 1000


def test_cli_merge_names_a_folder_without_results(tmp_path, capsys):
    assert main(["bench", "--merge", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--merge" in err and "nowhere" in err


def test_runs_with_other_settings_are_refused():
    with pytest.raises(ValueError, match="different settings"):
        merge([([_row(1000)], {**ENV, "settings": "eps 0.1, iters 10, tol 0.001"}),
               ([_row(2000)], {**ENV, "settings": "eps 0.5, iters 10, tol 0.001"})])  # fmt: skip


BENCH = ["bench", "--dims", "2", "--workloads", "forward", "--providers", "flashot-torch",
         "--quiet", "--no-floor"]  # fmt: skip


def test_a_run_cut_short_keeps_its_rows_and_resume_runs_only_the_rest(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    """Rows are written as they finish: a run stopped at its second size leaves the first,
    marked partial; --resume runs only the missing size and writes the whole suite."""
    from flashot.bench import harness

    real, ran = harness._row, []

    def cut_at_60(prov, workload, pb, *args):
        if pb.n == 60:
            raise KeyboardInterrupt  # the device call's timeout
        ran.append(pb.n)
        return real(prov, workload, pb, *args)

    monkeypatch.setattr(harness, "_row", cut_at_60)
    with pytest.raises(KeyboardInterrupt):
        main([*BENCH, "--sizes", "40,60", "--out", str(tmp_path)])
    rows, env = read(tmp_path)
    assert [r.n for r in rows] == [40] and rows[0].ms > 0 and env["partial"]
    monkeypatch.setattr(harness, "_row", lambda *a: ran.append(a[2].n) or real(*a))
    assert main([*BENCH, "--sizes", "40,60", "--out", str(tmp_path), "--resume"]) == 0
    rows, env = read(tmp_path)
    assert ran == [40, 60] and sorted(r.n for r in rows) == [40, 60] and "partial" not in env
    assert all(r.ms > 0 and r.rel_error < 1e-5 for r in rows)
    capsys.readouterr()
    assert main([*BENCH, "--sizes", "40", "--eps", "0.5", "--out", str(tmp_path), "--resume"]) == 1
    assert "--resume" in capsys.readouterr().err


def test_resume_reads_a_csv_brought_back_alone_and_over_an_older_json(tmp_path, monkeypatch):
    """A remote run may bring back only bench.csv: --resume reads it alone, and a CSV
    copied over a folder holding an older run's JSON wins over that JSON (the newer
    file), so no row it holds is run again or lost."""
    import os

    from flashot.bench import harness

    real, ran = harness._row, []
    monkeypatch.setattr(harness, "_row", lambda *a: ran.append(a[2].n) or real(*a))
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*BENCH, "--sizes", "40", "--out", str(first)]) == 0
    assert main([*BENCH, "--sizes", "40,60", "--out", str(second), "--resume"]) == 0
    ran.clear()
    (second / "bench.json").unlink()  # the CSV alone
    assert main([*BENCH, "--sizes", "40,60,80", "--out", str(second), "--resume"]) == 0
    assert ran == [80]
    # a newer CSV over an older JSON of fewer rows: the CSV's rows count
    (first / "bench.csv").write_text((second / "bench.csv").read_text())
    old = (first / "bench.json").stat().st_mtime_ns
    os.utime(first / "bench.json", ns=(old - 10**9, old - 10**9))
    assert sorted(r.n for r in read(first)[0]) == [40, 60, 80]
    ran.clear()
    assert main([*BENCH, "--sizes", "40,60,80", "--out", str(first), "--resume"]) == 0
    assert ran == []


def test_resume_with_a_larger_budget_runs_the_rows_a_smaller_one_skipped(tmp_path, monkeypatch):
    """A row skipped by the row budget is kept by a resume with the same budget and run
    by one with a larger budget; rows that ran are never run again."""
    from flashot.bench import harness

    real, ran = harness._row, []
    monkeypatch.setattr(harness, "_row", lambda *a: ran.append(a[2].n) or real(*a))
    tiny = ["--row-budget", "1e-9"]  # the row at 40 predicts more for 60
    assert main([*BENCH, "--sizes", "40,60", "--out", str(tmp_path), *tiny]) == 0
    rows = {r.n: r for r in read(tmp_path)[0]}
    assert ran == [40] and "over the row budget of 1e-09 s" in rows[60].skipped
    assert harness.skipped_by_a_smaller_budget(rows[60], 1.0)
    assert not harness.skipped_by_a_smaller_budget(rows[60], 1e-9)
    assert not harness.skipped_by_a_smaller_budget(rows[40], 1.0)
    ran.clear()
    assert main([*BENCH, "--sizes", "40,60", "--out", str(tmp_path), "--resume", *tiny]) == 0
    assert ran == []
    assert main([*BENCH, "--sizes", "40,60", "--out", str(tmp_path), "--resume"]) == 0
    rows = {r.n: r for r in read(tmp_path)[0]}
    assert ran == [60] and rows[60].skipped is None and rows[60].ms > 0


def test_a_second_run_into_a_result_refuses_before_running(tmp_path, capsys, monkeypatch):
    """An --out holding a result is neither replaced silently nor appended to without
    --resume: the run refuses at once (no row runs); --force replaces it."""
    import flashot.cli.bench as bench_cli

    assert main([*BENCH, "--sizes", "40", "--out", str(tmp_path)]) == 0
    before = (tmp_path / "bench.json").read_text()
    ran = []
    real = bench_cli.run_suite
    monkeypatch.setattr(bench_cli, "run_suite", lambda *a, **k: ran.append(1) or real(*a, **k))
    capsys.readouterr()
    assert main([*BENCH, "--sizes", "60", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "already holds a bench result" in err and "--resume" in err and "--force" in err
    assert not ran and (tmp_path / "bench.json").read_text() == before
    assert main([*BENCH, "--sizes", "60", "--out", str(tmp_path), "--force"]) == 0
    assert {r.n for r in read(tmp_path)[0]} == {60}


def test_an_out_that_cannot_hold_results_is_refused_before_running(tmp_path, capsys):
    file = tmp_path / "a_file"
    file.write_text("x")
    assert main([*BENCH, "--sizes", "40", "--out", str(file)]) == 1
    assert "is a file" in capsys.readouterr().err
    assert main([*BENCH, "--sizes", "40", "--out", str(file / "below")]) == 1
    assert "cannot write there" in capsys.readouterr().err


def test_results_are_replaced_atomically(tmp_path, monkeypatch):
    """A write that dies midway leaves the previous files whole (temp file, rename)."""
    import flashot.bench.report as report

    write([_row(1000)], ENV, tmp_path)
    before = (tmp_path / "bench.csv").read_text(), (tmp_path / "bench.json").read_text()

    def dies(fd):
        raise OSError("disk full")

    monkeypatch.setattr(report.os, "fsync", dies)
    with pytest.raises(OSError, match="disk full"):
        write([_row(1000), _row(2000)], ENV, tmp_path)
    after = (tmp_path / "bench.csv").read_text(), (tmp_path / "bench.json").read_text()
    assert after == before


def test_a_schema_1_csv_with_comment_lines_still_reads(tmp_path):
    lines = [f"# {k}: {json.dumps(v)}" for k, v in ENV.items()]
    lines += ["workload,provider,n,d,ms", "forward,flashot-torch,1000,3,2.5"]
    (tmp_path / "bench.csv").write_text("\n".join(lines) + "\n")
    rows, env = read(tmp_path / "bench.csv")
    assert env == ENV and rows == [Row("forward", "flashot-torch", 1000, 3, ms=2.5)]
