"""Packaging: one version, the license, the typing marker and the data files ship."""

import importlib.metadata
import tomllib
from pathlib import Path

import flashot

ROOT = Path(__file__).resolve().parents[1]


def test_one_version():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert importlib.metadata.version("flashot") == flashot.__version__


def test_license_typing_marker_and_data_files():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (Path(flashot.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["flashot"] and "tiles/*.json" in data["flashot.backends.triton"]
    assert list((Path(flashot.__file__).parent / "backends" / "triton" / "tiles").glob("sm_*.json"))
