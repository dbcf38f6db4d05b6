"""Count the sm_90 instructions in the streaming loops of the hot kernels, without a GPU.

Compiles each case as the JIT would specialize it at a large solve (feature strides 1
as constexprs, pointers and sizes 16-divisible), disassembles the cubin with Triton's
bundled ``nvdisasm`` and reports the largest loop: instructions per tile, per score
element of a thread, its MUFU (exp2, sqrt) count and spills. Where a loop issues more
instructions than its MUFU ops keep the special-function units busy (8 cycles per warp
instruction on an SMSP against one issue a cycle), the count predicts the loop's time.
Without the specializations Triton does not vectorize the loads and the counts mislead.
The count is the static loop body: both sides of a branch in it (the pair kernels'
recomputation of tiles holding near pairs, which runs on few tiles) and one trip of a
nested loop (the differences path's loop over the d features) — compare a loop with
itself across changes rather than across kernels.

Run as a script (not under ``TRITON_INTERPRET``); ``python tests/probes/sass_loops.py
[substring]`` prints the cases whose name contains it. Prints ``SKIP`` without a
CUDA toolchain in this Triton.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton
from compile_hopper import FLOATS  # (the kernels' float arguments, listed once)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: feature and value-column strides: 1 at every real launch, so constexprs
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_kvd", "sxd", "syd", "stride_vp", "stride_op",
                "stride_dp"}  # fmt: skip
#: a feature stride that is not 1 where a case gives its row stride as 1 (feature-major
#: clouds: ``_pair_operands.FEATURE_MAJOR``)
ROW_STRIDES = {"sxd": "sxn", "syd": "syn", "stride_qd": "stride_qn"}
#: integers the kernels exclude from specialization (do_not_specialize)
UNSPECIALIZED = {"temp_at", "gate_span", "n_bucket", "m_bucket"}


def compile_like_jit(fn, consts: dict, half=(), warps: int = 4, stages: int = 2):
    """``fn`` compiled for sm_90 with ``consts``; pointers named in ``half`` are float16."""
    sig, attrs, constexprs = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name in UNIT_STRIDES and ROW_STRIDES.get(name) not in consts:
            sig[name], constexprs[name] = "constexpr", 1
            continue
        if name in FLOATS:
            sig[name] = "fp32"
            continue
        if name in ("BLOCKS", "PTR", "IV"):
            sig[name] = "*i32"
        elif name[0].isupper():
            sig[name] = "*fp16" if name in half else "*fp32"
        else:
            sig[name] = "i32"
        if name not in UNSPECIALIZED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, sig, constexprs, attrs)
    options = dict(num_warps=warps, num_stages=stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _nvdisasm() -> str:
    import triton.backends.nvidia as nvidia

    return str(Path(nvidia.__file__).parent / "bin" / "nvdisasm")


def loops(cubin: bytes) -> list[tuple[int, collections.Counter]]:
    """Every backward branch's body in the SASS: ``(instructions, opcode counts)``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True).stdout
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            addr = int(ins.group(1), 16)
            labels.update({p: addr for p in pending})
            pending = []
            code.append((addr, ins.group(2).strip()))
    found = []
    for addr, ins in code:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ins)
        if target and labels.get(target.group(1), addr + 1) < addr:
            body = [t for a, t in code if labels[target.group(1)] <= a <= addr]
            ops = collections.Counter(
                (t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in body
            )
            found.append((len(body), ops))
    return found


def cases():
    """``(name, kernel, constexprs, half pointers, scores per thread of a tile[, warps,
    stages])``."""
    from flashot.backends.triton import _attend, _plan_sums, _vjp
    from flashot.backends.triton import _pair_functions as pf
    from flashot.backends.triton import _pairwise as pw

    sums = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_D=64, D_CHUNKS=1, GATED=True, SEGMENTED=False,
                MULTIPLY=False, EXACT=False)  # fmt: skip
    kernel = _plan_sums._plan_sums_kernel
    yield "plan_sums tf32", kernel, dict(sums, PRECISION="tf32", PRESPLIT=False), (), 64
    yield "plan_sums split", kernel, dict(sums, PRECISION="ieee", PRESPLIT=True), ("Q", "K"), 64
    yield "plan_sums bf16", kernel, dict(sums, PRECISION="ieee", PRESPLIT=False), ("Q", "K"), 64
    # cached scores (._scores): the pass reads its scores, no MMA
    for dot in ("cached", "cached_t"):
        consts = dict(sums, BLOCK_D=16, PRECISION=dot, PRESPLIT=False)
        if dot == "cached_t":  # (the transposed view: rows of stride 1, the matrix's row
            consts["stride_qn"] = 1  # stride, 16-divisible, as its feature stride)
        yield f"plan_sums {dot}", kernel, consts, (), 64
    # the one-pass exact step of wide features (d ≥ 256), as sm_90.json tiles it for d512
    exact = dict(sums, BLOCK_M=128, BLOCK_N=64, D_CHUNKS=8, GATED=False, EXACT=True)
    exact_split = dict(exact, PRECISION="ieee", PRESPLIT=True)
    yield "exact pass split d512 (8 warps)", kernel, exact_split, ("Q", "K"), 32, 8, 3
    att = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, BLOCK_P=64, HAS_V=False, POTENTIAL_BIAS=True,
               REPAIR=True, SPLIT=False, SEGMENTED=False, V_SPLIT=False, P_LOOP=1)  # fmt: skip
    for chunks in (1, 8):
        # (d512 split: 64 × 128 as sm_90.json ships it; 128 × 64 spills 86 instructions)
        tiles = dict(BLOCK_M=64, BLOCK_N=128) if chunks == 8 else {}
        yield (
            f"attend split d{64 * chunks}",
            _attend._attend_kernel,
            dict(
                att, D_CHUNKS=chunks, PRECISION="ieee", V_PRECISION="ieee", PRESPLIT=True, **tiles
            ),
            ("Q", "K"),
            64,
        )
        yield (
            f"attend 3xtf32 d{64 * chunks}",
            _attend._attend_kernel,
            dict(att, D_CHUNKS=chunks, PRECISION="tf32x3", V_PRECISION="tf32x3", PRESPLIT=False),
            (),
            64,
        )
    for dot in ("cached", "cached_t"):  # (row passes and value products on cached scores)
        consts = dict(att, BLOCK_D=16, D_CHUNKS=1, PRECISION=dot, V_PRECISION="tf32x3",
                      PRESPLIT=False)  # fmt: skip
        if dot == "cached_t":
            consts["stride_qn"] = 1
        yield f"attend {dot}", _attend._attend_kernel, consts, (), 64
        yield (f"attend {dot} P @ V (64 of 512 values)", _attend._attend_kernel,
               dict(consts, HAS_V=True, REPAIR=False), (), 64)  # fmt: skip
        yield (f"attend {dot} P @ V split values", _attend._attend_kernel,
               dict(consts, HAS_V=True, REPAIR=False, V_SPLIT=True), ("V",), 64)  # fmt: skip
    vjp = dict(BLOCK_M=128, BLOCK_N=64, SPLIT=True, WITH_K=True, PRECISION="ieee",
               V_PRECISION="tf32x3", EXTRA_SIDE=0, BLOCK_P=16, P_CHUNKS=1, PRESPLIT=True,
               OUTER=True, KV_SPLIT=True, COLS=False)  # fmt: skip
    yield (
        "reverse product (replay) d3 triples",
        _vjp._plan_vjp_kernel,
        dict(vjp, BLOCK_D=16, BLOCK_K=16, PRECISION="tf32", PRESPLIT=False),
        ("KV",),
        64,
    )
    for bd in (16, 64):
        yield (
            f"reverse product (replay) d{bd}",
            _vjp._plan_vjp_kernel,
            dict(vjp, BLOCK_D=bd, BLOCK_K=bd),
            ("Q", "K", "KV"),
            64,
        )
    from flashot.backends.triton import _configs, _sym_vjp

    bm, bn, warps, stages = _configs.SYM_VJP_TILES
    sym = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=64, BLOCK_K=64, SPLIT=True, PRECISION="ieee",
               V_PRECISION="tf32x3", PRESPLIT=True, V_SPLIT=True, COLS0=True)  # fmt: skip
    yield ("symmetric reverse (replay) d64", _sym_vjp._sym_vjp_kernel, sym,
           ("Q", "K", "KV0", "KV1"), bm * bn // (32 * warps), warps, stages)  # fmt: skip
    # d = 3 on triples (one TF32 MMA of K = 16), values split; a self problem's (mirror)
    # without the column atomics
    bm, bn, warps, stages = _configs.SYM_VJP_NARROW_TILES
    triples = dict(sym, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=16, BLOCK_K=16, PRECISION="tf32",
                   PRESPLIT=False)  # fmt: skip
    for cols, name in ((True, "symmetric reverse (replay) d3"), (False, "mirror reverse d3")):
        yield (name, _sym_vjp._sym_vjp_kernel, dict(triples, COLS0=cols), ("KV0", "KV1"),
               bm * bn // (32 * warps), warps, stages)  # fmt: skip
    pair = dict(PRECISION="tf32x3", COST=pf.distance, SUM=False, SPARSE=False)
    bm, bn, warps, _ = _configs.PAIRWISE_FORWARD_TILES
    fwd = dict(pair, BLOCK_M=bm, BLOCK_N=bn)
    per_fwd = bm * bn // (32 * warps)
    bm, bn, warps, _ = _configs.PAIRWISE_DIFF_TILES
    fwd_diff = dict(pair, BLOCK_M=bm, BLOCK_N=bn)
    per_diff = bm * bn // (32 * warps)
    bm, bn, warps, _ = _configs.PAIRWISE_TILES
    grad = dict(pair, BLOCK_M=bm, BLOCK_N=bn, GRAD=pf.distance_grad, BLOCK_D=64, DIFF=False)
    per_grad = bm * bn // (32 * warps)
    for split in (True, False):
        half = ("XP", "YP") if split else ()
        yield (
            f"softmin p=1 d64 split={split}",
            pw._softmin_kernel,
            dict(fwd, BLOCK_D=64, D_CHUNKS=1, DIFF=False, PRESPLIT=split, REPAIR=False),
            half,
            per_fwd,
        )
        for cols in (False, True):
            yield (
                f"pair gradient p=1 d64 columns={cols} split={split}",
                pw._grad_kernel,
                dict(grad, COLUMNS=cols, PRESPLIT=split),
                half,
                per_grad,
            )
    from flashot.backends.triton import _pair_sums

    bm, bn, warps, stages = _configs.PAIRWISE_SUMS_TILES
    window = dict(COST=pf.distance, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=64, D_CHUNKS=1,
                  DIFF=False, PRECISION="tf32x3", PRESPLIT=True)  # fmt: skip
    per = bm * bn // (32 * warps)
    for rows in (True, False):
        name = f"window pass p=1 d64 {'rows' if rows else 'self'}"
        kernel = _pair_sums._pair_sums_kernel
        yield name, kernel, dict(window, ROWS=rows), ("XP", "YP"), per, warps, stages
    yield (
        "softmin p=1 d3 (differences)",
        pw._softmin_kernel,
        dict(fwd_diff, BLOCK_D=16, D_CHUNKS=1, DIFF=True, PRESPLIT=False, REPAIR=False),
        (),
        per_diff,
    )
    half_square = dict(grad, COST=pf.half_square, GRAD=pf.half_square_grad, BLOCK_D=16,
                       DIFF=True, PRESPLIT=False, COLUMNS=False, RADIAL=True,
                       SPARSE=True)  # fmt: skip
    for linear in (False, True):
        yield (f"pair gradient p=2 d3 (differences, sparse) linear={linear}", pw._grad_kernel,
               dict(half_square, LINEAR=linear), (), per_grad)  # fmt: skip
    # as shipped: feature-major clouds (row strides 1), the LINEAR gradient
    major = dict(sxn=1, syn=1)
    yield ("softmin p=2 d3 (differences, sparse, feature-major)", pw._softmin_kernel,
           dict(fwd_diff, COST=pf.half_square, BLOCK_M=64, BLOCK_D=16, D_CHUNKS=1, DIFF=True,
                PRESPLIT=False, REPAIR=False, SPARSE=True, **major), (), 64 * fwd_diff["BLOCK_N"]
           // 128)  # fmt: skip
    yield ("pair gradient p=2 d3 (differences, sparse, feature-major)", pw._grad_kernel,
           dict(half_square, LINEAR=True, **major), (), per_grad)  # fmt: skip


def main(pattern: str = "") -> int:
    print(f"{'case':44s} {'loop':>6s} {'/score':>7s} {'MUFU':>5s} {'spills':>6s}")
    for name, fn, consts, half, per_thread, *launch in cases():
        if pattern not in name:
            continue
        try:
            kernel = compile_like_jit(fn, consts, half, *launch)
        except (RuntimeError, FileNotFoundError) as err:
            if "ptxas" in str(err).lower():
                print(f"SKIP: no CUDA toolchain in this triton ({err})")
                return 0
            raise
        size, ops = max(loops(kernel.asm["cubin"]), key=lambda loop: loop[0])
        spills = ops["LDL"] + ops["STL"]
        print(f"{name:44s} {size:6d} {size / per_thread:7.1f} {ops['MUFU']:5d} {spills:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
