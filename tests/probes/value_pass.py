"""Registers, shared memory and occupancy of the attend kernel with and without values.

The gradient's final extrapolation is an attend with values (``W k``): on an H100 at 50k
d64 it takes 3.4–4.4× a plain attend, and already 2× with one value column (v63,
``benchmarks/NOTES.md``). This compiles the loop for sm_90 without a GPU, as
``sass_loops.py`` does, and prints per tile configuration: registers, stack, shared
memory, CTAs and warps an SM, and the loop's instructions a score. ``half`` names the
float16 pointers (``V``: values and weights in float16, the variant to time next).

Run as a script, ``python tests/probes/value_pass.py``; prints ``SKIP`` without a CUDA
toolchain in this Triton.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sass_loops import compile_like_jit, loops

#: sm_90: registers and shared memory an SM, warps an SM
REGISTERS, SHARED, WARPS = 65536, 232448, 64

CASES = [  # (name, PRECISION, half pointers, V_SPLIT and PRESPLIT)
    ("tf32", "tf32", (), False),
    ("tf32, V float16", "tf32", ("V",), False),
    ("bf16", "tf32", ("Q", "K"), False),
    ("bf16, V float16", "tf32", ("Q", "K", "V"), False),
    ("split (default)", "ieee", ("Q", "K", "V"), True),
]
TILES = [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2)]


def usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` a thread, from ``cuobjdump -res-usage``."""
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                              text=True).stdout  # fmt: skip
    return int(re.search(r"REG:(\d+)", text)[1]), int(re.search(r"STACK:(\d+)", text)[1])


def main() -> int:
    from flashot.backends.triton import _attend

    base = dict(BLOCK_D=64, D_CHUNKS=1, POTENTIAL_BIAS=False, REPAIR=False, SPLIT=False,
                SEGMENTED=False, P_LOOP=1, V_PRECISION="tf32")  # fmt: skip
    print(f"{'case':34s} {'regs':>4s} {'stack':>5s} {'smem':>5s} {'CTA':>3s} {'warps':>5s} "
          f"{'/score':>6s}")  # fmt: skip
    for name, precision, half, split in CASES:
        for values in (0, 16, 64):
            for bm, bn, warps, stages in TILES:
                consts = dict(base, PRECISION=precision, PRESPLIT=split, HAS_V=values > 0,
                              V_SPLIT=split and values > 0, BLOCK_P=max(16, values),
                              BLOCK_M=bm, BLOCK_N=bn)  # fmt: skip
                try:
                    kernel = compile_like_jit(_attend._attend_kernel, consts, half, warps, stages)
                except (RuntimeError, FileNotFoundError) as err:
                    if "ptxas" in str(err).lower():
                        print(f"SKIP: no CUDA toolchain in this triton ({err})")
                        return 0
                    raise
                regs, stack = usage(kernel.asm["cubin"])
                smem = kernel.metadata.shared
                ctas = min(
                    REGISTERS // (regs * 32 * warps), SHARED // (smem + 1024), WARPS // warps
                )
                size = max(loops(kernel.asm["cubin"]), key=lambda loop: loop[0])[0]
                label = f"{name} p={values} {bm}x{bn} w{warps} s{stages}"
                print(f"{label:34s} {regs:4d} {stack:5d} {smem // 1024:4d}K {ctas:3d} "
                      f"{ctas * warps:5d} {size * 32 * warps / (bm * bn):6.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
