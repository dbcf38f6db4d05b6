"""What one split of the accurate mode's operands costs on the GPU (two launches).

do_bench of ``split_operand`` at 10k and 50k × d 64. Its correctness, bit for bit
against the float64 definition, is ``tests/test_gpu.py``'s
``test_split_kernel_matches_the_definition_bit_for_bit``.

    python benchmarks/split_check.py
"""

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from flashot.backends.triton._split import split_operand

for n in (10_000, 50_000):
    x = torch.randn(n, 64, device="cuda")
    print(f"split {n} x 64: {do_bench(lambda: split_operand(x), warmup=25, rep=200) * 1e3:.1f} us")
