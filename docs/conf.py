"""Sphinx configuration of flashot's API reference (built in CI with warnings as errors)."""

import flashot

project = "flashot"
author = "flashot developers"
release = version = flashot.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures keep the annotations; no cross-reference noise
autodoc_default_options = {"members": True, "show-inheritance": False}
exclude_patterns = ["_build"]
html_theme = "alabaster"
