"""Tile tables: tuned tiles shipped per GPU architecture, so a first call only compiles.

A launch's tiles come, in order, from: this process's earlier choice; the user's table
(``$FLASHOT_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashot`` or ``~/.cache/flashot``),
which ``flashot tune`` and opted-in autotuning (``FLASHOT_AUTOTUNE=1``) write; the
table shipped for the GPU's architecture (``tiles/sm_XY.json``, written by
``flashot tune --out``); and, for a GPU without one, :func:`heuristic`. Without an exact
entry the nearest tuned key of the same kernel variant is taken (feature size first,
then the size buckets), as tiles change slowly with them.

An entry is one JSON object: the launch key's fields (:data:`FIELDS`) and the tiles
(``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch
import triton

__all__ = [
    "FIELDS",
    "announce",
    "arch",
    "arch_of",
    "choose",
    "heuristic",
    "keep",
    "lookup",
    "provenance",
    "record",
    "user_table_path",
]

#: the fields of a launch key, in the order the backend builds it
FIELDS = {
    "attend": ("kernel", "d", "p", "nb", "mb", "has_v", "dot", "dtype", "potential"),
    "plan_sums": ("kernel", "d", "nb", "mb", "dot", "dtype"),
}
#: fields an entry must share with the key to stand in for it (another dot or input
#: dtype may, at a distance: the kernels are exp-bound at small d, where tiles agree)
_SAME = ("kernel", "has_v", "potential")
_SHIPPED = Path(__file__).with_name("tiles")


def arch(device_index: int) -> str:
    """``"sm_XY"``: the compute capability of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def arch_of(device) -> str | None:
    """:func:`arch` of a torch device (None off CUDA)."""
    return arch(device.index or 0) if device.type == "cuda" else None


def user_table_path(arch_name: str) -> Path:
    """Where this user's tuned tiles for ``arch_name`` live."""
    root = os.environ.get("FLASHOT_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        root = os.path.join(base, "flashot")
    return Path(root) / f"tiles_{arch_name}.json"


def _as_entry(key: tuple) -> dict:
    entry = dict(zip(FIELDS[key[0]], key, strict=True))
    entry["dtype"] = str(entry["dtype"]).removeprefix("torch.")
    return entry


def _read(path: Path) -> list[dict]:
    try:
        with open(path) as fh:
            entries = json.load(fh)["entries"]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RuntimeError(f"flashot: unreadable tile table {path} ({err}); delete it or "
                           "run `flashot tune` again") from err  # fmt: skip
    return [e for e in entries if isinstance(e, dict) and e.get("kernel") in FIELDS]


@functools.cache
def _tables(arch_name: str) -> tuple[list[dict], list[dict]]:
    """(user entries, shipped entries) of an architecture, read once per process."""
    return _read(user_table_path(arch_name)), _read(_SHIPPED / f"{arch_name}.json")


def _config(entry: dict) -> triton.Config:
    tiles = {"BLOCK_M": int(entry["BLOCK_M"]), "BLOCK_N": int(entry["BLOCK_N"])}
    return triton.Config(tiles, num_warps=int(entry["num_warps"]),
                         num_stages=int(entry["num_stages"]))  # fmt: skip


def _distance(entry: dict, want: dict) -> float:
    """How far a tuned key is from the wanted one (feature size weighs most)."""
    log2 = lambda v: math.log2(max(1, int(v)))  # noqa: E731
    dist = 4 * abs(log2(entry["d"]) - log2(want["d"]))
    dist += 100 * ((entry["d"] > 128) != (want["d"] > 128))  # feature chunking differs
    dist += abs(entry["nb"] - want["nb"]) + abs(entry["mb"] - want["mb"])
    if "p" in want:
        dist += 2 * abs(log2(entry["p"]) - log2(want["p"]))
    return dist + 8 * (entry["dot"] != want["dot"]) + 8 * (entry["dtype"] != want["dtype"])


def lookup(key: tuple, arch_name: str | None, exact_only: bool = False) -> triton.Config | None:
    """Tiles for a launch key from the tables (None when none stands in for it).

    ``exact_only``: only the user's table and only its exact key (autotuning is on and
    tunes whatever is missing).
    """
    return _find(key, arch_name, exact_only)[0]


def _find(key: tuple, arch_name: str | None, exact_only: bool = False):
    """``(tiles or None, where from)``: :func:`lookup` and a few words on its source."""
    if arch_name is None:
        return None, "no table off CUDA"
    want = _as_entry(key)
    user, shipped = _tables(arch_name)
    for entry in user:
        if all(entry.get(f) == want[f] for f in want):
            return _config(entry), "the user's table"
    if exact_only:
        return None, "not in the user's table"
    close = [e for e in (*user, *shipped) if all(e.get(f) == want.get(f) for f in _SAME)]
    if not close:
        return None, f"no {arch_name} entry of this kernel variant"
    best = min(close, key=lambda e: _distance(e, want))
    if _distance(best, want) == 0:
        return _config(best), f"the shipped {arch_name} table"
    stand_in = ", ".join(f"{f}={best[f]}" for f in FIELDS[key[0]][1:] if best.get(f) != want[f])
    return _config(best), f"nearest entry ({stand_in})"


def heuristic(key: tuple) -> triton.Config:
    """Tiles for a GPU without a table: the H200's usual winners, by feature size."""
    kernel, d = key[0], key[1]
    tiles = (64, 64, 4, 3) if kernel == "plan_sums" or d > 128 else (128, 64, 4, 3)
    bm, bn, warps, stages = tiles
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


#: tiles of untuned launches per (device, key): the tables are read once
_CHOSEN: dict = {}
#: where each of them came from (:func:`provenance`)
_SOURCE: dict = {}


def choose(key: tuple, device, fits) -> triton.Config:
    """The tiles an untuned launch takes: the tables' (:func:`lookup`), else :func:`heuristic`.

    ``fits(config, d)``: whether tiles suit feature size d (an entry of another key may not).
    """
    slot = (device.type, device.index, key)
    if slot not in _CHOSEN:
        cfg, source = _find(key, arch_of(device))
        if cfg is not None and not fits(cfg, key[1]):
            cfg, source = None, f"{source} does not fit d={key[1]}"
        _CHOSEN[slot] = cfg if cfg is not None else heuristic(key)
        _SOURCE[slot] = source if cfg is not None else f"heuristic: {source}"
    return _CHOSEN[slot]


def provenance() -> dict[tuple, str]:
    """``{(device type, index, launch key): source}`` of this process's untuned launches.

    The source is the user's table, the shipped table (an exact entry), the nearest entry
    (naming the fields it differs in) or the heuristic (and why): which launches of a
    workload would gain from ``flashot tune``.
    """
    return dict(_SOURCE)


def announce(tuned, key: tuple, device) -> None:
    """One line on stderr before ``tuned`` (a Triton autotuner) tunes a launch key."""
    if device.type != "cuda":  # (tuning happens on GPUs; tests drive it on the CPU)
        return
    fields = dict(zip(FIELDS[key[0]], key, strict=True))
    arch_name = arch_of(device)
    assert arch_name is not None  # (a CUDA device)
    print(f"flashot: tuning {key[0]} tiles for d={fields['d']}, n~2^{fields['nb']}, "
          f"m~2^{fields['mb']}, {fields['dot']} ({len(tuned.configs)} candidates, about a minute; "
          f"kept in {user_table_path(arch_name)}; FLASHOT_AUTOTUNE=0 skips this)",
          file=sys.stderr, flush=True)  # fmt: skip


def keep(key: tuple, cfg: triton.Config, device) -> None:
    """Persist a tuned key's tiles in the user's table (a warning if it cannot be written)."""
    if device.type != "cuda":
        return
    arch_name = arch_of(device)
    assert arch_name is not None  # (a CUDA device)
    try:
        record(key, cfg, arch_name)
    except OSError as err:
        warnings.warn(f"flashot: tuned tiles not saved ({err})", RuntimeWarning, stacklevel=3)


def record(key: tuple, cfg: triton.Config, arch_name: str, path: Path | None = None) -> Path:
    """Add (or replace) a key's tiles in a table file (the user's by default)."""
    path = path or user_table_path(arch_name)
    new = _as_entry(key)
    entries = [e for e in _read(path) if _as_entry_key(e) != _as_entry_key(new)]
    entries.append({**new, **cfg.kwargs, "num_warps": cfg.num_warps,
                    "num_stages": cfg.num_stages})  # fmt: skip
    entries.sort(key=lambda e: json.dumps(e, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        json.dump({"arch": arch_name, "entries": entries}, fh, indent=1)
    os.replace(tmp, path)  # readers never see half a table
    _tables.cache_clear()
    return path


def _as_entry_key(entry: dict) -> tuple:
    return tuple(entry.get(f) for f in FIELDS[entry["kernel"]])
