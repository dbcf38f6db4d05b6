"""``flashot bench`` (options: :mod:`flashot.bench.options`, suite: :mod:`flashot.bench`)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from flashot.bench.harness import (
    Row,
    environment,
    largest_sizes,
    run_suite,
    skipped_by_a_smaller_budget,
)
from flashot.bench.options import FULL, QUICK, WORKLOADS
from flashot.bench.providers import PROVIDERS, providers
from flashot.bench.report import merge, plot, read, result_file, table, write
from flashot.cli.common import CliError, parse_device

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Run the suite; print the table; write the files. Returns the exit code."""
    if args.merge:
        try:
            rows, env = merge([read(Path(path)) for path in args.merge])
        except ValueError as exc:
            raise CliError(f"--merge: {exc}") from None
        inputs = {Path(path).resolve() for path in args.merge}
        _check_out(Path(args.out), args.force or Path(args.out).resolve() in inputs)
        return _report(rows, env, Path(args.out))
    if args.device == "auto":  # (decided when running: parsing loads no torch)
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(args.device)
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        raise CliError(
            f"--workloads: unknown {', '.join(bad)} (choose from {', '.join(WORKLOADS)})"
        )
    unknown = [p for p in args.providers or () if p not in PROVIDERS]
    if unknown:
        raise CliError(
            f"--providers: unknown {', '.join(unknown)} (choose from {', '.join(PROVIDERS)})"
        )
    for flag, value in (("--eps", args.eps), ("--tol", args.tol)):
        if not 0 < value < float("inf"):
            raise CliError(f"{flag} must be finite and > 0, got {value}")
    if args.iters < 1:
        raise CliError(f"--iters must be ≥ 1, got {args.iters}")
    if not args.row_budget > 0:
        raise CliError(f"--row-budget must be > 0 seconds, got {args.row_budget}")
    if not args.largest >= 0:
        raise CliError(f"--largest must be ≥ 0 seconds, got {args.largest}")
    sizes, dims = (FULL if args.full else QUICK)["cuda" if device.type == "cuda" else "cpu"]
    sizes, dims = tuple(dict.fromkeys(args.sizes or sizes)), tuple(dict.fromkeys(args.dims or dims))
    if min(sizes) < 2 or min(dims) < 1:
        raise CliError("--sizes must be ≥ 2 and --dims ≥ 1")
    _check_out(Path(args.out), args.force or args.resume)  # before the first row runs
    chosen = providers(device, args.providers)  # in the order given (KeOps before Triton)

    def say(text: str) -> None:
        if not args.quiet:
            print(f"bench: {text}", file=sys.stderr, flush=True)

    out, env = Path(args.out), environment(device, getattr(args, "command_line", None))
    env["settings"] = f"eps {args.eps:g}, iters {args.iters}, tol {args.tol:g}"
    earlier = _earlier(out, env) if args.resume else []

    def with_earlier(rows: list[Row]) -> list[Row]:
        return merge([(earlier, env), (rows, env)])[0] if earlier else rows

    def saved(rows: list[Row]) -> None:  # after every row: a run cut short keeps them
        write(with_earlier(rows), {**env, "partial": True}, out)

    rows = run_suite(args.workloads, sizes, dims, chosen, device, eps=args.eps, iters=args.iters,
                     tol=args.tol, floors=not args.no_floor, row_budget_s=args.row_budget,
                     progress=say, saved=saved,
                     done={(r.workload, r.provider, r.n, r.d): r for r in earlier
                           if not skipped_by_a_smaller_budget(r, args.row_budget)})  # fmt: skip
    if args.largest > 0:
        cap = args.largest_cap or (1 << 22 if device.type == "cuda" else 1 << 16)
        rows += largest_sizes(args.workloads, dims, chosen, device, args.largest,
                              start=min(sizes), cap=cap, eps=args.eps, iters=args.iters,
                              tol=args.tol, progress=say)  # fmt: skip
    return _report(with_earlier(rows), env, out)


def _check_out(out: Path, replace: bool) -> None:
    """Refuse an ``--out`` that is a file, cannot be written, or holds a result.

    A result is refused unless this run may replace it (``replace``: ``--force``,
    ``--resume`` or a merge into it).
    """
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file, not a folder")
    if not replace and result_file(out) is not None:
        raise CliError(f"--out {out} already holds a bench result: pass --resume to add to "
                       "it, --force to replace it, or another --out")  # fmt: skip
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise CliError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None


def _earlier(out: Path, env: dict) -> list[Row]:
    """The rows --out holds for --resume (none without a result there).

    A result from another device, other versions or other settings is refused.
    """
    if result_file(out) is None:
        return []
    try:
        rows, before = read(out)
        merge([(rows, before), ([], env)])  # the same device and versions, or ValueError
    except ValueError as exc:
        raise CliError(f"--resume: {exc}") from None
    return rows


def _report(rows, env: dict, out: Path) -> int:
    """Print the table, write the files; the exit code."""
    files = write(rows, env, out) + plot(rows, out)
    print(f"{env['device']}; " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    if env.get("partial"):
        print("(merged from a run cut short: its missing rows are not in the table)")
    print(table(rows))
    print("\nwrote " + ", ".join(str(f) for f in files))
    return 0
