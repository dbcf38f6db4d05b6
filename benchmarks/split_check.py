"""The split kernel on the GPU against the float64 definition (bit for bit), and its cost.

Largest entries at and one ulp above powers of two, tiny to huge; then do_bench of one
split at 10k and 50k x d 64 (two launches). Mirrors tests/backends/test_split.py, which
runs the kernel under the interpreter.

    python benchmarks/split_check.py
"""

import math
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from flashot.backends.triton._split import split_operand


def reference_split(x):
    top = float(x.abs().max())
    mantissa, exponent = math.frexp(top)
    e = 0 if top == 0 else min(max(14 - (exponent - (mantissa == 0.5)), -120), 120)
    scaled = x.double() * 2.0**e
    hi = scaled.to(torch.float16)
    return torch.stack([hi, ((scaled - hi.double()) * 2.0**11).to(torch.float16)]), 2.0**-e


bad = cases = 0
for k in (-130, -20, 0, 4, 13, 14, 20, 100):
    for n, d in ((1, 1), (10000, 64), (777, 3)):
        for above in (False, True):
            x = torch.randn(n, d, device="cuda")
            x = x / x.abs().max() * 2.0**k
            if above:
                x.view(-1)[0] = torch.nextafter(torch.tensor(2.0**k), torch.tensor(math.inf))
            s = split_operand(x)
            parts, inv = reference_split(x.cpu())
            cases += 1
            same = torch.equal(s.parts.cpu().view(torch.int16), parts.view(torch.int16))
            bad += not same or float(s.inv) != inv
print(f"split kernel vs float64 definition: {bad} mismatches in {cases} cases")
for n in (10_000, 50_000):
    x = torch.randn(n, 64, device="cuda")
    print(f"split {n} x 64: {do_bench(lambda: split_operand(x), warmup=25, rep=200) * 1e3:.1f} us")
