"""The call GeomLoss users make (issue 14, item 3), against flash-sinkhorn 0.4.1.

``SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, debias=True)``, value and
gradient, uniform data in the unit cube, d = 3, float32. flashot at its default
precision and at tf32; the peer at its defaults (TF32, full squared distance: its
value differs by the p = 2 convention, the ε schedule is the same). do_bench
medians; the first call of each in this process is printed too. Env: SIZES
("10000,50000"), DIMS ("3"), PEER (0 to skip), WHO (only these calls, and the peer). "fp32x3" is
the default precision with the scores' operands split per tile by 3xTF32
(``presplit=False``), as before v16;
"presplit" splits them once per solve at every size (``presplit=True``).
"packed" is the same call on a batch of one, ``loss(x[None], y[None])``: the debiased
divergence's three problems as one packed solve, one launch per pass for all three
(the host-bound 10k case's lever; same value and gradient to float32 accuracy).
MOVING=1 also times each call with x moved by fresh noise (1e-3) every call, as in a
training loop: the bounding diameter, so the ε schedule, changes every call, and no
captured solve replays (rows "... moving").

    python benchmarks/gpu_typical.py
"""

import os
import sys
import time
import warnings

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashot  # noqa: E402
from flashot.backends.triton import TritonBackend  # noqa: E402

warnings.simplefilter("ignore")
SIZES = [int(s) for s in os.environ.get("SIZES", "10000,50000").split(",")]
DIMS = [int(s) for s in os.environ.get("DIMS", "3").split(",")]
CALLS = {
    "flashot default": lambda: flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True),
    "flashot fp32x3": lambda: flashot.SamplesLoss(
        p=2, blur=0.05, scaling=0.5, debias=True, backend=TritonBackend("fp32", presplit=False)
    ),
    "flashot presplit": lambda: flashot.SamplesLoss(
        p=2, blur=0.05, scaling=0.5, debias=True, backend=TritonBackend("fp32", presplit=True)
    ),
    "flashot tf32": lambda: flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True,
                                                precision="tf32"),  # fmt: skip
}


class PackedCall:
    """The call on a batch of one (a packed solve of its three problems)."""

    def __init__(self, **options):
        self.loss = flashot.SamplesLoss(**options)

    def __call__(self, x, y):
        return self.loss(x[None], y[None])[0]


CALLS["flashot default packed"] = lambda: PackedCall(p=2, blur=0.05, scaling=0.5, debias=True)
CALLS["flashot tf32 packed"] = lambda: PackedCall(p=2, blur=0.05, scaling=0.5, debias=True,
                                                   precision="tf32")  # fmt: skip
if os.environ.get("PEER", "1") == "1":
    try:
        import flash_sinkhorn

        CALLS["flash-sinkhorn"] = lambda: flash_sinkhorn.SamplesLoss(p=2, blur=0.05, scaling=0.5,
                                                                     debias=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        print("peer unavailable:", exc)
if os.environ.get("WHO"):  # only these calls (comma-separated names), and the peer
    keep = {*os.environ["WHO"].split(","), "flash-sinkhorn"}  # (PEER=0 leaves it out)
    CALLS = {k: v for k, v in CALLS.items() if k in keep}


def value_and_grad(loss, x, y):
    xs = x.detach().requires_grad_()
    val = loss(xs, y)
    (g,) = torch.autograd.grad(val, xs)
    return val, g


rows = []
for n, dim in [(n, dim) for dim in DIMS for n in SIZES]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(n, dim, device="cuda", generator=gen)
    y = torch.rand(n, dim, device="cuda", generator=gen)
    for who, make in CALLS.items():
        loss = make()
        t0 = time.time()
        val, _ = value_and_grad(loss, x, y)
        torch.cuda.synchronize()
        first = time.time() - t0
        ms = do_bench(lambda: value_and_grad(loss, x, y), warmup=5, rep=50, return_mode="median")
        rows.append((f"{n} d{dim}", who, ms, first, float(val)))
        print(rows[-1], flush=True)
        if os.environ.get("MOVING", "0") == "1":
            moved = lambda: value_and_grad(loss, x + 1e-3 * torch.randn_like(x), y)  # noqa: E731
            ms = do_bench(moved, warmup=5, rep=50, return_mode="median")
            rows.append((f"{n} d{dim}", who + " moving", ms, first, float(val)))
            print(rows[-1], flush=True)

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("case        who                   ms (value+grad)   first call s   value")
for case, who, ms, first, val in rows:
    print(f"{case:<11s} {who:20s} {ms:10.2f} {first:14.1f}   {val:.6g}")
