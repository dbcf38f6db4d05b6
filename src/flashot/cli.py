"""The ``flashot`` command line: ``solve``, ``info``, ``demo``.

Uses the public API only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch

import flashot

__all__ = ["load_array", "main"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def load_array(path: str, key: str | None = None) -> np.ndarray:
    """Read a 1-D or 2-D array from .npy, .npz, .pt/.pth or .csv.

    Args:
        path: the file.
        key: the array's name inside an .npz with several arrays (or a dict in a .pt file).
    """
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"flashot: no such file: {path}")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        arr = np.load(p, allow_pickle=False)
    elif suffix == ".npz":
        with np.load(p, allow_pickle=False) as data:
            names = list(data.keys())
            if key is None and len(names) != 1:
                raise SystemExit(f"flashot: {path} holds arrays {names}; choose one with --key")
            arr = data[key or names[0]]
    elif suffix in (".pt", ".pth"):
        obj = torch.load(p, map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            if key is None and len(obj) != 1:
                raise SystemExit(f"flashot: {path} holds {sorted(obj)}; choose one with --key")
            obj = obj[key or next(iter(obj))]
        if not isinstance(obj, torch.Tensor):
            raise SystemExit(f"flashot: {path} does not hold a tensor")
        arr = obj.detach().cpu().numpy()
    elif suffix in (".csv", ".txt"):
        try:
            arr = np.loadtxt(p, delimiter=",", ndmin=2)
        except ValueError:  # a header line
            arr = np.loadtxt(p, delimiter=",", ndmin=2, skiprows=1)
    else:
        raise SystemExit(f"flashot: unsupported file type {suffix!r} (use .npy, .npz, .pt, .csv)")
    if not np.issubdtype(arr.dtype, np.number):
        raise SystemExit(f"flashot: {path} is not numeric")
    return arr


def _cloud(path, key, dtype, device) -> torch.Tensor:
    arr = load_array(path, key)
    if arr.ndim == 1:
        arr = arr[:, None]
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=dtype)


def _weights(path, dtype, device) -> torch.Tensor | None:
    if path is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(load_array(path).reshape(-1))).to(device, dtype)


def _solve(args) -> int:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    x = _cloud(args.x, args.key, dtype, device)
    y = _cloud(args.y, args.key, dtype, device)
    a, b = _weights(args.a, dtype, device), _weights(args.b, dtype, device)
    rho = None if args.rho is None else args.rho
    schedule = None if args.schedule == "none" else flashot.EpsilonScaling(args.scaling)
    try:
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
            progress=not args.json and not args.quiet,
        )
    except (ValueError, TypeError) as err:
        raise SystemExit(f"flashot: {err}") from err
    summary = dict(
        n=x.shape[0],
        m=y.shape[0],
        d=x.shape[1],
        cost_name=args.cost,
        eps=args.eps,
        rho=rho,
        ot_cost=res.cost.item(),
        transport_cost=res.transport_cost.item(),
        n_iter=res.n_iter,
        marginal_error=res.marginal_error,
        converged=res.converged,
        backend=args.backend,
        device=str(device),
        dtype=args.dtype,
    )
    if args.save:
        np.savez(
            args.save,
            f=res.f.cpu().numpy(),
            g=res.g.cpu().numpy(),
            barycentric_map=res.plan.barycentric_map().cpu().numpy(),
        )
        summary["saved"] = args.save
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"entropic OT between {summary['n']} and {summary['m']} points in R^{summary['d']}")
        print(f"  cost {args.cost}, eps {args.eps:g}" + ("" if rho is None else f", rho {rho:g}"))
        print(f"  OT_eps          {summary['ot_cost']:.8g}")
        print(f"  <P, C>          {summary['transport_cost']:.8g}")
        state = "converged" if res.converged else "NOT converged"
        print(f"  iterations      {res.n_iter} ({state}, marginal error {res.marginal_error:.2e})")
        if args.save:
            print(f"  saved f, g and the barycentric map to {args.save}")
    return 0


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
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:10s} {v}")
    return 0


def _demo(args) -> int:
    from flashot.demo import run_demo

    summary = run_demo(args.out, n=args.n, eps=args.eps, device=args.device, progress=not args.json)
    if args.json:
        print(json.dumps(summary))
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``flashot`` command."""
    parser = argparse.ArgumentParser(prog="flashot", description=flashot.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashot {flashot.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("solve", help="entropic OT between two point clouds stored in files")
    s.add_argument("x", help="source points (n, d): .npy, .npz, .pt or .csv")
    s.add_argument("y", help="target points (m, d)")
    s.add_argument("--key", help="array name inside .npz/.pt files")
    s.add_argument("--a", help="source weights (n,)")
    s.add_argument("--b", help="target weights (m,)")
    s.add_argument("--eps", type=float, default=0.05, help="entropic regularization (default 0.05)")
    s.add_argument("--cost", default="sqeuclidean", choices=sorted(flashot.COSTS))
    s.add_argument("--rho", type=float, help="KL marginal relaxation (unbalanced OT)")
    s.add_argument("--max-iter", type=int, default=1000)
    s.add_argument("--tol", type=float, default=1e-6)
    s.add_argument("--update", default="symmetric", choices=["symmetric", "alternating"])
    s.add_argument(
        "--schedule",
        default="geomloss",
        choices=["geomloss", "none"],
        help="eps annealing (default geomloss)",
    )
    s.add_argument("--scaling", type=float, default=0.5, help="annealing ratio (default 0.5)")
    s.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    s.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16", "fp16"])
    s.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    s.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    s.add_argument("--save", help="write f, g and the barycentric map to this .npz")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(run=_solve)

    i = sub.add_parser("info", help="versions, backends and devices")
    i.add_argument("--json", action="store_true")
    i.set_defaults(run=_info)

    d = sub.add_parser("demo", help="color transfer between two pictures (writes a PNG)")
    d.add_argument("--out", default="flashot_demo.png")
    d.add_argument("--n", type=int, default=4000, help="pixels sampled per picture")
    d.add_argument("--eps", type=float, default=5e-3)
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashot`` command."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
