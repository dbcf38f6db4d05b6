"""Where the unrolled SamplesLoss HVP spends its time on the GPU (issue 48): one double
backward at the peer's setting (blur 0.3, scaling 0.9, d = 64, N points), profiled;
prints kernel time against wall time and the top ops by device and by host time."""

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashot

N = int(os.environ.get("N", "10000"))
torch.manual_seed(0)
x, y, v = (torch.randn(N, 64, device="cuda") for _ in range(3))
loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)
xs = x.detach().requires_grad_()
(g,) = torch.autograd.grad(loss(xs, y), xs, create_graph=True)
for _ in range(2):
    torch.autograd.grad((g * v).sum(), xs, retain_graph=True)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    torch.autograd.grad((g * v).sum(), xs, retain_graph=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
ev = prof.key_averages()
dev = sum(e.self_device_time_total for e in ev) / 1e3
print(f"wall {wall * 1e3:.1f} ms, device kernels {dev:.1f} ms")
print(ev.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
