r"""Score matrices held in memory: the cached path for wide features (issue 50).

A streaming pass recomputes every score ``s_ij = ⟨q_i, k_j⟩`` from d-wide operands: at
d = 512 that is 512 multiply-adds (three half MMAs in the default precision) for each
score, each pass. Where the n × m matrix fits in memory, computing it once per solve
and then only reading it (4 bytes a score) turns each later pass from compute-bound
into bandwidth-bound, as dense solvers do (OTT-JAX's). :func:`score_matrix` forms it
with the streaming kernels' own score tiles (the backend's precision mode, so cached
and streamed scores agree to the bit up to the order of a tile's adds), and the
kernels read it through their ``_score_tile`` with ``PRECISION = "cached"`` (or
``"cached_t"``, the transposed problem's): the
operands they get are one-column views of the matrix (rows n, columns m, one
"feature": an empty tensor has no data pointer), whose data pointer and strides address
``S`` (or ``Sᵀ`` for the transposed problem).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.triton import _configs
from flashot.backends.triton._common import _score_tile, _stationary_tiles
from flashot.backends.triton._configs import cdiv

__all__ = ["AUTO_FROM_D", "CACHED_DOT", "CACHED_T_DOT", "FREE_SHARE", "SCORES", "auto_caches",
           "cached_dot", "cached_views", "fits", "score_matrix", "scores_bytes"]  # fmt: skip

#: the ``scores`` options of :class:`~flashot.backends.triton.TritonBackend`
SCORES = ("auto", "stream", "cache")

#: the kernels' PRECISION (and the tile tables' dot name) of cached scores, row-major
#: (the problem the matrix was formed for) and transposed (its swapped problem)
CACHED_DOT, CACHED_T_DOT = "cached", "cached_t"
#: tiles of the matrix's kernel on a GPU (rows, columns, warps)
TILES = (64, 64, 4)


#: a score matrix is formed only while it takes at most this share of the GPU's free memory
FREE_SHARE = 0.5
#: ``scores="auto"`` caches a solve's scores from this many features (the form's, per
#: precision mode): a streamed score costs d multiply-adds (three MMAs of them in "fp32"),
#: a cached one 4 bytes read. Measured (H100, v56, 10 symmetric iterations at ε = 0.1,
#: forward / with ∇x, ms): d = 512 "fp32" 10k 12.9 / 18.2 → 8.7 / 13.8, 50k 258 / 367 →
#: 112 / 209; "bf16" 10k 7.1 / 15.3 → 7.2 / 11.0, 50k 132 / 309 → 97 / 160. v58 (H100):
#: d = 256 "fp32" 10k 7.6 / 10.0 → 7.3 / 8.7, 50k 145 / 187 → 92 / 113; "tf32" 10k 7.7 /
#: 12.4 → 5.5 / 8.0, 50k 120 / 209 → 94 / 125 (errors unchanged); the half modes at 256
#: are not measured.
AUTO_FROM_D = {"fp32": 256, "tf32": 256, "bf16": 512, "fp16": 512}


def scores_bytes(n: int, m: int) -> int:
    """The bytes of an n × m float32 score matrix."""
    return 4 * n * m


def auto_caches(precision: str, d: int) -> bool:
    """Whether ``scores="auto"`` caches the scores of d-feature operands in ``precision``."""
    return d >= AUTO_FROM_D[precision]


def fits(n: int, m: int, device: torch.device, held: int = 0) -> bool:
    """Whether an n × m matrix fits :data:`FREE_SHARE` of the device's free memory now.

    ``held``: bytes of matrices the solve already holds (they count against the share
    of the memory free before them, so a debiased solve's three stay within it too).
    Always on the CPU (the interpreter's tests).
    """
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return held + scores_bytes(n, m) <= FREE_SHARE * (free + held)


def cached_views(s: torch.Tensor, transposed: bool = False):
    """``(Q, K)``: one-column views that make the kernels read ``s`` (n, m) as scores.

    ``Q`` (n, 1) has s's data and strides (row i, column j at ``i·stride_qn +
    j·stride_qd``); ``K`` (m, 1) only sizes the columns (a kernel that hoists it reads
    one valid column). ``transposed``: the views of ``sᵀ`` (the problem with rows and
    columns swapped), no copy.
    """
    t = s.T if transposed else s
    return t[:, :1], t.T[:, :1]


def cached_dot(transposed: bool) -> str:
    """The kernels' PRECISION for reading the matrix (``transposed``: its transpose)."""
    return CACHED_T_DOT if transposed else CACHED_DOT


@triton.jit
def _scores_kernel(
    Q, K, S, n, m, d, stride_qn, stride_qd, stride_kn, stride_kd, stride_sn,
    Q_INV, K_INV, q_lo, k_lo,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr, PRECISION: tl.constexpr, PRESPLIT: tl.constexpr,
):  # fmt: skip
    """``S[i, j] = ⟨q_i, k_j⟩`` for one (BLOCK_M, BLOCK_N) tile.

    As the streaming kernels score it: ``_common._score_tile`` times the parts' scale.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    q_tile, q_lo_tile, unscale = _stationary_tiles(Q, q_lo, offs_m, n, d, stride_qn, stride_qd,
                                                   Q_INV, K_INV, BLOCK_D, D_CHUNKS, False,
                                                   PRESPLIT)  # fmt: skip
    s = _score_tile(Q, K, q_tile, q_tile, offs_m, offs_n, n, m, d, stride_qn, stride_qd,
                    stride_kn, stride_kd, BLOCK_D, D_CHUNKS, False, PRECISION, q_lo_tile,
                    q_lo_tile, q_lo, k_lo, PRESPLIT)  # fmt: skip
    ok = (offs_m[:, None] < n) & (offs_n[None, :] < m)
    tl.store(S + offs_m[:, None].to(tl.int64) * stride_sn + offs_n[None, :], s * unscale,
             mask=ok)  # fmt: skip


def score_matrix(ops, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``S = q kᵀ`` (n, m) float32, scored as a streaming pass of ``ops`` would.

    Args:
        ops: the backend's :class:`~._operands.Operands` (its precision mode; the
            operands it would stream, split parts or triples included).
        q: (n, d) and k: (m, d) float32.
    """
    n, m = q.shape[0], k.shape[0]
    qs, ks, split_args, presplit, triples = ops.score_pair(q, k)
    s = torch.empty(n, m, device=q.device, dtype=torch.float32)
    d = qs.shape[1]
    block_d, chunks = _configs.block_d(d, qs.element_size())
    if triton_interpreted():
        bm, bn, options = 16, 16, {}
    else:
        bm, bn, warps = TILES
        options = {"num_warps": warps}
    with on_device(q.device):
        _scores_kernel[(cdiv(n, bm), cdiv(m, bn))](
            qs, ks, s, n, m, d, qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1),
            s.stride(0), **split_args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
            D_CHUNKS=chunks, PRECISION=ops.dot(triples), PRESPLIT=presplit, **options,
        )  # fmt: skip
    return s
