r"""The hardware floor of a flashot row: its operation count at ceilings measured here.

Per streamed pass over the n × m score matrix: one exponential per element and one
score product of :math:`2nmd` tensor-core FLOPs (three of them in the accurate fp32
mode: split operands), and the gradient's pass a second product with the d-wide values.
A fixed-iteration solve with symmetric updates takes ``iters + 2`` passes (start and
final extrapolation; one fused pass per iteration serves both sides with one
exponential per element). The ceilings are measured in the same run: a device-to-device
copy, ``torch.matmul`` at each precision, and a Triton kernel of back-to-back ``exp2``.
The floor is the largest of the exp, MMA and byte times: the time no kernel can beat.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["Ceilings", "floor_ms", "measure_ceilings"]


class Ceilings(dict):
    """Measured rates per second: ``exp2``, ``bytes`` and matmul ``tf32``/``bf16``/``fp32``."""


def _median_s(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


@functools.cache
def _exp_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def exp_loop(X, Y, n, REPS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(X + offs, mask=offs < n, other=0.0)
        acc = tl.zeros_like(v)
        for _ in range(REPS):  # dependent exps: no load per exponential
            v = tl.exp2(v * -0.5)
            acc += v
        tl.store(Y + offs, acc, mask=offs < n)

    return exp_loop


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth, matmul rates and exp2 throughput of a CUDA device (a few seconds)."""
    with torch.cuda.device(device):
        big = torch.empty(1 << 28, device=device, dtype=torch.uint8)  # 256 MB
        out = torch.empty_like(big)
        copy = 2 * big.numel() / _median_s(lambda: out.copy_(big))
        rates = {}
        k = 8192
        for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                  ("bf16", torch.bfloat16, False)):  # fmt: skip
            a = torch.randn(k, k, device=device, dtype=dtype)
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32  # restored below: never left changed
            try:
                rates[name] = 2 * k**3 / _median_s(lambda a=a: a @ a)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
        n, reps, block = 1 << 24, 64, 1024
        x = torch.rand(n, device=device)
        y = torch.empty_like(x)
        kernel = _exp_kernel()
        exps = n * reps / _median_s(lambda: kernel[(n // block,)](x, y, n, REPS=reps, BLOCK=block))
    return Ceilings(bytes=copy, exp2=exps, **rates)


def floor_ms(ceilings: Ceilings | None, workload: str, n: int, m: int, d: int, iters: int,
             precision: str) -> float | None:  # fmt: skip
    """The floor of a flashot row in ms (None without ceilings, for converge and hvp).

    Fixed iterations (and the gradient's pass), or the plan's product alone.
    """
    if ceilings is None or workload not in ("forward", "gradient", "plan"):
        return None
    passes = 0 if workload == "plan" else iters + 2
    products = {"fp32": 1.5, "tf32": 1.0, "bf16": 0.5, "fp16": 0.5}[precision]
    # fp32: three half MMAs at the bf16 rate = 1.5 TF32 products; bf16/fp16 at their rate
    rate = ceilings["tf32"]
    flops = passes * 2.0 * n * m * d * products
    exps = passes * n * m
    bytes_moved = passes * 4.0 * (n + m) * d
    if workload in ("gradient", "plan"):
        flops += 2.0 * n * m * d * products * 2  # the values' pass: scores and P @ y
        exps += n * m
        bytes_moved += 4.0 * (n + 2 * m) * d
    return 1e3 * max(exps / ceilings["exp2"], flops / rate, bytes_moved / ceilings["bytes"])
