"""The commands of ``flashot`` (:mod:`flashot.cli` parses, then runs one of these).

Uses the public API only.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

import flashot
from flashot.cli.common import EXIT_NOT_CONVERGED, JSON_SCHEMA, CliError, parse_device

__all__ = ["load_array", "run"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _progress(args) -> bool:
    """A progress bar on a terminal (or when asked), never with --json or --quiet."""
    return not (args.json or args.quiet) and (args.progress or sys.stderr.isatty())


def _json(command: str, fields: dict) -> str:
    return json.dumps(dict(schema=JSON_SCHEMA, command=command, **fields))


def _read_csv(p: Path, header: str) -> np.ndarray:
    """Numbers of a comma-separated file; ``header`` is "auto", "yes" or "no".

    A UTF-8 byte-order mark is skipped. With "auto" only a first line holding a
    non-numeric cell is a header; a row that does not parse is an error naming it.
    """
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise CliError(f"{p}: not a UTF-8 text file ({err.reason})") from err
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise CliError(f"{p}: no data rows")

    def parse(number: int, line: str) -> list[float] | None:
        out = []
        for col, cell in enumerate(line.split(","), start=1):
            cell = cell.strip()
            if not cell:
                raise CliError(f"{p}: row {number}, column {col} is empty")
            try:
                out.append(float(cell))
            except ValueError:
                return None
        return out

    first = parse(*lines[0])
    if header == "yes" or (header == "auto" and first is None):
        lines = lines[1:]
    elif first is None:
        raise CliError(f"{p}: row {lines[0][0]} is not numeric (a header? pass --header yes)")
    rows: list[list[float]] = []
    for number, line in lines:
        row = parse(number, line)
        if row is None:
            raise CliError(f"{p}: row {number} holds a non-numeric cell: {line.strip()[:60]!r}")
        if rows and len(row) != len(rows[0]):
            raise CliError(f"{p}: row {number} has {len(row)} columns, the first {len(rows[0])}")
        rows.append(row)
    if not rows:
        raise CliError(f"{p}: no data rows after the header")
    return np.asarray(rows, dtype=np.float64)


def load_array(path: str, key: str | None = None, header: str = "auto") -> np.ndarray:
    """Read a 1-D or 2-D real array from .npy, .npz, .pt/.pth or .csv/.txt.

    Args:
        path: the file.
        key: the array's name inside an .npz with several arrays (or a dict in a .pt file).
        header: for text files, "auto" (a non-numeric first line is a header), "yes", "no".

    Raises:
        CliError: with a one-line message, for anything wrong with the file.
    """
    p = Path(path)
    if p.is_dir():
        raise CliError(f"{path} is a folder, not a file")
    if not p.is_file():
        raise CliError(f"no such file: {path}")
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            arr = np.load(p, allow_pickle=False)
        elif suffix == ".npz":
            with np.load(p, allow_pickle=False) as data:
                names = list(data.keys())
                if key is None and len(names) != 1:
                    raise CliError(f"{path} holds arrays {names}; choose one with --x-key/--y-key")
                if key is not None and key not in names:
                    raise CliError(f"{path} has no array {key!r} (it holds {names})")
                arr = data[key or names[0]]
        elif suffix in (".pt", ".pth"):
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                if key is None and len(obj) != 1:
                    raise CliError(f"{path} holds {sorted(obj)}; choose one with --x-key/--y-key")
                if key is not None and key not in obj:
                    raise CliError(f"{path} has no entry {key!r} (it holds {sorted(obj)})")
                obj = obj[key or next(iter(obj))]
            if not isinstance(obj, torch.Tensor):
                raise CliError(f"{path} does not hold a tensor")
            arr = obj.detach().cpu().numpy()
        elif suffix in (".csv", ".txt"):
            arr = _read_csv(p, header)
        else:
            raise CliError(f"unsupported file type {suffix!r} (use .npy, .npz, .pt, .csv)")
    except CliError:
        raise
    except Exception as err:  # numpy/torch/zip errors on empty or corrupt files
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise CliError(f"cannot read {path}: {type(err).__name__}: {first}") from err
    if np.iscomplexobj(arr):
        raise CliError(f"{path} holds complex numbers; flashot needs real points")
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise CliError(f"{path} is not numeric (dtype {arr.dtype})")
    if arr.ndim not in (1, 2) or arr.size == 0:
        raise CliError(f"{path} must hold a non-empty 1-D or 2-D array, got shape {arr.shape}")
    return arr


def _cloud(path, key, header, dtype, device) -> torch.Tensor:
    arr = load_array(path, key, header)
    if arr.ndim == 1:
        arr = arr[:, None]
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=dtype)


def _weights(path, header, dtype, device) -> torch.Tensor | None:
    if path is None:
        return None
    arr = load_array(path, None, header)
    return torch.from_numpy(np.ascontiguousarray(arr.reshape(-1))).to(device, dtype)


def _save_target(args) -> Path | None:
    """The path --save will write (``.npz`` added when missing), checked before solving."""
    if not args.save:
        return None
    out = Path(args.save)
    if out.suffix.lower() != ".npz":
        out = out.with_name(out.name + ".npz")
    inputs = [Path(p).resolve() for p in (args.x, args.y, args.a, args.b) if p]
    if out.resolve() in inputs:
        raise CliError(f"--save {out} would overwrite an input file")
    if out.exists() and not args.force:
        raise CliError(f"{out} exists; pass --force to overwrite it")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"cannot save to {out}: no directory {parent}")
    if not os.access(parent, os.W_OK):
        raise CliError(f"cannot save to {out}: directory {parent} is not writable")
    return out


def _device(name: str) -> torch.device:
    return parse_device(name)


def _solve(args) -> int:
    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    out = _save_target(args)
    x = _cloud(args.x, args.x_key or args.key, args.header, dtype, device)
    y = _cloud(args.y, args.y_key or args.key, args.header, dtype, device)
    a = _weights(args.a, args.header, dtype, device)
    b = _weights(args.b, args.header, dtype, device)
    rho = None if args.rho is None else args.rho
    try:
        schedule = None if args.schedule == "none" else flashot.EpsilonScaling(args.scaling)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", flashot.ConvergenceWarning)  # reported below
            res = flashot.sinkhorn(
                x,
                y,
                a,
                b,
                eps=args.eps,
                cost=args.cost,
                rho=rho,
                max_iter=args.max_iter,
                tol=args.tol,
                update=args.update,
                eps_schedule=schedule,
                backend=args.backend,
                precision=args.precision,
                progress=_progress(args),
            )
        transport_cost = res.transport_cost.item()
    except (ValueError, TypeError, FloatingPointError) as err:
        raise CliError(" ".join(str(err).split())) from err
    summary = dict(
        n=x.shape[0],
        m=y.shape[0],
        d=x.shape[1],
        cost_name=args.cost,
        eps=args.eps,
        rho=rho,
        cost=res.cost.item(),
        transport_cost=transport_cost,
        n_iter=res.n_iter,
        marginal_error=res.marginal_error,
        converged=res.converged,
        backend=res.plan.backend.name,
        precision=res.plan.backend.precision,
        device=str(device),
        dtype=args.dtype,
        saved=None if out is None else str(out),
    )
    if out is not None:
        np.savez(
            out,
            f=res.f.detach().cpu().numpy(),
            g=res.g.detach().cpu().numpy(),
            barycentric_map=res.plan.barycentric_map().cpu().numpy(),
        )
    if args.json:
        print(_json("solve", summary))
    else:
        print(f"entropic OT between {summary['n']} and {summary['m']} points in R^{summary['d']}")
        print(f"  cost {args.cost}, eps {args.eps:g}" + ("" if rho is None else f", rho {rho:g}"))
        print(f"  OT_eps          {summary['cost']:.8g}")
        print(f"  <P, C>          {summary['transport_cost']:.8g}")
        state = "converged" if res.converged is not False else "NOT converged"
        print(f"  iterations      {res.n_iter} ({state}, marginal error {res.marginal_error:.2e})")
        if out is not None:
            print(f"  saved f, g and the barycentric map to {out}")
    if res.converged is False:
        print(f"flashot: not converged: marginal error {res.marginal_error:.3e} > tol "
              f"{args.tol} after {res.n_iter} iterations", file=sys.stderr)  # fmt: skip
        return EXIT_NOT_CONVERGED
    return 0


def _labeled(source: str, n: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels: a dataset name (flashot.tasks.datasets) or an .npz with X and y."""
    from flashot.tasks import datasets

    if source.endswith(".npz"):
        if Path(source).is_file() and not zipfile.is_zipfile(source):
            raise CliError(f"cannot read {source}: not an .npz archive (corrupt or another "
                           "format)")  # fmt: skip
        try:
            with np.load(source, allow_pickle=False) as data:
                if not {"X", "y"} <= set(data.files):
                    raise CliError(f"{source}: needs arrays 'X' (n, d) and 'y' (n,), "
                                   f"found {sorted(data.files)}")  # fmt: skip
                x, y = torch.as_tensor(data["X"]).float(), torch.as_tensor(data["y"])
        except CliError:
            raise
        except Exception as err:  # a missing, corrupt (zip) or unreadable file
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise CliError(f"cannot read {source}: {type(err).__name__}: {first}") from err
        if n is not None:
            keep = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:n]
            x, y = x[keep], y[keep]
    else:
        try:
            x, y = datasets.load(source, n)
        except (ImportError, ValueError, RuntimeError) as err:
            raise CliError(f"{source}: {err}") from err
    if not bool(torch.isfinite(x).all()):
        raise CliError(f"{source}: the features X hold NaN or infinite values")
    if y.is_floating_point():
        if not bool((y == y.round()).all()):
            raise CliError(f"{source}: labels y must be integers")
        y = y.long()
    return x.to(device), y.to(device)


def _otdd(args) -> int:
    """``flashot otdd A B``: the dataset distance and the class-to-class mass."""
    import time

    from flashot.tasks.otdd import dataset_distance

    device = _device(args.device)
    xa, ya = _labeled(args.a, args.n, device)
    xb, yb = _labeled(args.b, args.n, device)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", flashot.ConvergenceWarning)
            out = dataset_distance(
                xa, ya, xb, yb, eps=args.eps, lambda_x=args.lambda_x, lambda_y=args.lambda_y,
                inner=args.inner, diagonal=args.diagonal, debias=not args.no_debias,
                unbiased=args.unbiased,
                eps_schedule=None if args.schedule == "none" else "geomloss",
                backend=args.backend, precision=args.precision,
            )  # fmt: skip
            distance = float(out.distance)
    except (ValueError, TypeError, FloatingPointError) as err:
        raise CliError(" ".join(str(err).split())) from err
    seconds = time.perf_counter() - start
    misses = [str(w.message) for w in caught if issubclass(w.category, flashot.ConvergenceWarning)]
    mass = out.class_mass.cpu()
    backend = out.result.plan.backend
    summary = dict(a=args.a, b=args.b, n_a=len(xa), n_b=len(xb), d=xa.shape[1],
                   eps=args.eps, inner=args.inner, debias=not args.no_debias,
                   distance=distance, converged=not misses, seconds=round(seconds, 3),
                   classes_a=out.classes_a.tolist(), classes_b=out.classes_b.tolist(),
                   class_mass=mass.tolist(), backend=backend.name,
                   precision=backend.precision)  # fmt: skip
    if args.json:
        print(_json("otdd", summary))
    else:
        kind = "debiased OTDD" if not args.no_debias else "OTDD (OT_eps, not debiased)"
        print(f"{kind} between {args.a} ({len(xa)} points) and {args.b} ({len(xb)} points), "
              f"d = {xa.shape[1]}, eps {args.eps:g}, inner {args.inner}: {distance:.6g} "
              f"({seconds:.1f} s)")  # fmt: skip
        print("class-to-class mass (% of the total; rows: A's classes, columns: B's):")
        print("      " + "".join(f"{int(c):>6d}" for c in out.classes_b))
        for c, row in zip(out.classes_a.tolist(), mass.tolist(), strict=True):
            print(f"{int(c):>6d}" + "".join(f"{100 * v:6.1f}" for v in row))
    for miss in misses:
        print(f"flashot: {miss}", file=sys.stderr)
    return EXIT_NOT_CONVERGED if misses else 0


def _info(args) -> int:
    cuda = torch.cuda.is_available()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = dict(
        flashot=flashot.__version__,
        torch=torch.__version__,
        triton=triton_version,
        python=platform.python_version(),
        cuda=cuda,
        device=torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        backends={"cpu": flashot.available_backends("cpu")}
        | ({"cuda": flashot.available_backends("cuda")} if cuda else {}),
    )
    if args.json:
        print(_json("info", info))
    else:
        for k, v in info.items():
            print(f"{k:10s} {v}")
    return 0


def _demo(args) -> int:
    from flashot.tasks.demo import run_demo

    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise CliError("flashot demo needs matplotlib: pip install 'flashot[demo]'") from err
    _device(args.device)
    summary = run_demo(args.out, n=args.n, eps=args.eps, device=args.device, progress=not args.json)
    if args.json:
        print(_json("demo", summary))
    else:
        print(
            f"color transfer: {summary['n']} x {summary['m']} pixel colors, "
            f"eps {summary['eps']:g}\n"
            f"  OT_eps {summary['cost']:.6f}, <P, C> {summary['transport_cost']:.6f}, "
            f"{summary['n_iter']} iterations (marginal error {summary['marginal_error']:.1e})\n"
            f"  solve {summary['solve_seconds']:.1f} s, map of {summary['mapped_pixels']} pixels "
            f"{summary['map_seconds']:.1f} s\n  figure written to {summary['figure']}"
        )
    return 0


def _tune(args) -> int:
    """``flashot tune``: autotune the sweep's launch keys and write the tile table."""
    from flashot.backends.triton.tune import tune

    if not torch.cuda.is_available():
        raise CliError("tune needs a CUDA GPU: tiles are tuned on the GPU that runs them")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # options left out take the tuner's own defaults (its DEFAULT_* sweep)
    sweep = {name: value for name, value in (("precisions", args.precision), ("dims", args.d),
                                             ("sizes", args.n)) if value is not None}  # fmt: skip
    path = tune(**sweep, out=args.out, hvp=not args.no_hvp, device=args.device, log=log)
    print(f"tiles written to {path}")
    return 0


def _resolve_device(args) -> None:
    """``--device auto``: the GPU when there is one (decided here, not when parsing)."""
    if getattr(args, "device", None) == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"


def run(args) -> int:
    """Run the parsed command ``args.command`` (its exit code)."""
    _resolve_device(args)
    return {"solve": _solve, "info": _info, "otdd": _otdd, "tune": _tune, "demo": _demo}[
        args.command](args)  # fmt: skip
