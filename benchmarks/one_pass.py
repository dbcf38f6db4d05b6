"""The one-pass step of wide features against the fused pass + gate (A/B), and the peer.

``ONE_PASS_FROM_D`` (:mod:`flashot.backends.triton`, 256 since v26; fp32 only): from this
d a step streams its score tiles once with two exps per score (:mod:`._one_pass`: row
LSE and column (max, sum) partials, no window; their budget is lifted here, so "one pass"
is also timed where the default keeps the fused path) instead of the one-exp fused
pass, whose gate sends the first steps of a small-ε solve to two exact passes. First
one pass of each kernel at PASSES ("50000x512,10000x512": n x d) in a solve's operand
scope; then forward (10 symmetric iterations, as ``flashot bench``: N(0, I) clouds,
weights on [0.1, 1.1)) and forward + gradient, do_bench medians in ms, and the relative
error of the cost against float64 at n = 1000. Env: SIZES, DIMS, EPS ("0.1,scaled": 0.1
and 0.1·d), PEER (1: flash-sinkhorn in this process), PRECISION (flashot's, "auto"),
EXACT_TILES (the exact pass also at these tiles, e.g. "128x32x8x3,64x128x8x3").

    python benchmarks/one_pass.py
"""

import functools
import os
import sys
import warnings

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
import flashot
from flashot.backends import triton as backend
from flashot.bench.providers import Flashot, FlashSinkhorn, make_problem

warnings.simplefilter("ignore")
SIZES = [int(s) for s in os.environ.get("SIZES", "10000,50000").split(",")]
DIMS = [int(s) for s in os.environ.get("DIMS", "128,256,512").split(",")]
EPS = os.environ.get("EPS", "0.1,scaled").split(",")
PEER = os.environ.get("PEER", "1") == "1"
PRECISION = os.environ.get("PRECISION", "auto")
dev = torch.device("cuda")
MODES = {"fused+gate": None, "one pass": 1}  # ONE_PASS_FROM_D: none, every d
#: the exact pass also at these tiles (BLOCK_M x BLOCK_N x warps x stages), for its spill
EXACT_TILES = [
    tuple(int(v) for v in c.split("x")) for c in os.environ.get("EXACT_TILES", "").split(",") if c
]
PASSES = [
    tuple(int(v) for v in c.split("x"))
    for c in os.environ.get("PASSES", "50000x512,10000x512").split(",")
    if c
]


def timed(provider, pb, grad):
    """The bench's own call of a provider (forward, or forward + gradient)."""
    return provider.prepare("gradient" if grad else "forward", pb)


def rel_error(d, eps, precision="auto"):
    pb = make_problem(1000, 1000, d, dev, eps=eps, seed=1)
    kw = dict(eps=eps, tol=None, max_iter=10, update="symmetric")
    ref = flashot.sinkhorn(pb.x.double().cpu(), pb.y.double().cpu(), pb.a.double().cpu(),
                           pb.b.double().cpu(), backend="torch", **kw).cost  # fmt: skip
    got = flashot.sinkhorn(pb.x, pb.y, pb.a, pb.b, precision=precision, **kw).cost
    return abs(float(got) - float(ref)) / abs(float(ref))


def exact_at(be, tiles, form, f, g, la, lb):
    """The exact pass with the tile lookup answering ``tiles``."""
    from flashot.backends.triton import _one_pass

    be._table_tiles = lambda *args: tiles
    try:
        return _one_pass.exact_lse(be, form, f, g, la, lb, 0.1)
    finally:
        del be._table_tiles


def passes():
    """One pass of each kernel, in a solve's operand scope (split operands), ms."""
    from flashot.backends.triton import TritonBackend, _one_pass
    from flashot.geometry.costs import attention_form, get_cost

    for n, d in PASSES:
        be = TritonBackend()
        pb = make_problem(n, n, d, dev, eps=0.1)
        form = attention_form(get_cost("sqeuclidean"), pb.x, pb.y).detach()
        f, g = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        la, lb = pb.a.log(), pb.b.log()
        with be.operand_scope():
            calls = {
                "fused plan_sums": lambda: be.plan_sums(form, f, g, la, lb, 0.1, shift=18.0),
                "attend rows": lambda: be._attend(form.q, form.k, 0.1, (g, form.beta, lb)),
                "plan_sums exact": lambda: _one_pass.exact_lse(be, form, f, g, la, lb, 0.1),
            }
            for bm, bn, w, st in EXACT_TILES:  # the table's lookup answers these tiles
                tiles = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
                calls[f"exact {bm}x{bn}x{w}x{st}"] = functools.partial(
                    exact_at, be, tiles, form, f, g, la, lb
                )
            out = []
            for name, call in calls.items():
                call()
                torch.cuda.synchronize()
                out.append(f"{name} {do_bench(call, warmup=25, rep=400):.3f}")
        print(f"pass n={n} d={d}: " + ", ".join(out), flush=True)


from flashot.backends.triton import _one_pass  # noqa: E402

_one_pass.partials_budget = lambda n, m, d: 1 << 40  # measure beyond the budget
if PASSES:
    passes()
rows = []
for d in DIMS:
    for e in EPS:
        eps = 0.1 * d if e == "scaled" else float(e)
        for n in SIZES:
            pb = make_problem(n, n, d, dev, eps=eps)
            for grad in (False, True):
                if grad and e == "scaled":
                    continue
                for mode, thr in MODES.items():
                    backend.ONE_PASS_FROM_D = thr
                    first = n == SIZES[0] and not grad
                    err = rel_error(d, eps, PRECISION) if first else float("nan")
                    f = timed(Flashot("triton", PRECISION), pb, grad)
                    f()
                    torch.cuda.synchronize()
                    ms = do_bench(f, warmup=25, rep=300 if n <= 10000 else 1500)
                    rows.append((d, e, n, "fwd+grad" if grad else "fwd", mode, ms, err))
                    print(*rows[-1], flush=True)
                backend.ONE_PASS_FROM_D = None
                if PEER and d == 512 and e != "scaled":
                    f = timed(FlashSinkhorn(), pb, grad)
                    f()
                    torch.cuda.synchronize()
                    ms = do_bench(f, warmup=25, rep=300 if n <= 10000 else 1500)
                    rows.append((d, e, n, "fwd+grad" if grad else "fwd", "flash-sinkhorn", ms,
                                 float("nan")))  # fmt: skip
                    print(*rows[-1], flush=True)

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
print(
    "| d | ε | n | workload | default: fused+gate | one pass | flash-sinkhorn |"
    " rel. error (n=1000) |"
)
print("|---|---|---|---|---|---|---|---|")
keys = sorted({r[:4] for r in rows}, key=lambda k: (k[0], k[1], k[3], k[2]))
for k in keys:
    got = {r[4]: r for r in rows if r[:4] == k}
    cell = lambda m: f"{got[m][5]:.2f}" if m in got else "—"  # noqa: E731
    err = got.get("one pass", got.get("fused+gate"))[6]
    print(
        f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {cell('fused+gate')} | {cell('one pass')} | "
        f"{cell('flash-sinkhorn')} | {err:.1e} |"
    )
