"""The shared memory of the kernels with fixed launch tiles (the pair-cost kernels, the
reverse plan product) at sm_90, with the tiles, warps and stages they launch with, for
feature sizes across every layout (offline, no GPU). (The autotuned kernels' tables
are checked on the device: a tuner skips configurations that do not launch.)

A kernel that needs more shared memory than the SM offers compiles but is refused at
launch (``OutOfResources``): neither the interpreter nor a plain compile finds it. Each
line prints the kernel, d, the score operands (split or float32) and its bytes; exits 1
when one is within :data:`MARGIN` of :data:`LIMIT`. Prints ``SKIP`` without a CUDA
toolchain in this Triton.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

from sass_loops import compile_like_jit

from flashot.backends.triton import _configs, _sym_vjp, _vjp
from flashot.backends.triton import _pair_functions as pf
from flashot.backends.triton import _pair_sums as ps
from flashot.backends.triton import _pairwise as pw
from flashot.backends.triton._triples import TRIPLE_UP_TO

#: sm_90's largest shared memory per block (227 KB), what an H100 reported refusing 256 KB
LIMIT = 232448
#: what the offline figure may fall short of the launch's: 3 584 bytes for the symmetric
#: reverse at 128 × 128 × 8 warps (230 912 offline, 234 496 on an H100, v48)
MARGIN = 8192


def launches(d: int, presplit: bool):
    """``(name, kernel, constexprs, half pointers, warps, stages)`` as d launches them."""
    half = ("XP", "YP") if presplit else ()
    whole = d <= pw.GRAD_UP_TO
    diff, block_d, chunks, (bm, bn, warps, stages) = pw._layout(d, whole, forward=True)
    common = dict(COST=pf.distance, BLOCK_D=block_d, D_CHUNKS=chunks, DIFF=diff,
                  PRECISION="tf32x3", PRESPLIT=presplit and not diff)  # fmt: skip
    yield (
        "softmin",
        pw._softmin_kernel,
        dict(common, BLOCK_M=bm, BLOCK_N=bn, SUM=False, SPARSE=False, REPAIR=False),
        half,
        warps,
        stages,
    )
    sm, sn, sw, ss = _configs.PAIRWISE_SUMS_TILES
    if whole:  # (the window sums run up to MAX_D = GRAD_UP_TO)
        yield "window sums", ps._pair_sums_kernel, dict(common, BLOCK_M=sm, BLOCK_N=sn,
                                                        ROWS=True), half, sw, ss  # fmt: skip
        diff, block_d, _, (bm, bn, warps, stages) = pw._layout(d, whole=True)
        yield "gradient", pw._grad_kernel, dict(
            {k: v for k, v in common.items() if k != "D_CHUNKS"}, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_D=block_d, DIFF=diff, GRAD=pf.distance_grad, SUM=False, SPARSE=False,
            COLUMNS=False,
        ), half, warps, stages  # fmt: skip


def reverse_products(d: int, presplit: bool):
    """The reverse plan product's launches (:func:`._vjp._rows`) at d features for one
    value column (the replay's), 16 (narrow, not an outer product), 32 and 64 (wide)."""
    for p in (1, 16, 32, 64):
        outer = p == 1
        bm, bn, warps, stages = _vjp.vjp_tiles(p, d)
        chunk = _vjp.vjp_chunk(p, d)
        chunks = 1 if p <= chunk else 2
        half = (("Q", "K") if presplit else ()) + (("KV",) if outer and presplit else ())
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_vjp._width(d), BLOCK_K=_vjp._width(d),
                      BLOCK_P=_vjp._width(p) if chunks == 1 else chunk,
                      P_CHUNKS=chunks, SPLIT=True, WITH_K=True,
                      PRECISION="ieee" if presplit else "tf32x3", V_PRECISION="tf32x3",
                      PRESPLIT=presplit, OUTER=outer, KV_SPLIT=outer and presplit,
                      EXTRA_SIDE=0, COLS=False)  # fmt: skip
        yield f"reverse product p={p}", _vjp._plan_vjp_kernel, consts, half, warps, stages


def symmetric_reverse(d: int, presplit: bool):
    """The one-launch reverse of a symmetric step (:mod:`._sym_vjp`) as d launches it."""
    width = _vjp._width(d)
    bm, bn, warps, stages = _sym_vjp.sym_vjp_tiles(width)
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=width, BLOCK_K=width, SPLIT=True,
                  PRECISION="ieee" if presplit else "tf32x3", V_PRECISION="tf32x3",
                  PRESPLIT=presplit, V_SPLIT=presplit, COLS0=True)  # fmt: skip
    half = ("Q", "K", "KV0", "KV1") if presplit else ()
    yield "symmetric reverse", _sym_vjp._sym_vjp_kernel, consts, half, warps, stages
    if not presplit and d <= TRIPLE_UP_TO:  # (triples: one TF32 MMA of 16, values split)
        consts = dict(consts, BLOCK_D=16, BLOCK_K=16, PRECISION="tf32", V_SPLIT=True)
        yield (
            "symmetric reverse (triples)",
            _sym_vjp._sym_vjp_kernel,
            consts,
            ("KV0", "KV1"),
            warps,
            stages,
        )


def main(sizes=(3, 64, 70, 128, 200)) -> int:
    over = 0
    for d in sizes:
        for presplit in (True, False):
            both = [*launches(d, presplit)]
            both += [*reverse_products(d, presplit)] if d <= _vjp.FUSED_UP_TO else []
            both += [*symmetric_reverse(d, presplit)]  # (the module serves any d)
            for name, fn, consts, half, warps, stages in both:
                try:
                    kernel = compile_like_jit(fn, consts, half, warps, stages)
                except (RuntimeError, FileNotFoundError) as err:
                    if "ptxas" in str(err).lower():
                        print(f"SKIP: no CUDA toolchain in this triton ({err})")
                        return 0
                    raise
                shared = kernel.metadata.shared
                over += shared > LIMIT - MARGIN
                flag = "OVER" if shared > LIMIT - MARGIN else "ok"
                print(f"{flag} {name} d={d} split={presplit} {shared} bytes")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
