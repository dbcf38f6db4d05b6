"""Sphinx configuration of flashot's API reference (built in CI with warnings as errors)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # (docs/inventories.py, docs/gallery_args.py)

import inventories  # noqa: E402

import flashot  # noqa: E402

project = "flashot"
author = "flashot developers"
release = version = flashot.__version__
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.intersphinx",
    "sphinx_gallery.gen_gallery",
]

# CI has no network: the inventories are written from the names the docs link to
# (docs/inventories.py), with the projects' real URLs
intersphinx_mapping = {
    name: (url, str(HERE / "_inventories" / f"{name}.inv"))
    for name, url in inventories.write(HERE / "_inventories").items()
}

from gallery_args import GALLERY_ARGS  # noqa: E402

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "gallery",
    # run those with CPU arguments; the others (MNIST data, a torchrun job) are shown
    "filename_pattern": "/(" + "|".join(n.removesuffix(".py") for n in GALLERY_ARGS) + r")\.py$",
    "reset_argv": "gallery_args.reset_argv",  # (by name: the config stays picklable)
    "abort_on_example_error": True,
    "download_all_examples": False,
    "show_signature": False,
}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures keep the annotations; no cross-reference noise
autodoc_default_options = {"members": True, "show-inheritance": False}
exclude_patterns = ["_build", "_inventories"]
html_theme = "alabaster"
