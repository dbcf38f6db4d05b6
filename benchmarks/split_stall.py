"""The default's split operands on a labeled self problem (v21 finding; interpreter or GPU).

OTDD between two 6-class Gaussian mixtures (n = 96, d = 64, costs ≈ 300, ε = 5 with
ε-scaling), debiased: the float64 torch reference, then the Triton backend with
``presplit`` on and off. On the 2-core VM under ``TRITON_INTERPRET=1`` (2026-12-02):
presplit=True stalled the cross problem at a marginal error of 1.07e-5 (416
iterations, a ConvergenceWarning) where presplit=False converged in 236; distance error 1.3e-7 and
3.4e-8 of the cost. Forcing the second step's probe (argv[1] = "probe") changed nothing.
About 12 minutes per run in the interpreter.

    TRITON_INTERPRET=1 python benchmarks/split_stall.py noprobe 1,0
"""

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from flashot import datasets  # noqa: E402
from flashot.backends import triton as tb  # noqa: E402
from flashot.backends.triton import TritonBackend  # noqa: E402
from flashot.otdd import dataset_distance  # noqa: E402

n, d = 96, 64
if sys.argv[1:2] == ["probe"]:
    tb.PROBE_ROWS, tb.PROBE_FROM = 8, 16
splits = sys.argv[2] if len(sys.argv) > 2 else "1,0"
(xa, ya), (xb, yb) = (datasets.gaussian_mixture(n, d, 6, seed=s, spread=3.0) for s in (0, 1))
xa, xb = 3.0 * xa, 3.0 * xb
kw = dict(eps=5.0, eps_schedule="geomloss", diagonal=True, max_iter=2000)
ref = dataset_distance(xa.double(), ya, xb.double(), yb, backend="torch", **kw)
print("float64 reference", float(ref.distance), "cross cost", float(ref.result.cost), flush=True)
for presplit in [s == "1" for s in splits.split(",")]:
    t = time.time()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = dataset_distance(xa, ya, xb, yb, backend=TritonBackend(presplit=presplit), **kw)
    err = abs(float(got.distance) - float(ref.distance)) / float(ref.result.cost)
    notes = [str(x.message)[:140] for x in w if "divide" not in str(x.message)]
    print(f"presplit={presplit}: error/cost {err:.2e}, cross problem {got.result.n_iter} "
          f"iterations, {time.time() - t:.0f} s, warnings {notes}", flush=True)
