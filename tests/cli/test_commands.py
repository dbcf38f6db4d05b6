import json
import re

import numpy as np
import pytest
import torch

from flashot.cli import EXIT_NOT_CONVERGED, CliError, load_array, main
from tests.conftest import run_cli as run


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 3)), rng.normal(size=(50, 3)) + 1
    np.save(tmp_path / "x.npy", x)
    np.savetxt(tmp_path / "y.csv", y, delimiter=",", header="u,v,w", comments="")
    np.savez(tmp_path / "both.npz", x=x, y=y)
    torch.save(torch.from_numpy(y), tmp_path / "y.pt")
    np.save(tmp_path / "b.npy", np.full(50, 2.0))
    return tmp_path, x, y


def test_load_formats_agree(files):
    d, x, y = files
    assert np.allclose(load_array(str(d / "x.npy")), x)
    assert np.allclose(load_array(str(d / "y.csv")), y)
    assert np.allclose(load_array(str(d / "both.npz"), "y"), y)
    assert np.allclose(load_array(str(d / "y.pt")), y)


def test_solve_json_and_save(files, capsys):
    d, x, y = files
    out = d / "pots.npz"
    args = [
        str(d / "x.npy"),
        str(d / "y.csv"),
        "--eps",
        "0.5",
        "--dtype",
        "float64",
        "--tol",
        "1e-9",
    ]
    assert main(["solve", *args, "--json", "--save", str(out), "--b", str(d / "b.npy")]) == 0
    summary = json.loads(capsys.readouterr().out)
    import flashot

    ref = flashot.sinkhorn(
        torch.from_numpy(x), torch.from_numpy(y), eps=0.5, tol=1e-9, eps_schedule="geomloss"
    )
    assert summary["converged"] and summary["cost"] == pytest.approx(ref.cost.item(), rel=1e-8)
    assert (summary["schema"], summary["command"], summary["saved"]) == (2, "solve", str(out))
    assert (summary["backend"], summary["precision"]) == ("torch", "fp32")  # what ran
    saved = np.load(out)
    assert saved["f"].shape == (60,) and saved["barycentric_map"].shape == (60, 3)


def test_solve_human_summary(files, capsys):
    d, _, _ = files
    main(["solve", str(d / "x.npy"), str(d / "y.pt"), "--eps", "0.5", "--quiet", "--tol", "1e-4"])
    assert "OT_eps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["solve", "missing.npy", "missing.npy"], "no such file"),
        (["solve", "{d}/both.npz", "{d}/y.csv"], "--x-key"),
        (["solve", "{d}/both.npz", "{d}/y.csv", "--x-key", "z"], "no array 'z'"),
        (["solve", "{d}/empty.npy", "{d}/y.csv"], "cannot read"),
        (["solve", "{d}/corrupt.npz", "{d}/y.csv"], "cannot read"),
        (["solve", "{d}/corrupt.pt", "{d}/y.csv"], "cannot read"),
        (["solve", "{d}/complex.npy", "{d}/y.csv"], "complex"),
        (["solve", "{d}/x.npy", "{d}/y.csv", "--scaling", "0"], "scaling must be"),
        (["solve", "{d}/x.npy", "{d}/y.csv", "--device", "cuda:7"], "CUDA|cuda"),
        (
            ["solve", "{d}/both.npz", "{d}/y.csv", "--x-key", "x", "--save", "{d}/both.npz"],
            "overwrite an input",
        ),
        (["solve", "{d}/x.npy", "{d}/y.csv", "--save", "{d}/nodir/out.npz"], "no directory"),
        (["solve", "{d}/x.npy", "{d}/y.csv", "--save", "{d}/both.npz"], "exists; pass --force"),
        (["solve", "{d}/x.npy", "{d}/y.csv", "--eps", "1e-300", "--dtype", "float64"], "outside"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_1(files, capsys, argv, match):
    d, _, _ = files
    (d / "empty.npy").write_bytes(b"")
    (d / "corrupt.npz").write_bytes(b"PK\x03\x04 not a zip")
    (d / "corrupt.pt").write_bytes(b"garbage")
    np.save(d / "complex.npy", np.ones((4, 2)) * (1 + 2j))
    code, out, err = run([a.format(d=d) for a in argv], capsys)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("flashot: ")
    assert re.search(match, err)


def test_csv_with_bom_header_and_missing_cells(tmp_path):
    rows = np.arange(120.0).reshape(40, 3)
    body = "\n".join(",".join(f"{v:g}" for v in r) for r in rows)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(("\ufeff" + body + "\n").encode("utf-8"))
    assert load_array(str(bom)).shape == (40, 3)  # was 39: the BOM row taken as a header
    head = tmp_path / "head.csv"
    head.write_text("a,b,c\n" + body)
    assert np.array_equal(load_array(str(head)), rows)
    with pytest.raises(CliError, match="not numeric"):
        load_array(str(head), header="no")
    assert load_array(str(bom), header="yes").shape == (39, 3)  # asked for explicitly
    hole = tmp_path / "hole.csv"
    hole.write_text("1,,3\n4,5,6\n")
    with pytest.raises(CliError, match="row 1, column 2 is empty"):
        load_array(str(hole))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("1,2,3\n4,5\n")
    with pytest.raises(CliError, match="row 2 has 2 columns"):
        load_array(str(ragged))


def test_save_adds_the_suffix_it_reports_and_force_overwrites(files, capsys):
    d, _, _ = files
    base = ["solve", str(d / "x.npy"), str(d / "y.csv"), "--eps", "0.5", "--json"]
    code, out, _ = run([*base, "--save", str(d / "res.npy")], capsys)
    assert code == 0 and json.loads(out)["saved"] == str(d / "res.npy.npz")
    assert (d / "res.npy.npz").is_file()
    code, _, err = run([*base, "--save", str(d / "res.npy.npz")], capsys)
    assert code == 1 and "exists" in err
    code, _, _ = run([*base, "--save", str(d / "res.npy.npz"), "--force"], capsys)
    assert code == 0


def test_not_converged_has_its_own_exit_code(files, capsys):
    d, _, _ = files
    argv = ["solve", str(d / "x.npy"), str(d / "y.csv"), "--eps", "0.01", "--max-iter", "20",
            "--tol", "1e-9", "--schedule", "none", "--quiet"]  # fmt: skip
    code, out, err = run(argv, capsys)
    assert code == EXIT_NOT_CONVERGED == 3
    assert "NOT converged" in out and "not converged" in err


def test_info(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "torch" in info["backends"]["cpu"] and (info["schema"], info["command"]) == (2, "info")


def test_json_keys_are_always_there_and_every_option_has_help(files, capsys):
    # one set of keys whether or not --save was given; every option explains itself and
    # shows its default
    from flashot.cli import build_parser

    d, _, _ = files
    assert main(["solve", str(d / "x.npy"), str(d / "y.pt"), "--eps", "0.5", "--json",
                 "--tol", "1e-4"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["saved"] is None and "ot_cost" not in summary
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (name, action.option_strings)
            if action.default not in (None, False, True, "==SUPPRESS==") and action.option_strings:
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)


def test_otdd_of_npz_files_matches_the_api(tmp_path, capsys):
    from flashot.tasks.otdd import dataset_distance

    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(40, 3, generator=g), torch.randn(30, 3, generator=g) + 0.5
    ya, yb = torch.arange(40) % 3, torch.arange(30) % 2
    np.savez(tmp_path / "a.npz", X=xa.numpy(), y=ya.numpy())
    np.savez(tmp_path / "b.npz", X=xb.numpy(), y=yb.numpy())
    assert main(["otdd", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--eps", "0.5",
                 "--json", "--device", "cpu"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    ref = dataset_distance(xa, ya, xb, yb, eps=0.5, eps_schedule="geomloss")
    assert (out["schema"], out["command"], out["backend"]) == (2, "otdd", "torch")
    assert out["distance"] == pytest.approx(float(ref.distance), rel=1e-6)
    assert np.allclose(out["class_mass"], ref.class_mass.numpy(), atol=1e-7)
    assert out["classes_a"] == [0, 1, 2] and out["n_b"] == 30 and out["converged"] is True
    assert main(["otdd", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "debiased OTDD" in text and "class-to-class mass" in text


def test_otdd_of_named_datasets(capsys):
    pytest.importorskip("sklearn")
    assert main(["otdd", "digits", "digits:invert", "--n", "150", "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["distance"] > 1.0 and len(out["class_mass"]) == 10  # inverted digits are far


@pytest.mark.parametrize("argv, match", [
    (["otdd", "cifar", "digits"], "unknown dataset 'cifar'"),
    (["otdd", "missing.npz", "digits"], "missing.npz"),
])  # fmt: skip
def test_otdd_mistakes_are_one_line(argv, match, capsys):
    assert main([*argv, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_otdd_npz_without_labels_is_named(tmp_path, capsys):
    np.savez(tmp_path / "a.npz", X=np.zeros((3, 2)))
    assert main(["otdd", str(tmp_path / "a.npz"), str(tmp_path / "a.npz"), "--device", "cpu"]) == 1
    assert "needs arrays 'X' (n, d) and 'y' (n,)" in capsys.readouterr().err


def test_progress_only_on_a_terminal_unless_asked(files, capsys):
    d, _, _ = files
    argv = ["solve", str(d / "x.npy"), str(d / "y.pt"), "--eps", "0.5", "--tol", "1e-4"]
    assert main(argv) == 0 and "sinkhorn" not in capsys.readouterr().err  # (not a tty here)
    assert main([*argv, "--progress"]) == 0 and "sinkhorn" in capsys.readouterr().err
    assert main([*argv, "--progress", "--json"]) == 0 and "sinkhorn" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["solve", "{d}/x.npy", "{d}/y.csv", "--eps", "-1"], "--eps"),
    (["solve", "{d}/x.npy", "{d}/y.csv", "--eps", "nan"], "--eps"),
    (["otdd", "digits", "digits", "--n", "-3"], "--n"),
    (["otdd", "digits", "digits", "--n", "0"], "--n"),
    (["otdd", "digits", "digits", "--eps", "0"], "--eps"),
])  # fmt: skip
def test_bad_numbers_are_bad_arguments_exit_2(files, capsys, argv, match):
    """Documented: 2 for bad arguments (--eps -1 and nan exited 1; --n -3 silently dropped
    three points and printed a distance)."""
    d, _, _ = files
    with pytest.raises(SystemExit) as exc:
        main([a.format(d=d) for a in argv])
    assert exc.value.code == 2 and match in capsys.readouterr().err


def test_otdd_file_mistakes_are_one_line(tmp_path, capsys):
    """A corrupt .npz (was a 27-line BadZipFile traceback), NaN features (an eigh
    traceback) and a folder given as a file (called "no such file")."""
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    x = np.random.default_rng(0).normal(size=(20, 2))
    x[3, 1] = np.nan
    np.savez(tmp_path / "nan.npz", X=x, y=np.arange(20) % 3)
    for argv, match in (
        (["otdd", str(tmp_path / "bad.npz"), "digits"], "not an .npz archive"),
        (["otdd", str(tmp_path / "nan.npz"), "digits"], "NaN or infinite"),
        (["solve", str(tmp_path), str(tmp_path / "nan.npz")], "is a folder"),
    ):
        assert main([*argv, "--device", "cpu"]) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err


def test_help_and_import_load_no_torch():
    """``import flashot`` and ``flashot --help`` (every command's) parse with the standard
    library: torch loads when something runs."""
    from tests.conftest import modules_loaded_by

    code = (
        "import contextlib, io, flashot, flashot.cli as cli\n"
        "for argv in (['--help'], ['solve', '--help'], ['bench', '--help'],\n"
        "             ['otdd', '--help'], ['demo', '--help'], ['tune', '--help']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        cli.main(argv)\n"
    )
    assert modules_loaded_by(code, ("torch", "numpy")) == []


def test_the_parsers_choices_are_the_librarys():
    import flashot
    from flashot.bench.options import PROVIDERS
    from flashot.bench.providers import providers
    from flashot.cli import COST_NAMES, DESCRIPTION

    assert tuple(sorted(flashot.COSTS)) == COST_NAMES
    assert DESCRIPTION in flashot.__doc__.splitlines()[0]
    cpu = [p.name for p in providers(torch.device("cpu"))]
    assert set(cpu) <= set(PROVIDERS)
