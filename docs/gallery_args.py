"""The examples' arguments in the docs build: CPU sizes (the scripts' defaults are larger)."""

import tempfile
from pathlib import Path

#: the scripts draw their figure only when writing it: a scratch file, and sphinx-gallery
#: scrapes the open figure
_OUT = Path(tempfile.gettempdir()) / "flashot_gallery"

GALLERY_ARGS = {
    "quickstart.py": ["--n", "200"],
    "registration.py": ["--n", "60", "--newton-steps", "6", "--adam-steps", "40"],
    "color_transfer.py": ["--n", "1000", "--side", "64"],
    "shuffled_regression.py": ["--n", "100", "--steps", "8", "--monitor", "0"],
}


def reset_argv(gallery_conf, script_vars) -> list[str]:
    """sphinx-gallery's ``reset_argv``: the arguments of one example."""
    name = Path(script_vars["src_file"]).name
    _OUT.mkdir(exist_ok=True)
    return [*GALLERY_ARGS.get(name, []), "--out", str(_OUT / name.replace(".py", ".png"))]
