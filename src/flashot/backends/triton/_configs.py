"""Tile shapes, autotuning spaces and column splitting, in one place.

On a GPU each kernel is autotuned over a small, pruned set of configurations,
keyed on the feature size and power-of-two buckets of n and m (so a new problem
size in the same bucket reuses the choice). Under the interpreter one small fixed
configuration keeps CPU tests fast.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton

from flashot.backends.device import triton_interpreted


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` on the host (``triton.cdiv`` is a constexpr function: ~2 µs a call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of 2 ≥ n, on the host (see :func:`cdiv`); 0 for n ≤ 0, as Triton's."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


__all__ = [
    "attend_configs",
    "balanced_splits",
    "block_d",
    "block_p",
    "bucket",
    "buckets",
    "column_splits",
    "fits",
    "plan_sums_configs",
    "resident_programs",
    "sm_count",
]


#: sizes from 2^BUCKET_CAP up share one autotuning bucket: with hundreds of row blocks
#: per SM wave the best tiles no longer depend on size, and tuning there costs minutes
BUCKET_CAP = 16


def bucket(size: int) -> int:
    """Power-of-two bucket of a size (capped at :data:`BUCKET_CAP`): the autotuning key."""
    return min(BUCKET_CAP, max(0, int(math.log2(max(size, 1)))))


def largest_bucket(offsets) -> int:
    """The size bucket of the largest problem of a packing (B + 1 offsets)."""
    return bucket(max(b - a for a, b in itertools.pairwise(offsets)))


def buckets(n: int, m: int, segments=None) -> tuple[int, int]:
    """The tile key's size buckets of rows and columns (a packed batch: its largest problem's)."""
    if segments is None:
        return bucket(n), bucket(m)
    return largest_bucket(segments.rows), largest_bucket(segments.cols)


def block_d(d: int, itemsize: int = 4) -> tuple[int, int]:
    """(BLOCK_D, D_CHUNKS): features per chunk (≥ 16 for tensor cores) and chunk count.

    Up to 128 features are one chunk (hoisted out of the streaming loop). Beyond, the
    chunk is 128 bytes per row (32 float32 or 64 half features), so that the feature
    loop pipelines with 3 stages in shared memory: measured on the H200 at n = 50k,
    d = 512, per pass, 128-feature chunks took 20.9 ms (tf32 attend) and 6.9 ms (bf16),
    32-feature chunks 11.2 ms (tf32), 64-feature chunks 5.5 ms (bf16).
    """
    if triton_interpreted():
        return 16, cdiv(d, 16)
    if d <= 128:
        return max(16, next_pow2(d)), 1
    bd = 128 // itemsize
    return bd, cdiv(d, bd)


#: most value columns per program on a GPU. Each further chunk of values recomputes the
#: scores, yet wider chunks were not faster: a gradient at n = 10k, d = 512 (p = 512) on
#: the H200 took 16.5 ms (tf32) / 11.2 (bf16) with 64, 17.9 / — with 128, 16.9 / 13.2 with 256
#: (v8); the pass alone, v17: tf32 5.25 / 3.80 / 4.14 ms, fp32 (split values) 8.77 / 7.42 /
#: 11.05 with 64 / 128 / 256
VALUE_TILE_CAP = 128


def block_p(p: int) -> int:
    """Value columns per chunk (more chunks: programs on the grid's third axis, or looped)."""
    cap = 16 if triton_interpreted() else VALUE_TILE_CAP
    return min(max(16, next_pow2(p)), cap)


#: from this many value columns (None: never) one attend program loops over all value
#: chunks with its running products in the output (``P_LOOP``), so that each tile's
#: weights are computed once, instead of a program per chunk that recomputes the scores.
#: P @ y after a 10-iteration solve on the H200 (v31, ``benchmarks/value_chunks.py``), a
#: program per 128-wide chunk against the loop: 10k d512 10.9 → 8.1 ms, 50k d512 248 →
#: 184 ms, 50k d1024 850 → 357 ms (bitwise the same products). Two chunks (p ≤ 256) are
#: not measured, so they keep a program each.
VALUE_LOOP_FROM: int | None = 256


#: with cached scores (``TritonBackend(scores=...)``) the loop too, or a program per
#: value chunk that reads its tiles' scores again (a load and an exponential a score,
#: no d-wide product) and keeps its products in registers: the loop's running products
#: go through memory each tile (64 × 512 floats twice at d = 512). Measured (H100, v56,
#: 50k d512, 10 iterations with ∇x): the loop 239 ms, a program per chunk 209 ms
#: (predicted ~40 ms less: the gradient's product was 126 ms of the loop's call).
CACHED_VALUE_LOOP = False

#: with cached scores in "fp32", value products split the values once per solve and
#: the weights per tile (three half MMAs, as split score operands do) instead of 3xTF32,
#: which splits both per tile (sm_90 count, P @ V on the transposed view: 28.3 → 21.5
#: instructions a score, and half MMAs at twice the TF32 rate)
CACHED_SPLIT_VALUES = True


def value_loop(p: int, cached: bool = False) -> int:
    """``P_LOOP``: the value chunks one program loops over (1: a program per chunk).

    ``cached``: the launch reads cached scores (:data:`CACHED_VALUE_LOOP`).
    """
    chunks = cdiv(p, block_p(p))
    if cached and not CACHED_VALUE_LOOP:
        return 1
    return chunks if VALUE_LOOP_FROM is not None and p >= VALUE_LOOP_FROM and chunks > 1 else 1


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def column_splits(n_row_blocks: int, m: int, block_n: int, device: torch.device) -> int:
    """How many programs share one row block's columns before the tiles are known.

    Aims at ~2 programs per SM and at least 4 column tiles per program (tuning
    launches, and the fixed tiles of the fused ``plan_vjp``; later launches of tuned
    kernels take :func:`balanced_splits`).
    """
    if device.type != "cuda":
        return 1
    want = cdiv(2 * sm_count(device.index or 0), n_row_blocks)
    return max(1, min(want, m // (4 * block_n)))


def column_grid(blocks: int, m: int, block_n: int, device: torch.device,
                splits: int | None = None) -> tuple[int, int]:  # fmt: skip
    """``(splits, per)``: the column splits of a fixed-tile launch over ``blocks`` row blocks.

    ``splits``: a forced count, or None for :func:`column_splits`; ``per`` (the columns a
    split holds) is a multiple of ``block_n``: a tile never crosses into the next split.
    """
    splits = splits or column_splits(blocks, m, block_n, device)
    per = cdiv(cdiv(m, splits), block_n) * block_n
    return cdiv(m, per), per


def resident_programs(kernel, props) -> int | None:
    """Programs of a compiled kernel that one SM holds at once (None if unknown).

    The least of the register, shared-memory, warp and block limits: registers are
    allocated per warp in units of 256, shared memory with 1 KB reserved per block.
    ``props``: the device's properties (``torch.cuda.get_device_properties``).
    """
    try:
        regs, warps = int(kernel.n_regs), int(kernel.metadata.num_warps)
        smem = int(kernel.metadata.shared)
    except (AttributeError, TypeError):
        return None
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    per_warp = cdiv(max(regs, 1) * 32, 256) * 256
    limits = (regs_sm // (per_warp * warps), smem_sm // (smem + 1024), threads_sm // (32 * warps))
    return max(1, min(32, *limits))


#: a program's fixed cost (its stationary tile, pipeline fill, epilogue) in streamed
#: items, weighed against the idle SMs of a partial last wave
PROGRAM_OVERHEAD = 256


@functools.cache
def balanced_splits(units: int, moving: int, slots: int, most: int) -> tuple[int, int]:
    """(splits, items per split) that make the fewest, fullest waves of programs.

    ``units`` stationary blocks each stream ``moving`` items, cut into splits of a
    multiple of 128 items (of every tile); ``slots`` programs run at once on the GPU.
    The time is modelled as waves × (items per split + :data:`PROGRAM_OVERHEAD`): at
    n = 50k, 782 blocks of 64 columns fill 528 slots in 1.48 waves, which run as 2
    (nsight: 20.7 % achieved occupancy of a possible 25 %); 2 splits make 2.96 waves.
    """
    best = None
    for want in range(1, max(1, most) + 1):
        per = cdiv(cdiv(moving, want), 128) * 128
        splits = cdiv(moving, per)
        if splits > 1 and per < 512:  # at least 4 tiles of ≤128 items per program
            break
        cost = cdiv(units * splits, slots) * (per + PROGRAM_OVERHEAD)
        if best is None or cost < best[0]:
            best = (cost, splits, per)
    assert best is not None  # (one split always fits)
    return best[1], best[2]


def _configs(block_ms, block_ns, warps, stages):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm in block_ms
        for bn in block_ns
        for w in warps
        for s in stages
    ]


def attend_configs() -> list:
    """Search space of ``_attend_kernel`` (pruned per call by :func:`prune`)."""
    return _configs((64, 128), (32, 64, 128), (4, 8), (2, 3))


def plan_sums_configs() -> list:
    """Search space of ``_plan_sums_kernel``.

    BLOCK_N stationary columns, BLOCK_M streamed rows; the (BLOCK_M, BLOCK_N) column
    accumulator lives in registers.
    """
    return _configs((64, 128), (64, 128, 256), (4, 8), (2, 3))


def fits(config, d: int) -> bool:
    """Whether tiles can pay off at feature size d (register and shared-memory pressure)."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    if d > 128 and bm * bn > 128 * 64:
        return False
    return not (bm * bn > 128 * 128 or (bm * bn >= 128 * 128 and config.num_warps < 8))


def prune(configs, named_args, **kwargs):
    """Drop tiles that cannot pay off (:func:`fits`)."""
    keep = [c for c in configs if fits(c, named_args["d"])]
    return keep or configs[:1]


def _step_down(config):
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    stages = config.num_stages
    if stages > 2:
        stages -= 1
    elif max(bm, bn) > 32:
        bm, bn = (bm // 2, bn) if bm >= bn else (bm, bn // 2)
    elif stages > 1:
        stages = 1
    else:
        return None
    return triton.Config({**config.kwargs, "BLOCK_M": bm, "BLOCK_N": bn},
                         num_warps=config.num_warps, num_stages=stages)  # fmt: skip


def _footprint(config) -> int:
    """A rough measure of a tile's shared memory: both blocks, once per stage."""
    return (config.kwargs["BLOCK_M"] + config.kwargs["BLOCK_N"]) * config.num_stages


def smaller(config, need: int | None = None, have: int | None = None):
    """The next tiles to try when ``config`` needs more shared memory than the GPU has.

    Fewer pipeline stages first (each holds a copy of the streamed tiles), then half
    the larger block, down to 32 × 32 with one stage; None below that. Given the bytes
    the launch asked for (``need``) and the GPU's (``have``), steps that would still
    ask for too much by :func:`_footprint`'s proportion are skipped (each try compiles
    the kernel: seconds on a first call).
    """

    def too_big(tiles) -> bool:
        if not need or not have:
            return False
        return need * _footprint(tiles) > have * _footprint(config)

    step = _step_down(config)
    while step is not None and too_big(step):
        further = _step_down(step)
        if further is None:
            break
        step = further
    return step


#: the reverse plan product's (:mod:`._vjp`) tiles (BLOCK_M, BLOCK_N, warps, stages) on a
#: GPU for wide values and for narrow ones (p ≤ 16); the interpreter takes 16 × 16.
#: Narrow at d = 3 (v44, H100, GeomLoss' defaults at 10k): 128 × 64 × 4 × 2 0.50 ms
#: against 0.62–1.18 for nine others. Wide: measured on the H200 (HISTORY.md v13,
#: 3xTF32 scores), 32 × 64 fastest for p = 65; 8 warps then gave wrong sums and illegal
#: addresses under Triton 3.6. Narrow (split scores and keys, v42, H100, one launch of
#: the replay at 10k d = 64): 128 × 64 4 warps 0.87 ms, 8 warps 0.79, 64 × 64 1.14–1.50,
#: 64 × 128 0.94, 32 × 64 1.17 (3xTF32 before: 1.68)

VJP_TILES = (32, 64, 4, 2)
VJP_NARROW_TILES = (128, 64, 4, 2)
#: ... narrow at d = 65…128: 128 × 64 takes up to 257 KB of shared memory there (float32
#: score operands: the "tf32" mode, small problems, clouds past the split operands' cap;
#: 250 KB with split operands and p > 1), over sm_90's 227 KB (found offline by
#: tests/probes/launch_shared.py, v47; never launched at those widths on a GPU)
VJP_NARROW_WIDE_TILES = (64, 64, 4, 2)
#: both LSEs at given potentials (a solve's first step, a replayed schedule's steps) from
#: one exact pass in "fp32" (``TritonBackend.potential_lse``) instead of two row passes.
#: Off: no faster where it would serve (H100, v47, one process, on/off twice: the peer's
#: HVP setting at 10k d = 64 70–72 against 70–75 ms whole, HVP error 3.2e-5 either way;
#: GeomLoss' defaults at 10k, d = 3 and 64, within the runs' spread); sm_90 counts 24–27
#: instructions a score for it against 2 × 13.7 for two row passes
ONE_PASS_LSE = False
#: from this many score elements (n · m; None: never) a replayed step's two LSEs come from
#: the fused step's sums, stabilized by the solve's own iterates (one exp a score for both
#: sides, a row pass's cost for two; ``TritonBackend.potential_lse(stabilized=True)``).
#: Measured (H100, v49, the peer's HVP setting, d64, whole call): 10k 55.7 → 50.7 ms, 50k
#: 1 013 → 880 ms, HVP error 3.3e-5 → 3.2e-5; below 10k × 10k untimed (NOTES.md)
STABILIZED_LSE_FROM: int | None = 10_000 * 10_000
#: a replayed symmetric step's two reverse products in one launch (:mod:`._sym_vjp`: one
#: score tile and two exps a score against three launches' three and three), up to
#: SYM_VJP_UP_TO features. sm_90 counts at d = 64, split operands: 41 instructions a
#: score against 3 × 20 (v47). Measured (H100, v48, the peer's HVP setting, 10k d64): HVP
#: 48.0 → 32.5 ms, whole call 70.5 → 54.6, error 3.2e-5 either way (NOTES.md)
SYM_VJP = True
SYM_VJP_UP_TO = 64
#: its tiles (two accumulators of BLOCK_M × d). H100, v48, the HVP at 10k d64 (ms):
#: 128 × 64 × 8 warps 32.5; 64 × 64 × 4, 3 stages 39.5; 64 × 64 × 4 42.7; 64 × 128 × 4
#: 43.2; 128 × 32 × 4 55.3; 128 × 64 × 4 66.5 (spills); 128 × 128 × 8 does not launch
#: (234 496 bytes of shared memory)
SYM_VJP_TILES = (128, 64, 8, 2)
#: ... at ≤ 16 padded features (triples, d ≤ 5; values split: 105 registers, 4 programs an
#: SM). H100, v58, GeomLoss' defaults 10k d = 3, HVP alone, two rounds: 128 × 64 × 8
#: 11.09 ms, 64 × 32 × 4 10.91, 128 × 128 × 8 10.91 (3 spills with column sums, offline);
#: split parts of 6…16 features take them too (untimed)
SYM_VJP_NARROW_TILES = (64, 32, 4, 2)
#: its tiles past 64 features, by padded width (the module's own callers; the backend
#: stops at SYM_VJP_UP_TO): 128 × 64 needed 295 424 bytes of shared memory at d = 70 (H100,
#: v48); these take 132–148 KB (128) and 98–197 KB (256) at sm_90 (launch_shared.py)
SYM_VJP_WIDE_TILES = {128: (64, 32, 4, 2), 256: (64, 32, 4, 1)}
#: values wider than this stream in chunks of it (not hoisted)
VJP_P_CHUNK = 32
#: 17…64 value columns at ≤ 64 score features (the envelope's row average backward, p = d)
#: in one chunk of 64 (None: VJP_TILES, chunks of 32). sm_90 counts at d = 64, split
#: operands: 128 × 64 × 8 warps 41.4 instructions a score, no spills, 197 KB (213 KB on
#: float32 clouds), against 84.7 for 32 × 64 × 4 in two chunks (v48, offline). Measured
#: (H100, v49, GeomLoss' defaults 10k d64): HVP 24.0 → 21.1 ms, whole 43.3 → 39.1 (64 × 64
#: × 4: 22.7 / 41.9; NOTES.md)
VJP_MID_TILES: tuple | None = (128, 64, 8, 2)
#: a reverse product of one value column that needs the column sums but not their keys
#: (a replayed row transform's) forms them in the rows' launch (one more exp2 per score,
#: atomics per tile) instead of a second launch on the transposed form. Off: timed on an
#: H100 in v46 (`gpu_second_order.py` part P, FUSED=1), one reverse product 0.70 → 0.56
#: ms but the whole HVP 46.7 → 50.5 ms at the peer's setting (10k d64; 28.5 → 29.0 at
#: GeomLoss' defaults, d3)
VJP_FUSED_COLUMNS = False

#: the pair-cost kernels' (:mod:`._pairwise`) tiles on a GPU (BLOCK_M, BLOCK_N, warps,
#: stages): the gradients', the forward's (soft-minima and kernel sums) in the product
#: form and with coordinate differences; the interpreter takes 16 × 16. Not timed:
#: chosen by the sm_90 loop counts of tests/probes/sass_loops.py (v45, instructions per
#: score of the tiles without near pairs at 64 × 64 → 64 × 128: p = 1 d64 19.0 → 14.2,
#: d256 25.3 → 19.3, energy d64 13.9 → 9.6; differences at d = 3 21.2 → 18.5 at 128 × 64,
#: which spill at 64 × 128). The gradients' by an H100 sweep (v46, p = 1 value and
#: gradient at 50k, of 64 × 64, 64 × 32, 128 × 32 (4 warps), 128 × 64 (8 warps)):
#: 64 × 32 ties the best at d = 64 (203 ms against 199–213) and is 7 % faster at d = 3
#: (136 against 146), with no spills at sm_90
PAIRWISE_TILES = (64, 32, 4, 2)
PAIRWISE_FORWARD_TILES = (64, 128, 4, 2)
#: ... the forward's in the product form at BLOCK_D = 128 (d = 65…128 in one chunk):
#: 64 × 128 takes 256 KB of shared memory on float32 clouds (past the split operands'
#: cap), over sm_90's 227 KB (an H100 refused the launch, v47); 64 × 64 takes 160 KB
PAIRWISE_FORWARD_WIDE_TILES = (64, 64, 4, 2)
PAIRWISE_DIFF_TILES = (128, 64, 4, 2)
#: the window sums' (:mod:`._pair_sums`: column-stationary, BLOCK_M the streamed rows),
#: by the sm_90 loop counts (v46): at 128 × 64 p = 1 d64 24.0 instructions a score with
#: row sums (21.5 without; two exact passes 2 × 27.7), no spills; 64 × 128 spills 276
PAIRWISE_SUMS_TILES = (128, 64, 4, 2)

#: autotune only when n·m ≥ 2^TUNE_FROM_LOG2 (smaller solves cost less than tuning them)
TUNE_FROM_LOG2 = 24

#: fixed tiles under the interpreter (tl.dot needs ≥ 16 in every dimension)
INTERPRETER_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}
