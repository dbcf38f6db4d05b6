"""Compiling ahead: a first call's kernels built in worker threads (issue 50).

A first call in a fresh process compiles every kernel specialization it launches, one
after another as it reaches them: about 0.5–1 s each on the GPU machine, ten of them for
a plain 50k d = 64 solve. Which ones a workload launches is known from earlier runs:
a manifest recorded on the GPU (``tiles/ahead_sm<cc>_triton<version>.json``, written by
``RECORD=… python benchmarks/cold_start.py``) lists, per recorded workload, each
specialization in the order it was first compiled, with Triton's own specialization data.

Every flashot launch goes through :func:`fire` (a compile without a launch through
:func:`warmup`). When a launch compiles a specialization that the manifest knows, the
ones that followed it in the recorded workloads are compiled in worker threads
(``JITFunction.preload``, and the launcher module where this Triton builds one per
signature) while the host goes on: Triton's compiler and ptxas
release the GIL for most of their time (8 sm_90 kernels: 4.7 s in two threads, 9.4 s in
one, on a 2-core VM). A launch of a kernel with compiles in flight waits for them first,
so no specialization is compiled twice.

Triton's disk cache keys every kernel by a hash of its own installation
(``triton_key()``, once a process: 0.37 s of a 0.98 s second-process call on the GPU
machine). :func:`hash_triton_early` computes it in a daemon thread while the backend's
modules import and the host prepares the problem; the first launch joins it. It starts
only where CUDA is already initialized (it never initializes CUDA itself: a process
that forks later would inherit it).

Nothing changes where no manifest matches (another GPU, another Triton, the
interpreter): launches compile as they come. A compile that fails in a worker is
dropped; the launch then compiles it, and reports any error, itself. Workers do no
CUDA work (no module loads), so a CUDA graph capture on the host thread is safe.
``FLASHOT_COMPILE_AHEAD=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from flashot.backends.device import triton_interpreted

__all__ = ["ENV", "fire", "hash_triton_early", "manifest_path", "successors", "warmup"]

#: the environment variable that turns compiling ahead off ("0")
ENV = "FLASHOT_COMPILE_AHEAD"
#: worker threads at most (compiles are CPU-bound; the host thread keeps one core)
MOST_WORKERS = 8

_TILES = pathlib.Path(__file__).with_name("tiles")
# the manifest's successors by Triton cache key, per device capability (once loaded)
_MANIFESTS: dict[tuple[int, int], dict[str, list[dict]]] = {}
_SUBMITTED: set[str] = set()  # cache keys compiled or given to a worker in this process
_PENDING: dict[int, list[Future]] = {}  # id(kernel) → its compiles in flight
_POOL: ThreadPoolExecutor | None = None
_LOCK = threading.Lock()
_STATE: dict[str, bool | None] = {"enabled": None}
_HASHING: list[threading.Thread] = []  # the thread computing triton_key(), until joined


def fire(kernel, grid, *args, **kwargs):
    """Launch ``kernel[grid](*args, **kwargs)``, compiling ahead around it (see the module)."""
    return _around(kernel, lambda: kernel[grid](*args, **kwargs))


def warmup(kernel, grid, **kwargs):
    """``kernel.warmup(grid=grid, **kwargs)`` (compile and return, no launch), the same way."""
    return _around(kernel, lambda: kernel.warmup(grid=grid, **kwargs))


def hash_triton_early() -> None:
    """Start computing Triton's installation hash in a daemon thread (see the module)."""
    if _HASHING or not _enabled() or not torch.cuda.is_initialized():
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def run():  # (cached by Triton for the process; on failure the launch reports it)
        with contextlib.suppress(Exception):
            triton_key()

    thread = threading.Thread(target=run, name="flashot-triton-key", daemon=True)
    _HASHING.append(thread)
    thread.start()


def _around(kernel, call):
    if not _enabled():
        return call()
    if _HASHING:  # (so that the first compile does not hash Triton a second time)
        _HASHING.pop().join()
    pending = _PENDING.pop(id(kernel), None)
    if pending:
        for future in pending:
            future.exception()  # (waits; a failed compile is the launch's to redo)
    before = _cached(kernel)
    out = call()
    if before is not None and _cached(kernel) != before:
        _compiled(kernel)
    return out


def manifest_path(capability: tuple[int, int], version: str | None = None) -> pathlib.Path:
    """The manifest for a device capability and a Triton version (this one's by default)."""
    if version is None:
        import triton

        version = triton.__version__
    return _TILES / f"ahead_sm{capability[0]}{capability[1]}_triton{version}.json"


def successors(runs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per cache key, the entries to compile ahead once it has compiled.

    ``runs``: workload name → its entries (``kernel``: "module:qualname", ``key``: Triton's
    cache key, ``data``: its specialization data) in the order first compiled. A key that
    only one run holds hands on the rest of that run; a key that several hold (a kernel
    every workload launches) only what follows it in all of them, so that a workload
    is compiled ahead once a key of its own has shown which one it is.
    """
    holding: dict[str, list[list[dict]]] = {}
    for entries in runs.values():
        for i, entry in enumerate(entries):
            holding.setdefault(entry["key"], []).append(entries[i + 1 :])
    out = {}
    for key, tails in holding.items():
        common = set.intersection(*({e["key"] for e in tail} for tail in tails))
        seen, ranked = {key}, []
        for entry in tails[0]:
            if entry["key"] in common and entry["key"] not in seen:
                seen.add(entry["key"])
                ranked.append(entry)
        out[key] = ranked
    return out


def _enabled() -> bool:
    state = _STATE["enabled"]
    if state is None:
        state = os.environ.get(ENV, "1") != "0" and not triton_interpreted()
        _STATE["enabled"] = state
    return state


def _cached(kernel) -> int | None:
    """How many specializations ``kernel`` holds compiled, all devices (None: unknown)."""
    try:
        caches = kernel.device_caches
        if len(caches) == 1:  # (the usual case, kept short: every launch pays it)
            for entry in caches.values():
                return len(entry[0])
        return sum([len(entry[0]) for entry in list(caches.values())])
    except (AttributeError, TypeError, IndexError):
        return None


def _compiled(kernel) -> None:
    """After a launch that compiled: hand the manifest's successors to the workers."""
    for device, entry in list(kernel.device_caches.items()):
        cache = entry[0]
        if not cache:
            continue
        key = str(next(reversed(cache)))  # (the newest: this launch's)
        with _LOCK:
            if key in _SUBMITTED:
                continue
            _SUBMITTED.add(key)
        for item in _manifest(device).get(key, ()):
            _submit(item, device)


def _manifest(device: int) -> dict[str, list[dict]]:
    capability = torch.cuda.get_device_capability(device)
    if capability not in _MANIFESTS:
        path = manifest_path(capability)
        try:
            runs = json.loads(path.read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError):
            runs = {}
        _MANIFESTS[capability] = successors(runs)
    return _MANIFESTS[capability]


def _submit(item: dict, device: int) -> None:
    global _POOL
    with _LOCK:
        if item["key"] in _SUBMITTED:
            return
        _SUBMITTED.add(item["key"])
    kernel = _resolve(item["kernel"])
    if kernel is None:
        return
    if _POOL is None:
        workers = max(1, min(MOST_WORKERS, (os.cpu_count() or 2) - 1))
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="flashot-compile")
        _at_exit(_POOL)
    future = _POOL.submit(_build, kernel, item["data"], device)
    _PENDING.setdefault(id(kernel), []).append(future)


def _resolve(name: str):
    """The ``triton.jit`` function named ``module:qualname`` (flashot's only), or None."""
    module, _, attr = name.partition(":")
    if not module.startswith("flashot."):
        return None
    try:
        kernel = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None
    return kernel if hasattr(kernel, "preload") else None


def _build(kernel, data: str, device: int) -> None:
    """Compile one specialization (and its launcher module where built per signature)."""
    spec = json.loads(data)
    spec["options"].pop("extern_libs", None)  # (paths of the recording machine)
    with torch.cuda.device(device):
        compiled = kernel.preload(json.dumps(spec))
        if compiled is None:
            return
        from triton.runtime import driver

        launcher = getattr(driver.active, "launcher_cls", None)
        if launcher is not None and hasattr(compiled, "src"):
            launcher(compiled.src, compiled.metadata)  # (cached on disk: the launch loads it)


def _at_exit(pool: ThreadPoolExecutor) -> None:
    """At interpreter exit, drop compiles not started (the running ones finish)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(lambda: pool.shutdown(wait=False, cancel_futures=True))
