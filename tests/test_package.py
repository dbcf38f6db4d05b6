"""Packaging: one version, the license, the typing marker and the data files ship."""

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import flashot

ROOT = Path(__file__).resolve().parents[1]


def test_one_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert importlib.metadata.version("flashot") == flashot.__version__


def test_license_typing_marker_and_data_files():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (Path(flashot.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert "py.typed" in data["flashot"] and "tiles/*.json" in data["flashot.backends.triton"]
    assert list((Path(flashot.__file__).parent / "backends" / "triton" / "tiles").glob("sm_*.json"))


def test_the_sdist_carries_its_test_suite(tmp_path, monkeypatch):
    """Every file of tests/ (helpers and subpackages too) and the docs are in the sdist,
    so its test suite can run."""
    import subprocess
    import sys
    import tarfile

    if not (ROOT / ".git").exists():
        pytest.skip("needs the source checkout")
    subprocess.run([sys.executable, "-c", "import setuptools.build_meta as b; "
                    f"b.build_sdist({str(tmp_path)!r})"], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    (sdist,) = tmp_path.glob("flashot-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    tracked = subprocess.run(["git", "ls-files", "tests"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
    missing = [path for path in tracked if path not in names]
    assert tracked and not missing, missing
    assert {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml"} <= names


@pytest.mark.slow
def test_public_entry_points_have_precise_types(tmp_path):
    """mypy saw Any for flashot.sinkhorn(...), sinkhorn_divergence and hvp: their
    decorators were untyped (now ParamSpec-typed)."""
    from mypy import api

    snippet = tmp_path / "reveal.py"
    snippet.write_text(
        "import torch, flashot\n"
        "x = torch.randn(3, 2)\n"
        "reveal_type(flashot.sinkhorn(x, x, eps=0.1))\n"
        "reveal_type(flashot.sinkhorn_divergence(x, x, eps=0.1))\n"
        "reveal_type(flashot.hvp(x, x, x, eps=0.1))\n"
        "reveal_type(flashot.ops.sinkhorn_cost(x, x, eps=0.1))\n"
        "flashot.sinkhorn(x, x, eps='small')\n"  # a wrong argument type is now caught
    )
    out, err, _ = api.run([str(snippet), "--no-error-summary", "--cache-dir",
                           str(tmp_path / "cache"), "--ignore-missing-imports"])  # fmt: skip
    revealed = [line.split("Revealed type is ")[1] for line in out.splitlines()
                if "Revealed type is" in line]  # fmt: skip
    assert revealed == ['"flashot.result.SinkhornResult"', '"torch._tensor.Tensor"',
                        '"torch._tensor.Tensor | tuple[torch._tensor.Tensor, ...]"',
                        '"torch._tensor.Tensor"'], out + err  # fmt: skip
    assert 'Argument "eps" to "sinkhorn" has incompatible type "str"' in out, out


def test_every_public_name_resolves_lazily_to_its_definition():
    import importlib

    import flashot

    assert set(flashot.__all__) == {*flashot._SOURCES, *flashot._SUBMODULES, "__version__"}
    for name in flashot._SOURCES:
        obj = getattr(flashot, name)
        assert obj is getattr(importlib.import_module(flashot._SOURCES[name]), name)
    assert set(flashot.__all__) <= set(dir(flashot))
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'sinkhorm'"):
        _ = flashot.sinkhorm


def test_the_public_api_and_a_first_solve_load_no_dynamo():
    """TorchDynamo's Python side costs seconds to import (issue 50): every public name, a
    solve, a loss with its gradient and an HVP run without it (the entry points' compile
    marks are set without it: tests/test_ops.py checks they still hold)."""
    from tests.conftest import modules_loaded_by

    code = (
        "import torch, flashot\n"
        "for name in flashot.__all__:\n"
        "    getattr(flashot, name)\n"
        "x = torch.randn(30, 3, requires_grad=True); y = torch.randn(20, 3)\n"
        "flashot.sinkhorn(x, y, eps=0.5).cost.backward()\n"
        "flashot.SamplesLoss()(x, y).backward()\n"
        "flashot.hvp(x.detach(), y, torch.randn(30, 3), eps=0.5)\n"
    )
    assert modules_loaded_by(code, ("torch._dynamo",)) == []
