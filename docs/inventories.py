"""Intersphinx inventories for the names the docs link to, written without a network.

CI builds the docs offline, where Sphinx cannot fetch ``objects.inv`` from PyTorch,
NumPy and Python; this writes the same format (version 2) for the names used, with
each project's real addresses, so ``:class:`torch.Tensor``` links as it would online.
"""

from __future__ import annotations

import zlib
from pathlib import Path

#: project → (base URL, {name: (role, page relative to the base)})
NAMES = {
    "torch": ("https://docs.pytorch.org/docs/stable/", {
        "torch.Tensor": ("class", "tensors.html"),
        "torch.Generator": ("class", "generated/torch.Generator.html"),
        "torch.nn.Module": ("class", "generated/torch.nn.Module.html"),
        "torch.autograd.Function": ("class", "autograd.html"),
        "torch.autograd.grad": ("function", "generated/torch.autograd.grad.html"),
        "torch.compile": ("function", "generated/torch.compile.html"),
        "torch.inference_mode": ("class", "generated/torch.inference_mode.html"),
        "torch.no_grad": ("class", "generated/torch.no_grad.html"),
        "torch.use_deterministic_algorithms":
            ("function", "generated/torch.use_deterministic_algorithms.html"),
        "torch.library.custom_op": ("function", "library.html"),
        "torch.func.grad": ("function", "generated/torch.func.grad.html"),
        "torch.distributed.init_process_group": ("function", "distributed.html"),
    }),
    "numpy": ("https://numpy.org/doc/stable/", {
        "numpy.ndarray": ("class", "reference/generated/numpy.ndarray.html"),
    }),
    "python": ("https://docs.python.org/3/", {
        "warnings.warn": ("function", "library/warnings.html"),
        "float": ("class", "library/functions.html"),
    }),
}  # fmt: skip


def write(folder: Path) -> dict[str, str]:
    """Write ``<project>.inv`` into ``folder``; returns {project: base URL}."""
    folder.mkdir(parents=True, exist_ok=True)
    for project, (_, names) in NAMES.items():
        lines = "".join(f"{name} py:{role} 1 {page}#$ -\n"
                        for name, (role, page) in sorted(names.items()))  # fmt: skip
        header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: \n"
                  "# The remainder of this file is compressed using zlib.\n")  # fmt: skip
        (folder / f"{project}.inv").write_bytes(header.encode() + zlib.compress(lines.encode()))
    return {project: url for project, (url, _) in NAMES.items()}
