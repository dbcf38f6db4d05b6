"""Wide P @ V: a program per value chunk (each recomputing the scores) or one looping.

The plan product after a 10-iteration solve (what the gradient's value pass does), n =
10k/50k, d = 512/1024: ``_configs.VALUE_TILE_CAP`` 128 (shipped), 256, 64, then one
program over all chunks (``VALUE_LOOP_FROM``, running products in the output). The
occupancy cache is keyed by tiles, not by value width: splits follow the first run's.

    python benchmarks/value_chunks.py
"""

import torch
from triton.testing import do_bench

import flashot
from flashot.backends.triton import _configs

for n, d in ((10_000, 512), (50_000, 512), (50_000, 1024)):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.randn(n, d, device="cuda", generator=gen) for _ in range(2))
    plan = flashot.sinkhorn(x, y, eps=0.1, tol=None, max_iter=10, update="symmetric").plan
    ref = None
    for cap, loop in ((128, None), (256, None), (64, None), (128, 256)):
        _configs.VALUE_TILE_CAP, _configs.VALUE_LOOP_FROM = cap, loop
        try:
            out = plan @ y
            ref = out if ref is None else ref
            ms = do_bench(lambda: plan @ y, warmup=5, rep=300 if n <= 10_000 else 1500)
            diff = float((out - ref).abs().max())
            print(f"n={n} d={d} cap={cap} loop={loop}: P@y {ms:.2f} ms, max diff {diff:.2e}",
                  flush=True)  # fmt: skip
        except Exception as err:  # (tiles that do not fit: say so, go on)
            print(f"n={n} d={d} cap={cap} loop={loop}: {type(err).__name__}: {str(err)[:100]}",
                  flush=True)  # fmt: skip
    _configs.VALUE_TILE_CAP, _configs.VALUE_LOOP_FROM = 128, None
