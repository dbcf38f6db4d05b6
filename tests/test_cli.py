import json

import numpy as np
import pytest
import torch

from flashot.cli import load_array, main


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
    assert summary["converged"] and summary["ot_cost"] == pytest.approx(ref.cost.item(), rel=1e-8)
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
        (["solve", "{d}/x.npy", "{d}/y.csv", "--eps", "-1"], "eps must be"),
        (["solve", "{d}/both.npz", "{d}/y.csv"], "--key"),
    ],
)
def test_solve_errors_are_one_line(files, argv, match):
    d, _, _ = files
    with pytest.raises(SystemExit, match=match):
        main([a.format(d=d) for a in argv])


def test_info(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "torch" in info["backends"]["cpu"]


def test_demo_writes_a_figure(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--out", str(out), "--n", "300", "--eps", "0.02", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert out.stat().st_size > 10_000 and summary["converged"]
    assert summary["mapped_pixels"] == 600 * 512
