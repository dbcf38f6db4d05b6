"""What is alive at the peak of a GPU call: the allocator's trace, replayed.

Runs the HVP whole call of ``gpu_hvp.py`` (loss, gradient with create_graph, double
backward; the peer's setup) once warm, records the caching allocator's history, finds
the moment of the largest total of live blocks allocated inside the call, and prints
those blocks with the innermost flashot frames that allocated them.
Env: N (50000), D (64), TOL (3e-2).
"""

import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashot
from flashot.autodiff.second_order import dual_solve_options

N, D = int(os.environ.get("N", 50000)), int(os.environ.get("D", 64))
TOL = float(os.environ.get("TOL", 3e-2))


def call(x, y, v):
    xs = x.detach().requires_grad_()
    with dual_solve_options(cg_tol=TOL, cg_max_iter=5000):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)(xs, y)
        (g,) = torch.autograd.grad(loss, xs, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), xs)
    return h


def frames(event):
    out = []
    for f in event.get("frames", []):
        name = f.get("filename", "")
        if "flashot" in name or "gpu_memory" in name:
            out.append(f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}")
    return out[:4]


torch.manual_seed(0)
x, y, v = (torch.randn(N, D, device="cuda") for _ in range(3))
call(x, y, v)
call(x, y, v)
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
torch.cuda.memory._record_memory_history(max_entries=200_000)
call(x, y, v)
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
unit = N * D * 4
live, cur, best, best_set = {}, 0, 0, {}
for trace in snap["device_traces"]:
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_set = cur, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
print(f"n={N} d={D} tol={TOL}: peak extra {peak_mb:.1f} MB (allocator); "
      f"traced peak {best / 2**20:.1f} MB "
      f"= {best / unit:.2f} clouds of {unit / 2**20:.1f} MB")
groups: Counter = Counter()
for e in best_set.values():
    groups[(e["size"], " < ".join(frames(e)))] += 1
for (size, where), count in sorted(groups.items(), key=lambda t: -t[0][0] * t[1]):
    if size * count >= unit // 20:
        print(f"{count:3d} x {size / 2**20:8.2f} MB  {where}")
