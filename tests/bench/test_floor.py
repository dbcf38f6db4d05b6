"""Floors of the workloads (flashot.bench.floor) from the measured ceilings."""

import pytest

from flashot.bench.floor import Ceilings, floor_ms


def test_floor_is_the_largest_of_exp_mma_and_bytes():
    ceil = Ceilings(exp2=4e12, tf32=360e12, bf16=687e12, fp32=51e12, bytes=4e12)
    n, d, it = 50_000, 64, 10
    passes = it + 2
    exp_ms = 1e3 * passes * n * n / 4e12
    mma_ms = 1e3 * passes * 2 * n * n * d * 1.5 / 360e12
    assert floor_ms(ceil, "forward", n, n, d, it, "fp32") == pytest.approx(max(exp_ms, mma_ms))
    assert floor_ms(ceil, "forward", n, n, d, it, "bf16") == pytest.approx(exp_ms)
    assert floor_ms(None, "forward", n, n, d, it, "fp32") is None
    assert floor_ms(ceil, "converge", n, n, d, it, "fp32") is None
