"""The Triton backend (:class:`TritonBackend`, :mod:`.backend`): fused streaming kernels.

One op per file, kernel → launch → function (see :mod:`.backend`).
"""

from flashot.backends.triton._ahead import hash_triton_early

hash_triton_early()  # (while the modules below import)

from flashot.backends.triton.backend import TritonBackend  # noqa: E402

__all__ = ["TritonBackend"]
