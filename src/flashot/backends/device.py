"""Where kernels run: the current CUDA device for a block, Triton's interpreter mode."""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

__all__ = ["SideStream", "on_device", "triton_interpreted"]


def triton_interpreted() -> bool:
    """Whether Triton runs in interpreter mode (``TRITON_INTERPRET=1``): kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(device: torch.device):
    """Make ``device`` the current CUDA device for a block (a no-op off CUDA).

    Triton launches kernels, and CUDA graphs capture and replay, on the current device:
    tensors on another GPU (``cuda:1`` while ``cuda:0`` is current) need this.
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class SideStream:
    """Host work that reads the device (counts, sizes) on a second CUDA stream.

    A read of a tensor's value (``nonzero``, ``tolist``) blocks the host until the
    tensor's stream has run all it was given. On the caller's stream, a mask read back
    between two launches also waits for the launch before it, and the device then idles
    while the host builds the next launch's inputs. Inside :meth:`aside` that work runs
    on a side stream which waits only for the inputs it reads (where :meth:`ready` marked
    them), so the host's reads wait for its own few launches while the caller's stream
    still runs the last kernel; the caller's stream waits for the block's work before
    its next launch (on the device: the host does not wait). Off CUDA, every method
    does nothing.
    """

    #: the marks kept (the latest; each holds a weak reference and an event)
    MARKS = 16

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if cuda else None
        self.side = torch.cuda.Stream(device) if cuda else None
        self._marks: list = []  # (weakref to a tensor, the event after it on main)

    def ready(self, *tensors) -> None:
        """Mark ``tensors`` (made on the caller's stream) complete at this point of it.

        A marked tensor must not change afterwards: a block aside may read it any time
        after the mark.
        """
        if self.main is None:
            return
        event = torch.cuda.Event()
        event.record(self.main)
        live = [(ref, e) for ref, e in self._marks if ref() is not None]
        fresh = [(weakref.ref(t), event) for t in tensors if t is not None]
        self._marks = (live + fresh)[-self.MARKS :]

    @contextlib.contextmanager
    def aside(self, *inputs):
        """Run the block on the side stream once ``inputs`` (caller-stream tensors) exist.

        An input not marked :meth:`ready` waits for all the caller's stream was given
        (None: no input). Tensors the block makes for the caller's stream go through
        :meth:`hand_over`.
        """
        if self.side is None or self.main is None:
            yield
            return
        for t in inputs:
            if t is None:
                continue
            event = next((e for ref, e in reversed(self._marks) if ref() is t), None)
            if event is None:
                self.side.wait_stream(self.main)
            else:
                self.side.wait_event(event)
            t.record_stream(self.side)  # (its memory outlives the side's reads)
        with torch.cuda.stream(self.side):
            yield
        self.main.wait_stream(self.side)

    def hand_over(self, *tensors) -> None:
        """Mark tensors made inside :meth:`aside` that the caller's stream reads.

        Their memory is then not reused before the caller's stream has run what it was
        given by the time they are freed.
        """
        if self.main is None:
            return
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(self.main)
