"""Timing, memory, accuracy and the rows of one suite (see :mod:`flashot.bench`)."""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import flashot
from flashot.bench.floor import Ceilings, floor_ms, measure_ceilings
from flashot.bench.providers import Flashot, Problem, Provider, direction, make_problem

__all__ = [
    "Row",
    "environment",
    "largest_sizes",
    "median_ms",
    "run_suite",
    "skipped_by_a_smaller_budget",
]

#: points per cloud of the float64 accuracy reference (dense, on the CPU or the device)
ACCURACY_N = 1000
#: a call slower than this (s) is timed by two wall-clock calls instead of do_bench's dozens
SLOW_CALL_S = 1.0
#: workloads whose ε is ``eps × d`` (a fixed fraction of the cost's scale, 2d for N(0, I)
#: clouds, so that every d is as hard as the others: ε = 0.1 at d = 64 is near ε = 0)
SCALED_EPS = ("converge", "hvp")
#: --largest does not run a size predicted over this multiple of its budget
PREDICTED_OVER = 1.5


@dataclasses.dataclass
class Row:
    """One (workload, provider, size) result. Times in ms, memory in MB above the inputs."""

    workload: str
    provider: str
    n: int
    d: int
    ms: float | None = None
    first_s: float | None = None
    peak_mb: float | None = None
    value: float | None = None
    floor_ms: float | None = None
    rel_error: float | None = None
    skipped: str | None = None
    computes: str = ""

    @property
    def x_floor(self) -> float | None:
        """Time over the floor (None without a floor)."""
        return None if self.ms is None or not self.floor_ms else self.ms / self.floor_ms


def environment(device: torch.device, command: str | None = None) -> dict:
    """Versions, device and command (default: this process's), stamped on every result file."""
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = (
            f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
    versions = {"flashot": flashot.__version__, "torch": torch.__version__,
                "python": platform.python_version()}  # fmt: skip
    for module in ("triton", "geomloss", "ot", "flash_sinkhorn", "pykeops"):
        with contextlib.suppress(Exception):  # absent or broken: not part of this run
            versions[module] = __import__(module).__version__
    return dict(device=hardware, versions=versions, command=command or " ".join(sys.argv),
                date=time.strftime("%Y-%m-%d %H:%M"))  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: do_bench's window on a GPU (ms): at least MIN_SAMPLES timed calls, within [50, 1000].
#: A fixed 50 ms took the median of 2 calls of a 22 ms host-bound solve (v30's converge
#: row at 10k read 22.8 ms after a 13 ms first call).
MIN_SAMPLES = 7


def gpu_window_ms(call_ms: float) -> float:
    """do_bench's ``rep`` for a call of ``call_ms``: MIN_SAMPLES calls, clamped to [50, 1000]."""
    return min(1000.0, max(50.0, MIN_SAMPLES * call_ms))


def median_ms(fn: Callable, device: torch.device, budget_s: float = 2.0) -> float:
    """Median time of ``fn`` after a warm-up: CUDA events on a GPU, wall clock on a CPU."""
    if device.type == "cuda":
        import triton.testing

        _sync(device)
        t0 = time.perf_counter()
        fn()  # (also a warm-up call) its time sets the window
        _sync(device)
        rep = gpu_window_ms(1e3 * (time.perf_counter() - t0))
        return float(triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median"))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < 25 and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _with_peak(fn: Callable, device: torch.device):
    """``(fn(), peak MB above the memory before)``; the peak is None on a CPU."""
    if device.type != "cuda":
        return fn(), None  # the CPU allocator keeps no peak statistics
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    return out, (torch.cuda.max_memory_allocated(device) - base) / 1e6


def _slow_call(fn: Callable, device: torch.device) -> tuple[float, float | None]:
    """(ms, peak MB) of a slow call: the faster of two wall-clock calls, the peak of both."""

    def twice() -> float:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
        return min(times)

    return _with_peak(twice, device)


def _reference(pb: Problem, workload: str) -> float:
    """The float64 value of the same workload (flashot's torch backend).

    Dense-checked in the test suite; for ``converge`` the converged value.
    """
    x, y, a, b = (t.double() for t in (pb.x, pb.y, pb.a, pb.b))
    if workload == "hvp":
        v = direction(pb).double()
        hv = flashot.hvp(x, y, v, a, b, eps=pb.eps, tol=1e-10, max_iter=100_000, backend="torch")
        assert isinstance(hv, torch.Tensor)  # (one direction: one tensor)
        return float((v * hv).sum())
    kw: dict[str, Any] = dict(eps=pb.eps, backend="torch", warn=False)
    if workload == "otdd":
        from flashot.bench.providers import otdd_labels
        from flashot.tasks.otdd import dataset_distance

        ya, yb = otdd_labels(pb)
        return float(dataset_distance(x, ya, y, yb, diagonal=True, tol=None, max_iter=pb.iters,
                                      update="symmetric", **kw).distance)  # fmt: skip
    if workload == "plan":
        res = flashot.sinkhorn(x, y, a, b, tol=None, max_iter=pb.iters, update="symmetric", **kw)
        return float((res.plan @ y).sum())
    if workload == "converge":
        kw.update(tol=1e-8, max_iter=100_000, eps_schedule="geomloss")
    else:
        kw.update(tol=None, max_iter=pb.iters, update="symmetric")
    return float(flashot.sinkhorn(x, y, a, b, **kw).cost)


def run_suite(workloads: Iterable[str], sizes: Iterable[int], dims: Iterable[int],
              chosen: list[Provider], device: torch.device, *, eps: float = 0.1,
              iters: int = 10, tol: float = 1e-3, floors: bool = True,
              row_budget_s: float = 30.0,
              progress: Callable[[str], None] | None = None,
              done: Mapping[tuple, Row] | None = None,
              saved: Callable[[list[Row]], None] | None = None) -> list[Row]:  # fmt: skip
    """Every (workload, d, n, provider) row; providers that cannot run give a skip row.

    Sizes run in increasing order; a provider whose call at the previous size predicts
    (time × (n / n_prev)², the n·m work) more than ``row_budget_s`` seconds per call is
    skipped at the larger size, with the prediction as the reason. ``done``: rows of an
    earlier run keyed by ``(workload, provider, n, d)``, taken as they are (a resumed
    run); ``saved`` is called with the rows so far after each one (a run cut short
    keeps them).
    """
    done = done or {}
    ceilings: Ceilings | None = None
    if floors and device.type == "cuda":
        ceilings = measure_ceilings(device)
    rows = []
    sizes = sorted(sizes)
    for workload in workloads:
        for d in dims:
            e = eps * d if workload in SCALED_EPS else eps
            ref_n = min(ACCURACY_N, *sizes)
            ref_pb = make_problem(ref_n, ref_n, d, device, eps=e, iters=iters, tol=tol, seed=1)
            reference = _reference(ref_pb, workload)
            last: dict[str, Row] = {}
            for n in sizes:
                pb = make_problem(n, n, d, device, eps=e, iters=iters, tol=tol)
                for prov in chosen:
                    if (workload, prov.name, n, d) in done:
                        rows.append(done[(workload, prov.name, n, d)])
                        last[prov.name] = rows[-1]
                        continue
                    if progress is not None:
                        progress(f"{workload} n={n} d={d} {prov.name}")
                    prev = last.get(prov.name)
                    guess = 0.0  # the n·m work from the previous size
                    if prev is not None and prev.ms is not None:
                        guess = prev.ms / 1e3 * (n / prev.n) ** 2
                    if prev is not None and guess > row_budget_s:
                        row = Row(workload, prov.name, n, d, computes=prov.computes)
                        row.skipped = (f"predicted {guess:.0f} s per call from n={prev.n} "
                                       f"{_OVER_BUDGET.format(row_budget_s)}")  # fmt: skip
                    else:
                        row = _row(prov, workload, pb, ref_pb, reference, device, ceilings)
                    rows.append(row)
                    last[prov.name] = row
                    if progress is not None:
                        progress(f"  {_summary(row)}")
                    if saved is not None:
                        saved(rows)
    return rows


_OVER_BUDGET = "(over the row budget of {:g} s)"
_OVER_BUDGET_READ = re.compile(r"\(over the row budget of ([^ ]+) s\)$")


def skipped_by_a_smaller_budget(row: Row, row_budget_s: float) -> bool:
    """Whether ``row`` was skipped by a row budget smaller than ``row_budget_s``.

    A resumed run with a larger budget runs such a row again (its previous size predicts
    it anew); every other row of the earlier run is kept as it is.
    """
    found = _OVER_BUDGET_READ.search(row.skipped or "")
    return found is not None and float(found.group(1)) < row_budget_s


def _summary(row: Row) -> str:
    """One line of a finished row (so a run cut short still leaves its numbers in the log)."""
    if row.skipped is not None:
        return f"skipped: {row.skipped}"
    peak = "" if row.peak_mb is None else f", peak {row.peak_mb:.0f} MB"
    return (f"{row.ms:.3g} ms (first call {row.first_s:.2g} s{peak}), value {row.value:.7g}, "
            f"rel. error at n={ACCURACY_N} {row.rel_error:.1e}")  # fmt: skip


def _row(prov: Provider, workload: str, pb: Problem, ref_pb: Problem, reference: float,
         device: torch.device, ceilings: Ceilings | None) -> Row:  # fmt: skip
    row = Row(workload, prov.name, pb.n, pb.d, computes=prov.computes)
    why = prov.unavailable(device)
    if why is None and workload not in prov.workloads:
        why = f"{prov.name} has no {workload} workload here"
    if why is not None:
        row.skipped = why
        return row
    grad_mode = torch.is_grad_enabled()  # a failing peer may leave it off (GeomLoss' loop)
    try:
        check = float(prov.prepare(workload, ref_pb)())
        row.rel_error = abs(check - reference) / max(abs(reference), 1e-30)
        fn = prov.prepare(workload, pb)
        _sync(device)
        t0 = time.perf_counter()
        row.value = float(fn())
        _sync(device)
        row.first_s = time.perf_counter() - t0
        if row.first_s > SLOW_CALL_S:  # (do_bench would call it dozens of times)
            row.ms, row.peak_mb = _slow_call(fn, device)
        else:
            row.ms = median_ms(fn, device)
            row.peak_mb = _with_peak(fn, device)[1]
        if not prov.torch_memory:
            row.peak_mb = None
    except Exception as err:
        row.skipped = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row
    finally:
        torch.set_grad_enabled(grad_mode)
    if isinstance(prov, Flashot) and prov.backend == "triton":
        precision = "fp32" if prov.precision == "auto" else prov.precision
        row.floor_ms = floor_ms(ceilings, workload, pb.n, pb.n, pb.d, pb.iters, precision)
    return row


def largest_sizes(workloads: Iterable[str], dims: Iterable[int], chosen: list[Provider],
                  device: torch.device, budget_s: float, *, start: int = 1000,
                  cap: int = 1 << 22, eps: float = 0.1, iters: int = 10, tol: float = 1e-3,
                  progress: Callable[[str], None] | None = None) -> list[Row]:  # fmt: skip
    """The largest n = m each provider computes a workload at in one call of ``budget_s``.

    n doubles from ``start`` up to ``cap``; a call at ``start`` first compiles and warms
    up, untimed; a call over the budget is repeated once, since a library may compile or
    autotune at a new size, and the repeat decides. A size whose call the previous one
    predicts over :data:`PREDICTED_OVER` × ``budget_s`` (4× its time: the workloads are
    quadratic) is not run, and the row says so. A row per (workload, d, provider),
    workload ``"<name>:largest"``: its ``n`` and the call's time, or why not (over
    budget at ``start``, failing, unavailable). Out-of-memory ends the doubling.
    """
    rows = []
    for workload in workloads:
        for d in dims:
            e = eps * d if workload in SCALED_EPS else eps
            for prov in chosen:
                row = Row(f"{workload}:largest", prov.name, 0, d, computes=prov.computes)
                rows.append(row)
                why = prov.unavailable(device)
                if why is None and workload not in prov.workloads:
                    why = f"{prov.name} has no {workload} workload here"
                if why is not None:
                    row.skipped = why
                    continue
                best, n, failure = None, start, None
                try:
                    prov.prepare(workload, make_problem(start, start, d, device, eps=e,
                                                        iters=iters, tol=tol))()  # fmt: skip
                except Exception as err:  # (it cannot run at all: say why)
                    failure = f"failed at n={start}: {type(err).__name__}"
                while failure is None and n <= cap:
                    if progress is not None:
                        progress(f"largest {workload} d={d} {prov.name}: n={n}")
                    pb = make_problem(n, n, d, device, eps=e, iters=iters, tol=tol)
                    try:
                        fn = prov.prepare(workload, pb)
                        seconds = _timed_call(fn, device)
                        if seconds > budget_s:  # a first call at a new n may compile or tune
                            seconds = _timed_call(fn, device)
                    except Exception:  # out of memory or beyond the library's limits
                        break
                    finally:
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    if seconds > budget_s:
                        break
                    best, n = (n, seconds), 2 * n
                    # a quadratic workload takes ~4× at 2n: far over, it is not run
                    if n <= cap and 4 * seconds > PREDICTED_OVER * budget_s:
                        row.computes += (f"; n={n} not run: predicted {4 * seconds:.0f} s "
                                         f"(4× the time at n={n // 2})")  # fmt: skip
                        break
                if best is None:
                    row.skipped = failure or f"n={start} takes over {budget_s:g} s"
                else:
                    row.n, row.ms = best[0], 1e3 * best[1]
    return rows


def _timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, the device synchronized before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0
