"""One harness for flashot's GPU benchmarks: timing, memory, floors, reporting.

Timing: ``triton.testing.do_bench`` medians after a warm-up (compilation and
autotuning excluded); long workloads are timed with CUDA events over a few runs.
Results are CSV and markdown tables stamped with the GPU and software versions.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

# Ceilings measured on the lent H200 (../shared/GPU.md), per second.
CEILINGS = {"exp2": 4.04e12, "tf32": 360e12, "bf16": 687e12, "fp32_fma": 51e12, "hbm": 4.27e12}
# Tensor-core FLOP rate of one score dot per precision mode (3xTF32 = three TF32 MMAs).
MODE_RATE = {"tf32": 360e12, "bf16": 687e12, "fp16": 687e12, "fp32": 120e12}


def environment() -> dict:
    """GPU and versions, for every result file."""
    import triton

    import flashot

    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    else:  # kernels under Triton's interpreter, or the torch backend
        cpu = platform.processor() or platform.machine()
        gpu = f"none (CPU {cpu}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"
    return dict(
        gpu=gpu,
        torch=torch.__version__,
        triton=triton.__version__,
        flashot=flashot.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d"),
    )


def sinkhorn_floor_ms(
    n: int, m: int, d: int, iters: int, mode: str, exps_per_elem: float = 1.0
) -> dict:
    """Lower bounds of ``iters`` Sinkhorn iterations: exps, tensor-core FLOPs, bytes.

    One QKᵀ (2nmd FLOPs) and ``exps_per_elem`` exponentials per matrix element per
    iteration; bytes: read both clouds once per iteration.
    """
    exp_ms = 1e3 * iters * exps_per_elem * n * m / CEILINGS["exp2"]
    mma_ms = 1e3 * iters * 2.0 * n * m * d / MODE_RATE[mode]
    bytes_ms = 1e3 * iters * 4.0 * (n + m) * d / CEILINGS["hbm"]
    return dict(
        exp_ms=exp_ms, mma_ms=mma_ms, bytes_ms=bytes_ms, floor_ms=max(exp_ms, mma_ms, bytes_ms)
    )


def median_ms(fn, long: bool = False) -> float:
    """Median wall time of ``fn`` on the GPU in ms (fn already warmed up)."""
    if not long:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[1])


def peak_extra_mb(fn) -> float:
    """Peak GPU memory allocated during ``fn`` beyond what was allocated before, in MB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e6


def first_call_s(fn) -> float:
    """Seconds of the first call (compilation + autotuning + run)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def write(rows: list[dict], out_dir: str | Path, name: str) -> Path:
    """Write rows to ``name.csv`` and ``name.md`` (with the environment); return the csv path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    env = environment()
    with open(out / f"{name}.csv", "w", newline="") as fh:
        fh.write("# " + json.dumps(env) + "\n")
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(out / f"{name}.md", "w") as fh:
        fh.write(f"{env}\n\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
        for r in rows:
            fh.write("| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |\n")
    return out / f"{name}.csv"


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return "" if v is None else str(v)
