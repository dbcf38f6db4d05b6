"""First calls in fresh processes (issue 14, item 1): compile-only cold start.

Each case runs twice in a new Python process: first with an empty Triton cache
(``TRITON_CACHE_DIR`` pointed at a new folder; the tile tables as shipped), then again
with that cache warm. Times are wall seconds of the call (import excluded), synchronized.

    python benchmarks/cold_start.py
"""

import os
import subprocess
import sys
import tempfile

CASES = {
    "sinkhorn 50k d64 fp32, eps 0.1, 10 it": (
        "x = torch.randn(50000, 64, device='cuda'); y = torch.randn(50000, 64, device='cuda')\n"
        "call = lambda: flashot.sinkhorn(x, y, eps=0.1, max_iter=10, tol=None).cost"
    ),
    "SamplesLoss 10k d3 blur .05 value+grad": (
        "x = torch.rand(10000, 3, device='cuda', requires_grad=True)\n"
        "y = torch.rand(10000, 3, device='cuda')\n"
        "loss = flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True)\n"
        "call = lambda: torch.autograd.grad(loss(x, y), x)"
    ),
    "hvp 10k d64 eps 0.09": (
        "x, y, v = (torch.randn(10000, 64, device='cuda') for _ in range(3))\n"
        "call = lambda: flashot.hvp(x, y, v, eps=0.09, eps_schedule=flashot.EpsilonScaling(0.9))"
    ),
}
TIMER = """
import time, torch, flashot
{setup}
torch.cuda.synchronize(); t0 = time.perf_counter(); call(); torch.cuda.synchronize()
print(f"{{time.perf_counter() - t0:.2f}}")
"""

env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="cold_triton_"))
env.pop("FLASHOT_AUTOTUNE", None)
print("case                                       cold s   warm-cache s", flush=True)
for name, setup in CASES.items():
    times = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", TIMER.format(setup=setup)], env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        times.append(run.stdout.strip().splitlines()[-1] if run.returncode == 0 else "failed")
        if run.returncode:
            print(run.stderr[-2000:], flush=True)
    print(f"{name:42s} {times[0]:>7s}   {times[1]:>7s}", flush=True)
