"""Print the sm_90 TTGIR of the split score tile with several feature chunks.

Run by ``tests/backends/triton/test_split.py`` in a process without ``TRITON_INTERPRET`` (the
interpreter compiles nothing); needs only Triton's compiler and its bundled ptxas.
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashot.backends.triton._common import _score_tile


@triton.jit
def _probe(Q, K, OUT, n, m, d, q_lo, k_lo, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr):
    offs_m = tl.arange(0, 64)
    offs_n = tl.arange(0, 64)
    unused = tl.zeros((64, BLOCK_D), dtype=tl.float16)
    s = _score_tile(
        Q,
        K,
        unused,
        unused,
        offs_m,
        offs_n,
        n,
        m,
        d,
        d,
        1,
        d,
        1,
        BLOCK_D,
        D_CHUNKS,
        False,
        "tf32",
        unused,
        unused,
        q_lo,
        k_lo,
        True,
    )
    tl.store(OUT + offs_m[:, None] * 64 + offs_n[None, :], s * 0.5)  # (a parts' unscale)


if __name__ == "__main__":
    signature = {
        "Q": "*fp16",
        "K": "*fp16",
        "OUT": "*fp32",
        "n": "i32",
        "m": "i32",
        "d": "i32",
        "q_lo": "i32",
        "k_lo": "i32",
    }
    src = ASTSource(fn=_probe, signature=signature, constexprs={"BLOCK_D": 64, "D_CHUNKS": 3})
    print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttgir"])
