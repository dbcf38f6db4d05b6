"""Warnings that point at the user's line, past flashot's and torch's wrapper frames."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import torch

__all__ = ["warn_at_caller"]

_INSIDE = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(torch.__file__))


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` located at the first frame outside flashot and torch.

    Entry points are wrapped (autocast, ``torch.compiler.disable``, ``torch.func``,
    ``nn.Module.__call__``), so a fixed ``stacklevel`` would point into a wrapper.
    """
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
