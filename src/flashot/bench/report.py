"""What a suite writes: a table on stdout, CSV and JSON rows, PNG plots."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

from flashot.bench.harness import Row

__all__ = ["COLUMNS", "SCHEMA_VERSION", "merge", "plot", "read", "result_file", "table",
           "write"]  # fmt: skip

#: the result files' layout: 2 moved the CSV's environment comment lines to a sidecar
SCHEMA_VERSION = 2
#: every column of bench.csv and of the rows of bench.json (empty cell / null: not measured)
COLUMNS = {
    "workload": "forward, gradient, converge, plan, hvp or otdd (flashot.bench)",
    "provider": "who computed the row (flashot.bench.options.PROVIDERS)",
    "n": "points in each cloud (n = m)",
    "d": "features per point",
    "ms": "median time of one call, milliseconds (after warm-up)",
    "first_s": "the first call's time (compilation, tuning), seconds",
    "peak_mb": "peak device memory above the inputs during a call, MB",
    "value": "the quantity computed (see 'computes'), for cross-checks",
    "floor_ms": "the operation count's time at this GPU's measured ceilings, ms",
    "rel_error": "relative error of 'value' against the float64 reference",
    "skipped": "why the row did not run (then the measurements are empty)",
    "computes": "what 'value' is in the provider's own convention",
    "x_floor": "ms / floor_ms (derived)",
}


def _fmt(v, digits=3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def table(rows: list[Row]) -> str:
    """A markdown table, one line per row; skipped providers with their reason."""
    lines = ["| workload | n | d | provider | ms | first s | peak MB | × floor | rel. error "
             "| value |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    skips = []
    for r in rows:
        if r.skipped:
            skips.append(f"- {r.provider}, {r.workload}: {r.skipped}")
            continue
        lines.append(f"| {r.workload} | {r.n} | {r.d} | {r.provider} | {_fmt(r.ms)} | "
                     f"{_fmt(r.first_s, 2)} | {_fmt(r.peak_mb)} | {_fmt(r.x_floor, 2)} | "
                     f"{_fmt(r.rel_error, 2)} | {_fmt(r.value, 7)} |")  # fmt: skip
    computed = {r.provider: r.computes for r in rows if r.computes}
    notes = [f"- {name}: {what}" for name, what in computed.items()]
    return "\n".join([*lines, "", "Skipped:", *dict.fromkeys(skips), "", "Computed:", *notes])


def write(rows: list[Row], env: dict, out: Path, name: str = "bench") -> list[Path]:
    """Write ``name.csv``, ``name.meta.json`` and ``name.json``; returns their paths.

    - ``name.csv``: a header line (:data:`COLUMNS`) and one line per row, nothing else;
    - ``name.meta.json``: ``{"schema_version", "columns", "environment"}``, the CSV's
      metadata (a remote run may bring back these two alone);
    - ``name.json``: the metadata and ``"rows"``, a list of objects with the columns.
    """
    out.mkdir(parents=True, exist_ok=True)
    fields = list(COLUMNS)
    paths = out / f"{name}.csv", out / f"{name}.meta.json", out / f"{name}.json"
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    records = [{**dataclasses.asdict(r), "x_floor": r.x_floor} for r in rows]
    writer.writerows(records)
    meta = {"schema_version": SCHEMA_VERSION, "columns": COLUMNS, "environment": env}
    _replace_atomically(paths[0], text.getvalue())
    _replace_atomically(paths[1], json.dumps(meta, indent=1))
    _replace_atomically(paths[2], json.dumps({**meta, "rows": records}, indent=1))
    return list(paths)


def _replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it.

    A run that dies mid-write leaves the previous file whole.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read(path: Path) -> tuple[list[Row], dict]:
    """The rows and environment a suite wrote (:func:`write`).

    ``path``: its ``bench.json``, its ``bench.csv`` (the same rows, the environment in
    the ``bench.meta.json`` beside it, or, written before schema 2, in comment lines:
    what a remote run may bring back alone) or the folder holding them: the newer of the
    two (a CSV brought back over an older run's folder wins), the JSON when written
    together. Raises ValueError naming the file when it is missing or not a suite's.
    """
    path = Path(path)
    file = path
    if path.is_dir():
        file = result_file(path) or path / "bench.json"
    try:
        if file.suffix == ".csv":
            return _read_csv(file)
        payload = json.loads(file.read_text())
        fields = {f.name for f in dataclasses.fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in payload["rows"]]
        return rows, payload["environment"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: not a flashot bench result ({exc})") from None


def result_file(folder: Path) -> Path | None:
    """The suite's result in ``folder`` that :func:`read` takes, or None without one."""
    found = [f for f in (folder / "bench.json", folder / "bench.csv") if f.exists()]
    # (write() writes the JSON last; a tie goes to the JSON, listed first)
    return max(found, key=lambda f: f.stat().st_mtime_ns) if found else None


def _read_csv(file: Path) -> tuple[list[Row], dict]:
    lines = file.read_text().splitlines()
    env: dict[str, Any] = {}
    for line in lines:  # (schema 1: the environment in comment lines)
        if not line.startswith("# "):
            break
        key, value = line[2:].split(": ", 1)
        env[key] = json.loads(value)
    body = lines[len(env) :]
    meta = file.with_name(file.name.removesuffix(".csv") + ".meta.json")
    if not env and meta.exists():
        env = json.loads(meta.read_text())["environment"]
    types = {f.name: str(f.type) for f in dataclasses.fields(Row)}
    rows = []
    for record in csv.DictReader(body):
        given: dict[str, Any] = {}
        for key, text in record.items():
            if key not in types:
                continue  # x_floor is derived
            if text == "":
                given[key] = "" if key == "computes" else None
            elif "int" in types[key]:
                given[key] = int(text)
            elif "float" in types[key]:
                given[key] = float(text)
            else:
                given[key] = text
        rows.append(Row(**given))
    if "device" not in env:
        raise ValueError(f"no environment: {meta.name} is missing")
    return rows, env


def merge(runs: list[tuple[list[Row], dict]]) -> tuple[list[Row], dict]:
    """One suite from several runs of it on the same device (a sweep split over calls).

    Rows are keyed by (workload, provider, n, d): a later run's timed row replaces an
    earlier one, a later skip replaces only a skip; ``partial`` (a run cut short) carries
    over. Raises ValueError when the runs' devices, the versions they share or their
    problem settings (ε, iterations, tolerance) differ: their numbers would not compare.
    """
    rows: dict[tuple, Row] = {}
    first_env = runs[0][1]
    versions, settings = dict(first_env["versions"]), first_env.get("settings")
    for run_rows, env in runs:
        if env["device"] != first_env["device"]:
            raise ValueError(f"runs on different devices: {first_env['device']!r} and "
                             f"{env['device']!r}")  # fmt: skip
        clash = {k for k, v in env["versions"].items() if versions.get(k, v) != v}
        if clash:
            raise ValueError(f"runs with different versions of {', '.join(sorted(clash))}")
        if None not in (settings, env.get("settings")) and env["settings"] != settings:
            raise ValueError(f"runs with different settings: {settings} and {env['settings']}")
        settings = settings or env.get("settings")
        versions.update(env["versions"])
        for r in run_rows:
            key = (r.workload, r.provider, r.n, r.d)
            if key not in rows or not r.skipped or rows[key].skipped:
                rows[key] = r
    dates = [env["date"] for _, env in runs]
    env = dict(
        device=first_env["device"],
        versions=versions,
        command=" ; ".join(env["command"] for _, env in runs),
        date=min(dates) if len(set(dates)) == 1 else f"{min(dates)} … {max(dates)}",
    )
    if settings:
        env["settings"] = settings
    if any(run_env.get("partial") for _, run_env in runs):  # cut short: rows may be missing
        env["partial"] = True
    return list(rows.values()), env


def plot(rows: list[Row], out: Path, name: str = "bench") -> list[Path]:
    """Per workload, a PNG: time and memory against n (log-log), speed-up bars.

    Time per provider and d, memory for GPU rows, and every provider's speed-up over the
    slowest of the same d at the largest n. Returns the PNGs written (none without matplotlib).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    done = [r for r in rows if r.ms is not None]
    ms = {id(r): float(r.ms or 0.0) for r in done}  # (timed rows: never None)
    paths = []
    for workload in dict.fromkeys(r.workload for r in done):
        mine = [r for r in done if r.workload == workload]
        dims = sorted({r.d for r in mine})
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for prov in dict.fromkeys(r.provider for r in mine):
            for d in dims:
                pts = sorted(
                    (r.n, r.ms, r.peak_mb) for r in mine if r.provider == prov and r.d == d
                )
                if not pts:
                    continue
                ns = [p[0] for p in pts]
                axes[0].plot(ns, [p[1] for p in pts], marker="o", label=f"{prov}, d={d}")
                if all(p[2] is not None for p in pts):
                    axes[1].plot(ns, [p[2] for p in pts], marker="o", label=f"{prov}, d={d}")
        for ax, ylabel in ((axes[0], "time (ms)"), (axes[1], "peak memory above inputs (MB)")):
            ax.set(xscale="log", yscale="log", xlabel="n = m", ylabel=ylabel, title=workload)
            if ax.lines:
                ax.legend(fontsize=7)
        if not axes[1].lines:
            axes[1].text(0.5, 0.5, "not measured on the CPU", ha="center",
                         transform=axes[1].transAxes)  # fmt: skip
        largest = max(r.n for r in mine)
        last = [r for r in mine if r.n == largest]
        slowest = {d: max(ms[id(r)] for r in last if r.d == d) for d in {r.d for r in last}}
        labels = [f"{r.provider}\nd={r.d}" for r in last]
        axes[2].bar(range(len(last)), [slowest[r.d] / ms[id(r)] for r in last])
        axes[2].set_xticks(range(len(last)), labels, fontsize=6, rotation=60)
        axes[2].set(ylabel="speed-up over the slowest (same d)", title=f"{workload}, n = {largest}")
        fig.tight_layout()
        path = out / f"{name}_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
