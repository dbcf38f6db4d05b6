"""Where the fp32 default's time goes at wide d (issue 14, item 2): 10k, d = 512.

Times, per precision mode: the forward (10 iterations), forward + gradient, and single
streamed passes — a row LSE, and a row LSE with the values k (p = d, the envelope
gradient's pass) for several value-tile caps (each value chunk recomputes the scores);
the peer's TF32 beside; then a CUDA kernel breakdown of forward + gradient
(torch.profiler). Env: CASES ("10000x512,50000x64": n x d), MODES ("tf32,fp32"),
PASSES, PROFILE, PEER, ACCURACY (each 1: on).

    python benchmarks/gpu_fp32_wide.py
"""

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flashot
from flashot.backends.triton import TritonBackend, _configs
from flashot.geometry.costs import AttentionForm

CASES = [tuple(int(v) for v in c.split("x")) for c in
         os.environ.get("CASES", "10000x512,50000x64").split(",")]  # fmt: skip
rows = []


def bench(name, fn):
    fn()
    torch.cuda.synchronize()
    ms = do_bench(fn, warmup=5, rep=40, return_mode="median")
    rows.append((name, ms))
    print(f"{name:48s} {ms:8.3f} ms", flush=True)


def fwd(be, x, y):
    with torch.no_grad():
        return flashot.sinkhorn(x, y, eps=0.1, max_iter=10, tol=None, backend=be).cost


def fwd_grad(be, x, y):
    xg = x.detach().requires_grad_()
    cost = flashot.sinkhorn(xg, y, eps=0.1, max_iter=10, tol=None, backend=be).cost
    return torch.autograd.grad(cost, xg)[0]


for N, D in CASES:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, D, device="cuda", generator=g)
    y = torch.randn(N, D, device="cuda", generator=g)
    q, k = (2**0.5) * x, (2**0.5) * y
    form = AttentionForm(q, k, -(x * x).sum(1), -(y * y).sum(1))
    h = torch.zeros(N, device="cuda")
    tag = f"{N // 1000}k d{D}"
    if os.environ.get("PEER", "1") == "1":
        from bench_sinkhorn import peer_fn

        w = torch.full((N,), 1.0 / N, device="cuda")
        bench(f"{tag} peer tf32 fwd 10 it", peer_fn("fwd", x, y, w, w))
        bench(f"{tag} peer tf32 fwd+grad", peer_fn("grad", x, y, w, w))
    if os.environ.get("ACCURACY", "1") == "1":
        ref = fwd_grad("torch", x.double(), y.double())
        for presplit in (True, False):
            got = fwd_grad(TritonBackend(presplit=presplit), x, y).double()
            err = float((got - ref).norm() / ref.norm())
            print(f"{tag} fp32 presplit={presplit}: gradient vs float64 {err:.2e}", flush=True)
        del ref
    for mode in os.environ.get("MODES", "tf32,fp32").split(","):
        be = TritonBackend(mode)
        bench(f"{tag} {mode} fwd 10 it", lambda: fwd(be, x, y))
        for cap in (64, 128):
            _configs.VALUE_TILE_CAP = cap
            bench(f"{tag} {mode} fwd+grad, cap {cap}", lambda: fwd_grad(be, x, y))
        _configs.VALUE_TILE_CAP = 128
        if os.environ.get("PASSES", "1") != "1":
            continue
        with be.operand_scope():
            bench(f"{tag} {mode} one row LSE (in scope)", lambda: be.row_attend(form, h, 1.0))
            for cap in (64, 128, 256):
                _configs.VALUE_TILE_CAP = cap
                bench(f"{tag} {mode} LSE + values k, cap {cap} (scope)",
                      lambda: be.row_attend(form, h, 1.0, form.k))  # fmt: skip
            _configs.VALUE_TILE_CAP = 128

if os.environ.get("PROFILE", "1") == "1":
    be = TritonBackend("fp32")
    fwd_grad(be, x, y)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fwd_grad(be, x, y)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
for name, ms in rows:
    print(f"{name:48s} {ms:8.3f}")
