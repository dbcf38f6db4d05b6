"""The demo (flashot.tasks.demo, ``flashot demo``): a figure, or one line without
matplotlib."""

import json

from flashot.cli import main
from tests.conftest import run_cli as run


def test_demo_without_matplotlib_is_one_line(monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def fake(name, *args, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    code, _, err = run(["demo", "--out", "x.png"], capsys)
    assert code == 1 and "needs matplotlib" in err


def test_demo_writes_a_figure(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert main(["demo", "--out", str(out), "--n", "300", "--eps", "0.02", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert out.stat().st_size > 10_000 and summary["converged"]
    assert summary["mapped_pixels"] == 600 * 512
