"""The Triton backend (:class:`TritonBackend`, :mod:`.backend`): fused streaming kernels.

One op per file, kernel → launch → function (see :mod:`.backend`).
"""

from flashot.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
