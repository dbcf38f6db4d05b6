"""The Triton backend's tuning and launch layer: tiles, column splits, autotuning.

A launch takes its tiles from the tile tables (:mod:`._tables`) or the heuristic, or
tunes them first when autotuning is opted in; the column splits follow the compiled
kernel's occupancy (:func:`._configs.balanced_splits`). Mixed into
:class:`~flashot.backends.triton.TritonBackend` (its ``autotune`` and ``splits``).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import triton
from triton.runtime.errors import OutOfResources

from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.temperature import READ_DAMPING, READ_RATIO, READ_ROW, Temperature
from flashot.backends.triton import _configs, _tables
from flashot.backends.triton._kernels import _attend_kernel, _plan_sums_kernel

__all__ = ["FINALISTS", "TunedLaunches", "temp_args"]


def temp_args(eps: float, unused: torch.Tensor, ratio: bool = False,
              damped: bool = False) -> tuple:  # fmt: skip
    """A launch's ``(TEMP, temp_at)``: a temperature's device row, or ``(unused, 0)``.

    For a :class:`~flashot.backends.temperature.Temperature` the kernel reads ε from its row
    (``ratio``: its ratio to the last temperature scales the gate's limit too;
    ``damped``: its damping scales the update's weights of T); for a float it takes the
    scalar arguments.
    """
    if isinstance(eps, Temperature):
        return eps.cell, READ_ROW | (READ_RATIO if ratio else 0) | (READ_DAMPING if damped else 0)
    return unused, 0


def _tuned(kernel, configs, key):
    options = {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True  # tuned tiles persist on disk across processes
    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": _configs.prune},
        reset_to_zero=["R", "C"] if "R" in kernel.arg_names else None,
        **options,
    )(kernel)


_ATTEND_KEY = ["d", "p", "n_bucket", "m_bucket", "HAS_V", "POTENTIAL_BIAS", "PRECISION",
               "PRESPLIT"]  # fmt: skip
_ATTEND = _tuned(_attend_kernel, _configs.attend_configs(), _ATTEND_KEY)
_PLAN_SUMS_KEY = ["d", "n_bucket", "m_bucket", "PRECISION", "PRESPLIT"]
_PLAN_SUMS = _tuned(_plan_sums_kernel, _configs.plan_sums_configs(), _PLAN_SUMS_KEY)
# best configuration per (kernel, key): after the first (tuning) call, launches skip the
# autotuner's per-call Python work and go straight to the compiled kernel
_BEST: dict = {}
# programs per SM of each (kernel, key, tiles), read from the compiled kernel
_RESIDENT: dict = {}
# the retimed winner of each autotuner ranking (keyed as the autotuner keys)
_RETIMED: dict = {}
# tiles that need more on-chip memory than this GPU has: (key, tiles) → the tiles run instead
_FITTED: dict = {}
#: autotuning's fastest configurations timed again at their balanced split counts
FINALISTS = 3


class TunedLaunches:
    """Tiles, splits and (opt-in) tuning of the backend's launches (see module)."""

    autotune: bool
    splits: int | None

    def _tiles(self, key, size_log2, device):
        """The tiles a launch takes; None when this call must tune them first.

        ``size_log2``: log2 of the n·m elements streamed (small solves are not tuned).
        Without tuning, the tile tables' (:mod:`._tables`) or the heuristic's.
        """
        if triton_interpreted():
            return triton.Config(_configs.INTERPRETER_TILES)
        # tiny problems run in microseconds and would spend seconds tuning
        if not (self.autotune and size_log2 >= _configs.TUNE_FROM_LOG2):
            return _tables.choose(key, device, _configs.fits)
        if key not in _BEST:
            kept = _tables.lookup(key, _tables.arch_of(device), exact_only=True)  # earlier runs'
            if kept is None:
                return None
            _BEST[key] = kept
        return _BEST[key]

    def _split(self, raw, key, cfg, build, stationary, moving, device, most=None):
        """``(splits, per)``: the moving side cut into splits of ``per`` items each.

        Before the tiles are known (tuning) the count is :func:`_configs.column_splits`;
        afterwards :func:`_configs.balanced_splits` for the compiled kernel's occupancy;
        never more than ``most`` splits (a bound on the partials' memory) unless the
        backend's ``splits`` says. ``build(splits, per, probe=True)``
        gives the launch's ``(grid, args, consts)`` for compiling it.
        """
        block = cfg.kwargs["BLOCK_M" if raw is _attend_kernel else "BLOCK_N"] if cfg else 128
        guess = self.splits or min(
            _configs.column_splits(triton.cdiv(stationary, block), moving, 64, device),
            most or moving,
        )
        per = triton.cdiv(triton.cdiv(moving, guess), 128) * 128
        guess = triton.cdiv(moving, per)
        if cfg is None or self.splits or device.type != "cuda" or triton_interpreted():
            return guess, per
        rkey = (key, str(cfg))
        if rkey not in _RESIDENT:
            grid, args, consts = build(guess, per, probe=True)
            try:  # compile (cached) and load without launching: loading sets n_regs
                kernel = raw.warmup(*args, **consts, **cfg.all_kwargs(), grid=grid(cfg.kwargs))
                kernel = kernel.result() if hasattr(kernel, "result") else kernel
                kernel._init_handles()
            except (AttributeError, TypeError) as err:  # another Triton: keep the guess
                warnings.warn(f"flashot: occupancy unknown ({err}); splits not balanced",
                              RuntimeWarning, stacklevel=2)  # fmt: skip
                kernel = None
            props = torch.cuda.get_device_properties(device.index or 0)
            _RESIDENT[rkey] = _configs.resident_programs(kernel, props)
        if _RESIDENT[rkey] is None:
            return guess, per
        slots = _RESIDENT[rkey] * _configs.sm_count(device.index or 0)
        return _configs.balanced_splits(triton.cdiv(stationary, block), moving, slots,
                                        most or moving)  # fmt: skip

    def _launch(self, tuned, raw, key, cfg, plan_for, device, full=None, reset=None):
        """Launch with tiles ``cfg``, or tune them first (cfg None); returns the plan run.

        ``plan_for(tiles)`` gives ``(grid, args, consts)`` with the split count for
        those tiles (the first guess for None). Tuning times every candidate at the first
        guess, then the :data:`FINALISTS` fastest again at their own balanced splits
        (small tiles gain most from balancing, so the first ranking is biased against
        them). ``full``: constexpr overrides that make a call that may skip work (gated
        or repair launches) do all of it while timing: skipped work would time nothing.
        ``reset()`` clears outputs that launches accumulate into; ``device``: the data's.
        ``key`` holds what the autotuner keys on, so a ranking it kept from an earlier
        call maps to that call's retimed winner.
        """
        with on_device(device):  # tuning, compiling and launching on the data's GPU
            if cfg is None:
                _tables.announce(tuned, key, device)
                grid, args, consts = plan_for(None)
                tuned_keys = len(tuned.cache)
                tuned[grid](*args, **{**consts, **(full or {})})
                cfg = _RETIMED.get(key, tuned.best_config)
                timings = getattr(tuned, "configs_timings", None)
                if len(tuned.cache) > tuned_keys and timings:  # this call tuned: rank again
                    cfg = self._retime(raw, sorted(timings, key=timings.get), plan_for, full)
                    _RETIMED[key] = cfg
                _BEST[key] = cfg
                _tables.keep(key, cfg, device)
                if reset is not None:
                    reset()
            return self._run_fitting(raw, key, cfg, plan_for, device)

    def _run_fitting(self, raw, key, cfg, plan_for, device):
        """:meth:`_run` with tiles ``cfg``, or smaller ones where they do not fit the GPU.

        Untuned tiles come from another key's entry or the heuristic: an entry tuned at
        d = 64 needs twice the shared memory at d = 100 (one 128-wide feature chunk), and
        a table made on an H200 may not fit a GPU with less. Triton refuses such tiles
        when it loads the kernel, before anything runs; the launch then steps down
        (:func:`._configs.smaller`) and remembers the tiles that ran.
        """
        slot = None
        if _FITTED:  # (the usual launch, with nothing ever refused, pays no lookup)
            slot = (key, str(cfg))
            cfg = _FITTED.get(slot, cfg)
        while True:
            try:
                return self._run(raw, cfg, plan_for(cfg), device)
            except OutOfResources as err:
                slot = slot or (key, str(cfg))
                memory = "shared" in str(err.name)
                smaller = _configs.smaller(cfg, *((err.required, err.limit) if memory else ()))
                if smaller is None:
                    raise
                cfg = _FITTED[slot] = smaller

    @staticmethod
    def _run(raw, cfg, plan, device):
        """Launch ``raw`` with tiles ``cfg`` and ``plan = (grid, args, consts)``; the plan."""
        grid, args, consts = plan
        tiles = cfg.kwargs if triton_interpreted() else cfg.all_kwargs()
        with on_device(device):
            raw[grid(cfg.kwargs)](*args, **consts, **tiles)
        return plan

    def _table_tiles(self, key, nb, mb, device):
        """Tiles from the tables or the heuristic, never tuned here.

        A packed batch takes its largest problem's; a one-pass step the fused pass's.
        """
        return self._tiles(key, nb + mb, device) or _tables.choose(key, device, _configs.fits)

    @staticmethod
    def _retime(raw, ranked, plan_for, full):
        """The fastest of the first :data:`FINALISTS` configurations, each at its own splits."""
        best = None
        for cfg in ranked[:FINALISTS]:
            grid, args, consts = plan_for(cfg)
            kwargs = {**consts, **(full or {}), **cfg.all_kwargs()}
            ms = triton.testing.do_bench(
                lambda: raw[grid(cfg.kwargs)](*args, **kwargs),  # noqa: B023 (called here)
                return_mode="median",
            )
            if best is None or ms < best[0]:
                best = (ms, cfg)
        return best[1]
