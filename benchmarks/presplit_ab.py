"""The split-once-per-solve rule (``_operands.PRESPLIT_FROM``) A/B on the bench's call.

The bench's forward and forward + gradient (10 symmetric iterations, N(0, I) clouds,
weights on [0.1, 1.1), ε = 0.1) at the default precision with the rule as shipped,
with every launch split once per solve, and with none, beside flash-sinkhorn in this
process. Each is timed twice, interleaved (do_bench medians, ms), so the table shows
the run-to-run spread next to the difference. Env: CASES ("10000x64,50000x64": n x d),
PEER (0: without the peer), WHO (only these columns, e.g. "default,flash-sinkhorn":
issue 14's default-precision table with CASES=10000x64,50000x64,10000x512,50000x512).

    python benchmarks/presplit_ab.py
"""

import os
import sys
import warnings

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from flashot.backends.triton import _operands
from flashot.bench.providers import Flashot, FlashSinkhorn, make_problem

warnings.simplefilter("ignore")
CASES = [tuple(int(v) for v in c.split("x"))
         for c in os.environ.get("CASES", "10000x64,50000x64").split(",")]  # fmt: skip
dev = torch.device("cuda")
SHIPPED = _operands.PRESPLIT_FROM
RULES = {"default": SHIPPED, "split": 0, "unsplit": 1 << 62}
WHO = [*RULES.items(), *([("flash-sinkhorn", None)] if os.environ.get("PEER", "1") == "1" else [])]
if os.environ.get("WHO"):
    WHO = [(w, r) for w, r in WHO if w in os.environ["WHO"].split(",")]


def timed(call, n):
    call()
    torch.cuda.synchronize()
    return do_bench(call, warmup=25, rep=300 if n <= 10000 else 1000)


rows = {}
for n, d in CASES:
    pb = make_problem(n, n, d, dev, eps=0.1)
    for work in ("forward", "gradient"):
        for _ in range(2):
            for who, rule in WHO:
                provider = FlashSinkhorn() if rule is None else Flashot("triton")
                _operands.PRESPLIT_FROM = SHIPPED if rule is None else rule
                ms = timed(provider.prepare(work, pb), n)
                rows.setdefault((n, d, work, who), []).append(ms)
                print(n, d, work, who, f"{ms:.3f}", flush=True)
        _operands.PRESPLIT_FROM = SHIPPED

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("| n | d | workload | " + " | ".join(w for w, _ in WHO) + " |")
print("|---|---|---|" + "---|" * len(WHO))
for n, d in CASES:
    for work in ("forward", "gradient"):
        cells = [" / ".join(f"{v:.2f}" for v in rows[(n, d, work, w)]) for w, _ in WHO]
        print(f"| {n} | {d} | {work} | " + " | ".join(cells) + " |")
