"""Value columns per program for wide P @ V: each chunk of them recomputes the scores.

``_configs.VALUE_TILE_CAP`` at 128 (shipped), 256 and 64, for the plan product after a
10-iteration solve (what the gradient's value pass does), n = 10k/50k, d = 512/1024.
The occupancy cache is keyed by tiles, not by value width: splits follow the first cap.

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
    for cap in (128, 256, 64):
        _configs.VALUE_TILE_CAP = cap
        try:
            out = plan @ y
            ref = out if ref is None else ref
            ms = do_bench(lambda: plan @ y, warmup=5, rep=300 if n <= 10_000 else 1500)
            diff = float((out - ref).abs().max())
            print(f"n={n} d={d} cap={cap}: P@y {ms:.2f} ms, max diff from 128 {diff:.2e}",
                  flush=True)  # fmt: skip
        except Exception as err:  # (tiles that do not fit: say so, go on)
            print(f"n={n} d={d} cap={cap}: {type(err).__name__}: {str(err)[:120]}", flush=True)
    _configs.VALUE_TILE_CAP = 128
