"""How every Triton op launches: tiles, column splits, opt-in autotuning, fitting.

An op describes one launch as a :class:`Launch` (its kernel, tile key and a
:meth:`Launch.plan` of keyword arguments for given splits); the functions here choose the
tiles (the tile tables, :mod:`._tables`, or the heuristic; tuned first when autotuning is
opted in), the column splits (:func:`._configs.balanced_splits` for the compiled
kernel's occupancy) and step down tiles that do not fit the GPU. The caches are per
process: what one call learned (tiles, occupancy, fitted tiles) the next reuses.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.runtime.errors import OutOfResources

from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.temperature import READ_DAMPING, READ_RATIO, READ_ROW, Temperature
from flashot.backends.triton import _configs, _tables
from flashot.backends.triton._ahead import fire, warmup
from flashot.backends.triton._configs import cdiv

__all__ = ["FINALISTS", "Launch", "Plan", "dispatch", "launch", "run", "splits_for",
           "table_tiles", "temp_args", "tiles_for", "tuned"]  # fmt: skip

# best configuration per key: after the first (tuning) call, launches skip the
# autotuner's per-call Python work and go straight to the compiled kernel
_BEST: dict = {}
# programs per SM of each (key, tiles), read from the compiled kernel
_RESIDENT: dict = {}
# the retimed winner of each autotuner ranking (keyed as the autotuner keys)
_RETIMED: dict = {}
# tiles that need more on-chip memory than this GPU has: (key, tiles) → the tiles run instead
_FITTED: dict = {}
#: autotuning's fastest configurations timed again at their balanced split counts
FINALISTS = 3


def temp_args(eps: float, unused: torch.Tensor, ratio: bool = False,
              damped: bool = False) -> dict:  # fmt: skip
    """A launch's ``TEMP`` and ``temp_at``: a temperature's device row, or ``unused`` and 0.

    For a :class:`~flashot.backends.temperature.Temperature` the kernel reads ε from its row
    (``ratio``: its ratio to the last temperature scales the gate's limit too;
    ``damped``: its damping scales the update's weights of T); for a float it takes the
    scalar arguments.
    """
    if isinstance(eps, Temperature):
        flags = READ_ROW | (READ_RATIO if ratio else 0) | (READ_DAMPING if damped else 0)
        return {"TEMP": eps.cell, "temp_at": flags}
    return {"TEMP": unused, "temp_at": 0}


def tuned(kernel, configs, key):
    """``triton.autotune`` of ``kernel`` over ``configs``, keyed by the argument names ``key``."""
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


@dataclass(frozen=True)
class Plan:
    """One launch: its grid (of the tile constexprs), keyword arguments and constexprs."""

    grid: Callable[[dict], tuple[int, ...]]
    args: dict[str, Any]
    consts: dict[str, Any]


class Launch:
    """One op's launch before its tiles and splits are chosen (an op subclasses it).

    Attributes:
        kernel: the ``triton.jit`` function.
        autotuned: its :func:`tuned` object, or None (never tuned).
        key: the tile tables' key (also the caches').
        stationary_block: the tile constexpr of the side each program keeps on chip.
        full: constexpr overrides with which a tuning launch does all its work (gated or
            repair launches would otherwise time nothing).
        device: the data's device.  nb, mb: the tile key's size buckets (rows, columns).
        segments: a packed batch (:mod:`flashot.geometry.segments`) or None.
    """

    kernel: Any
    autotuned: Any = None
    key: tuple = ()
    stationary_block = "BLOCK_M"
    full: dict | None = None
    device: torch.device
    nb: int
    mb: int
    segments: Any = None

    def sizes(self, tiles) -> tuple[int, int, int | None]:
        """``(stationary, moving, most)``: items of each side and the most splits (or None)."""
        raise NotImplementedError

    def plan(self, splits: int, per: int, tiles, probe: bool = False) -> Plan:
        """The launch with the moving side cut into ``splits`` of ``per`` items.

        ``tiles``: the chosen ``triton.Config`` (None while tuning); ``probe``: for
        compiling only (no outputs need allocating).
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Clear outputs that tuning launches accumulated into (nothing by default)."""


def tiles_for(key, size_log2: int, device, autotune: bool):
    """The tiles a launch takes; None when this call must tune them first.

    ``size_log2``: log2 of the n·m elements streamed (small solves are not tuned).
    Without tuning, the tile tables' (:mod:`._tables`) or the heuristic's.
    """
    if triton_interpreted():
        return triton.Config(_configs.INTERPRETER_TILES)
    # tiny problems run in microseconds and would spend seconds tuning
    if not (autotune and size_log2 >= _configs.TUNE_FROM_LOG2):
        return _tables.choose(key, device, _configs.fits)
    if key not in _BEST:
        kept = _tables.lookup(key, _tables.arch_of(device), exact_only=True)  # earlier runs'
        if kept is None:
            return None
        _BEST[key] = kept
    return _BEST[key]


def table_tiles(key, nb: int, mb: int, device, autotune: bool):
    """Tiles from the tables or the heuristic, never tuned here.

    A packed batch takes its largest problem's; a one-pass step the fused pass's.
    """
    return tiles_for(key, nb + mb, device, autotune) or _tables.choose(key, device, _configs.fits)


def splits_for(op: Launch, cfg, device, forced: int | None = None) -> tuple[int, int]:
    """``(splits, per)``: the moving side cut into splits of ``per`` items each.

    Before the tiles are known (tuning) the count is :func:`_configs.column_splits`;
    afterwards :func:`_configs.balanced_splits` for the compiled kernel's occupancy;
    never more than the op's ``most`` splits (a bound on its partials' memory) unless
    ``forced`` (the backend's ``splits``) says.
    """
    stationary, moving, most = op.sizes(cfg)
    block = cfg.kwargs[op.stationary_block] if cfg else 128
    guess = forced or min(
        _configs.column_splits(cdiv(stationary, block), moving, 64, device),
        most or moving,
    )
    per = cdiv(cdiv(moving, guess), 128) * 128
    guess = cdiv(moving, per)
    if cfg is None or forced or device.type != "cuda" or triton_interpreted():
        return guess, per
    rkey = (op.key, str(cfg))
    if rkey not in _RESIDENT:
        plan = op.plan(guess, per, cfg, probe=True)
        try:  # compile (cached) and load without launching: loading sets n_regs
            kernel = warmup(op.kernel, plan.grid(cfg.kwargs), **plan.args,
                                   **plan.consts, **cfg.all_kwargs())  # fmt: skip
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
    return _configs.balanced_splits(cdiv(stationary, block), moving, slots,
                                    most or moving)  # fmt: skip


def plan_at(op: Launch, cfg, device, forced: int | None = None) -> Plan:
    """The op's plan with tiles ``cfg`` at its split count (the first guess for None)."""
    return op.plan(*splits_for(op, cfg, device, forced), cfg)


def launch(op: Launch, cfg, device, forced: int | None = None) -> Plan:
    """Launch with tiles ``cfg``, or tune them first (cfg None); returns the plan run.

    Tuning times every candidate at the first-guess splits, then the :data:`FINALISTS`
    fastest again at their own balanced splits (small tiles gain most from balancing, so
    the first ranking is biased against them), with the op's ``full`` overrides, and
    resets the op's accumulated outputs after. The op's key holds what the autotuner keys
    on, so a ranking it kept from an earlier call maps to that call's retimed winner.
    ``device``: the data's; ``forced``: the backend's ``splits``.
    """
    with on_device(device):  # tuning, compiling and launching on the data's GPU
        if cfg is None:
            tuner = op.autotuned
            _tables.announce(tuner, op.key, device)
            plan = plan_at(op, None, device, forced)
            kept = len(tuner.cache)
            # (positional, as the autotuner maps its keys and hooks by argument order)
            tuner[plan.grid](*_positional(op.kernel, plan.args),
                             **{**plan.consts, **(op.full or {})})  # fmt: skip
            cfg = _RETIMED.get(op.key, tuner.best_config)
            timings = getattr(tuner, "configs_timings", None)
            if len(tuner.cache) > kept and timings:  # this call tuned: rank again
                cfg = _retime(op, sorted(timings, key=timings.get), device, forced)
                _RETIMED[op.key] = cfg
            _BEST[op.key] = cfg
            _tables.keep(op.key, cfg, device)
            op.reset()
        return run(op, cfg, device, forced)


def run(op: Launch, cfg, device, forced: int | None = None) -> Plan:
    """Launch with tiles ``cfg``, or smaller ones where they do not fit the GPU.

    Untuned tiles come from another key's entry or the heuristic: an entry tuned at
    d = 64 needs twice the shared memory at d = 100 (one 128-wide feature chunk), and
    a table made on an H200 may not fit a GPU with less. Triton refuses such tiles
    when it loads the kernel, before anything runs; the launch then steps down
    (:func:`._configs.smaller`) and remembers the tiles that ran.
    """
    slot = None
    if _FITTED:  # (the usual launch, with nothing ever refused, pays no lookup)
        slot = (op.key, str(cfg))
        cfg = _FITTED.get(slot, cfg)
    while True:
        try:
            return start(op.kernel, cfg, plan_at(op, cfg, device, forced), device)
        except OutOfResources as err:
            slot = slot or (op.key, str(cfg))
            memory = "shared" in str(err.name)
            smaller = _configs.smaller(cfg, *((err.required, err.limit) if memory else ()))
            if smaller is None:
                raise
            cfg = _FITTED[slot] = smaller


def dispatch(op: Launch, autotune: bool, forced: int | None = None) -> Plan:
    """Launch ``op`` with a backend's options; returns the plan run.

    A packed batch (``op.segments``) takes table tiles (never tuned) in one launch over
    its table of blocks; a single problem takes :func:`tiles_for` (tuned first where
    ``autotune`` asks). ``forced``: the backend's ``splits``.
    """
    if op.segments is not None:
        cfg = table_tiles(op.key, op.nb, op.mb, op.device, autotune)
        return run(op, cfg, op.device, forced)
    return launch(op, tiles_for(op.key, op.nb + op.mb, op.device, autotune), op.device, forced)


def start(kernel, cfg, plan: Plan, device) -> Plan:
    """Launch ``kernel`` with tiles ``cfg`` as ``plan`` says; returns the plan."""
    tiles = cfg.kwargs if triton_interpreted() else cfg.all_kwargs()
    with on_device(device):
        fire(kernel, plan.grid(cfg.kwargs), **plan.args, **plan.consts, **tiles)
    return plan


def _positional(kernel, args: dict) -> list:
    """``args`` in the kernel's argument order (every non-constexpr argument is given)."""
    return [args[name] for name in kernel.arg_names if name in args]


def _retime(op: Launch, ranked, device, forced):
    """The fastest of the first :data:`FINALISTS` configurations, each at its own splits."""
    best = None
    for cfg in ranked[:FINALISTS]:
        plan = plan_at(op, cfg, device, forced)
        kwargs = {**plan.args, **plan.consts, **(op.full or {}), **cfg.all_kwargs()}
        ms = triton.testing.do_bench(
            lambda: op.kernel[plan.grid(cfg.kwargs)](**kwargs),  # noqa: B023 (called here)
            return_mode="median",
        )
        if best is None or ms < best[0]:
            best = (ms, cfg)
    assert best is not None  # (a ranking holds at least one configuration)
    return best[1]
