"""Compile every Triton kernel variant for an sm_90 (Hopper) target, without a GPU.

Run as a script (Triton must not be in interpreter mode): exits non-zero on the first
kernel that fails to compile, prints ``SKIP`` when this Triton has no CUDA toolchain.
"""

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashot.backends.triton import _attend, _plan_sums, _update

K = SimpleNamespace(_attend_kernel=_attend._attend_kernel,
                    _plan_sums_kernel=_plan_sums._plan_sums_kernel,
                    _update_kernel=_update._update_kernel)  # fmt: skip

FLOATS = {
    "scale",
    "scale_e",
    "eps",
    "hi",
    "gate_limit",
    "shift",
    "inv_rho_x",
    "inv_rho_y",
    "sum_lo",
    "sum_hi",
}
FLOATS |= {f"w_{age}_{side}" for age in ("old", "new") for side in "xy"}


def compile_for_hopper(fn, consts, half=False):
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in FLOATS:
            sig[a] = "fp32"
        elif a in ("BLOCKS", "PTR", "IV"):  # a packed batch's blocks, a sparse layout
            sig[a] = "*i32"
        elif a in ("XP", "YP"):  # the pair-cost kernels' score operands
            sig[a] = "*fp16" if consts.get("PRESPLIT") else "*fp32"
        elif a == "PARTS" or (half and a == "KV" and consts.get("KV_SPLIT")):
            sig[a] = "*fp16"  # a split operand's float16 parts (the plan product's keys)
        elif half and a in ("KV0", "KV1") and consts.get("V_SPLIT"):
            sig[a] = "*fp16"  # (the symmetric reverse's two keys, split)
        elif a[0].isupper():
            sig[a] = "*bf16" if half and a in ("Q", "K") else "*fp32"
        else:
            sig[a] = "i32"
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))


def variants():
    base = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, BLOCK_P=64)
    plain = dict(HAS_V=False, POTENTIAL_BIAS=True, REPAIR=False)
    with_v = dict(HAS_V=True, POTENTIAL_BIAS=False, REPAIR=False, PRECISION="tf32")
    for flags, half in (
        (dict(plain, D_CHUNKS=1, SPLIT=False, PRECISION="tf32x3"), False),
        (dict(plain, D_CHUNKS=1, SPLIT=True, REPAIR=True, PRECISION="tf32"), True),
        (dict(plain, D_CHUNKS=4, SPLIT=False, REPAIR=True, PRECISION="tf32x3"), False),
        (dict(plain, BLOCK_D=32, D_CHUNKS=16, SPLIT=False, PRECISION="tf32"), False),
        (dict(with_v, D_CHUNKS=4, SPLIT=True), False),
        (dict(with_v, BLOCK_M=64, BLOCK_D=32, BLOCK_P=256, D_CHUNKS=16, SPLIT=True), False),
        (dict(with_v, D_CHUNKS=1, SPLIT=False), True),
        (
            dict(plain, D_CHUNKS=1, SPLIT=False, REPAIR=True, PRECISION="tf32x3", SEGMENTED=True),
            False,
        ),
        (dict(with_v, D_CHUNKS=4, SPLIT=False, SEGMENTED=True), True),
        # the value chunks looped in one program (P_LOOP), split parts as the default reads
        (
            dict(
                with_v,
                BLOCK_M=64,
                BLOCK_P=128,
                D_CHUNKS=16,
                SPLIT=False,
                P_LOOP=8,
                PRESPLIT=True,
                V_SPLIT=True,
            ),
            True,
        ),
        (
            dict(with_v, BLOCK_M=64, BLOCK_D=32, BLOCK_P=128, D_CHUNKS=16, SPLIT=True, P_LOOP=4),
            False,
        ),
    ):
        flags = dict(flags, V_PRECISION=flags["PRECISION"])
        flags.setdefault("SEGMENTED", False)
        flags.setdefault("PRESPLIT", False)
        flags.setdefault("V_SPLIT", False)
        flags.setdefault("P_LOOP", 1)
        yield K._attend_kernel, {**base, **flags}, half
    # (BLOCK_D, D_CHUNKS, GATED, half operands, packed batch)
    plan_sums = ((64, 1, True, False, False), (64, 1, True, True, True),
                 (64, 4, False, False, False), (32, 16, True, False, True),
                 (64, 8, True, True, False))  # fmt: skip
    for bd, chunks, gated, half, segmented in plan_sums:
        consts = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_D=bd, D_CHUNKS=chunks, GATED=gated,
                      PRECISION="tf32", SEGMENTED=segmented, PRESPLIT=False,
                      MULTIPLY=False, EXACT=False)  # fmt: skip
        yield K._plan_sums_kernel, consts, half
    exact = dict(
        BLOCK_M=128,
        BLOCK_N=64,
        BLOCK_D=64,
        D_CHUNKS=8,
        GATED=False,
        MULTIPLY=False,
        SEGMENTED=False,
        EXACT=True,
    )  # the one-pass step of wide features
    yield K._plan_sums_kernel, dict(exact, PRECISION="tf32x3", PRESPLIT=True), True
    yield K._plan_sums_kernel, dict(exact, PRECISION="tf32", PRESPLIT=False), False
    from flashot.backends.triton._attend import COMBINE_TILE
    from flashot.backends.triton._combine import _combine_kernel

    rows, cols = COMBINE_TILE  # the split merge's tiles as launched
    yield _combine_kernel, dict(BLOCK=rows, BLOCK_P=cols, HAS_V=True), False
    yield _combine_kernel, dict(BLOCK=128, BLOCK_P=1, HAS_V=False, UNIT_SUMS=True), False
    yield (
        K._update_kernel,
        dict(BLOCK=1024, RELAXED_X=True, RELAXED_Y=False, CHECK=True, GATED=True, LOG_SUMS=False),
        False,
    )
    from flashot.backends.triton import _split

    for lo_bits in (_split.SCORE_LO_BITS, _split.VALUE_LO_BITS):
        yield _split._split_kernel, dict(HEADROOM=_split.HEADROOM, LO_BITS=lo_bits,
                                         BLOCK=_split.BLOCK), False  # fmt: skip
    from flashot.backends.triton import _triples, _vjp

    vjp = dict(
        BLOCK_N=64,
        BLOCK_K=64,
        SPLIT=True,
        WITH_K=True,
        PRECISION="tf32x3",
        V_PRECISION="tf32x3",
        EXTRA_SIDE=0,
    )
    # general values (3xTF32 scores), a row-sum cotangent; split scores; one value
    # column with split weights and keys (the replay's transforms); triples, p = 1
    for extra, half in (
        (dict(BLOCK_M=32, BLOCK_D=64, BLOCK_P=32, P_CHUNKS=2, EXTRA_SIDE=1, PRESPLIT=False,
              OUTER=False, KV_SPLIT=False), False),
        (dict(BLOCK_M=64, BLOCK_D=64, BLOCK_P=64, P_CHUNKS=1, PRESPLIT=True, OUTER=False,
              KV_SPLIT=False), True),
        (dict(BLOCK_M=128, BLOCK_D=64, BLOCK_P=16, P_CHUNKS=1, PRESPLIT=True, OUTER=True,
              KV_SPLIT=True), True),
        (dict(BLOCK_M=64, BLOCK_D=16, BLOCK_P=16, P_CHUNKS=1, PRECISION="tf32", PRESPLIT=False,
              OUTER=True, KV_SPLIT=False), False),
        (dict(BLOCK_M=128, BLOCK_D=16, BLOCK_P=16, P_CHUNKS=1, PRECISION="tf32", PRESPLIT=False,
              OUTER=True, KV_SPLIT=True), True),
        # the column sums in the rows' launch (VJP_FUSED_COLUMNS), both weight forms
        (dict(BLOCK_M=128, BLOCK_D=64, BLOCK_P=16, P_CHUNKS=1, PRESPLIT=True, OUTER=True,
              KV_SPLIT=True, COLS=True), True),
        (dict(BLOCK_M=64, BLOCK_D=16, BLOCK_P=16, P_CHUNKS=1, PRECISION="tf32", PRESPLIT=False,
              OUTER=True, KV_SPLIT=False, WITH_K=False, COLS=True), False),
    ):  # fmt: skip
        yield _vjp._plan_vjp_kernel, dict(vjp, **extra), half
    # a symmetric step's two reverse products in one launch: split, 3xTF32, triples (values
    # per tile or split once); a self problem's (no column sums)
    from flashot.backends.triton import _sym_vjp

    sym = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, BLOCK_K=64, SPLIT=True, V_PRECISION="tf32x3",
               V_SPLIT=False, COLS0=True)  # fmt: skip
    narrow = dict(PRECISION="tf32", PRESPLIT=False, BLOCK_D=16, BLOCK_K=16)
    for extra, half in (
        (dict(PRECISION="ieee", PRESPLIT=True, V_SPLIT=True), True),
        (dict(PRECISION="tf32x3", PRESPLIT=False), False),
        (dict(narrow, SPLIT=False), False),
        (dict(narrow, BLOCK_M=64, BLOCK_N=32, V_SPLIT=True), True),
        (dict(narrow, BLOCK_M=64, BLOCK_N=32, V_SPLIT=True, COLS0=False), True),
    ):
        yield _sym_vjp._sym_vjp_kernel, dict(sym, **extra), half

    yield _triples._triple_kernel, dict(WIDTH=_triples.TRIPLE_WIDTH,
                                        BLOCK_N=_triples.BLOCK_N), False  # fmt: skip
    # cached scores (._scores): the matrix's kernel (split parts, d512 chunks) and the
    # streaming kernels reading it (PRECISION "cached", one-column views)
    from flashot.backends.triton import _scores

    yield _scores._scores_kernel, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, D_CHUNKS=8,
                                       PRECISION="ieee", PRESPLIT=True), True  # fmt: skip
    cached = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_D=16, D_CHUNKS=1, PRECISION="cached",
                  PRESPLIT=False, SEGMENTED=False, MULTIPLY=False)  # fmt: skip
    yield K._plan_sums_kernel, dict(cached, GATED=True, EXACT=False), False
    yield K._attend_kernel, {**base, **plain, "BLOCK_D": 16, "D_CHUNKS": 1, "SPLIT": True,
                             "PRECISION": "cached", "V_PRECISION": "tf32x3",
                             "SEGMENTED": False, "PRESPLIT": False, "V_SPLIT": False,
                             "P_LOOP": 1}, False  # fmt: skip
    yield _sym_vjp._sym_vjp_kernel, dict(sym, PRECISION="cached", PRESPLIT=False,
                                         BLOCK_D=16), False  # fmt: skip
    # the pair-cost kernels: soft-minimum or kernel sum, dense or block-sparse, product
    # form (feature chunks) or differences, and both gradient sides
    from flashot.backends.triton import _configs
    from flashot.backends.triton import _pair_functions as pf
    from flashot.backends.triton import _pairwise as pw

    tiles = dict(BLOCK_M=64, BLOCK_N=64, PRECISION="tf32x3")
    # (cost, differences, BLOCK_D, chunks, kernel sum, block-sparse, split score operands)
    for cost, diff, block_d, chunks, total, sparse, presplit in (
        (pf.distance, True, 16, 1, False, False, False),
        (pf.distance, False, 64, 1, False, True, True),
        (pf.distance, False, 64, 1, False, False, True),
        (pf.distance, False, 64, 1, False, False, False),
        (pf.half_square, False, 64, 4, False, False, True),
        (pf.half_square, False, 64, 4, False, False, False),
        (pf.gaussian, True, 16, 1, True, False, False),
        (pf.energy, False, 64, 1, True, False, True),
    ):
        tiles_fwd = _configs.PAIRWISE_DIFF_TILES if diff else _configs.PAIRWISE_FORWARD_TILES
        bm, bn = (64, tiles_fwd[1]) if sparse else tiles_fwd[:2]  # (as launched)
        for repair in (False, True) if cost is pf.distance and not sparse else (False,):
            yield pw._softmin_kernel, dict(tiles, BLOCK_M=bm, BLOCK_N=bn, COST=cost,
                                           BLOCK_D=block_d, D_CHUNKS=chunks, DIFF=diff,
                                           SUM=total, SPARSE=sparse, PRESPLIT=presplit,
                                           REPAIR=repair), False  # fmt: skip
    # the window sums of a symmetric step (both sides, or a self problem's columns)
    from flashot.backends.triton import _pair_sums

    bm, bn = _configs.PAIRWISE_SUMS_TILES[:2]
    for diff, block_d, presplit in ((True, 16, False), (False, 64, True), (False, 64, False)):
        for rows in (True, False):
            yield _pair_sums._pair_sums_kernel, dict(
                tiles, BLOCK_M=bm, BLOCK_N=bn, COST=pf.distance, BLOCK_D=block_d, D_CHUNKS=1,
                DIFF=diff, PRESPLIT=presplit, ROWS=rows,
            ), False  # fmt: skip
    for cost, grad, diff, columns, total, sparse, presplit in (
        (pf.distance, pf.distance_grad, True, False, False, False, False),
        (pf.distance, pf.distance_grad, False, True, False, False, True),
        (pf.distance, pf.distance_grad, False, False, False, False, True),
        (pf.distance, pf.distance_grad, False, True, False, False, False),
        (pf.laplacian, pf.laplacian_grad, False, False, True, True, True),
        (pf.energy, pf.energy_grad, True, True, True, False, False),
    ):
        yield pw._grad_kernel, dict(tiles, COST=cost, GRAD=grad, BLOCK_D=64, DIFF=diff,
                                    COLUMNS=columns, SUM=total, SPARSE=sparse,
                                    PRESPLIT=presplit), False  # fmt: skip


def main() -> int:
    for fn, consts, half in variants():
        start = time.perf_counter()
        try:
            compile_for_hopper(fn, consts, half)
        except (RuntimeError, FileNotFoundError) as err:
            if "ptxas" in str(err).lower():
                print(f"SKIP: no CUDA toolchain in this triton ({err})")
                return 0
            raise
        print(f"ok {fn.__name__} {consts} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
