"""Where kernels run: the current CUDA device for a block, Triton's interpreter mode."""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["on_device", "triton_interpreted"]


def triton_interpreted() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(device: torch.device):
    """Make ``device`` the current CUDA device for a block (a no-op off CUDA).

    Triton launches kernels, and CUDA graphs capture and replay, on the current device:
    tensors on another GPU (``cuda:1`` while ``cuda:0`` is current) need this.
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
