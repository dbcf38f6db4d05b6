"""The ``flashot`` command line: ``solve``, ``otdd``, ``tune``, ``info``, ``bench``, ``demo``.

This module parses with the standard library only, so ``flashot --help`` answers at
once; the commands (:mod:`flashot.cli.commands`, :mod:`flashot.cli.bench`) import
torch when they run. Uses the public API only.
"""

from __future__ import annotations

import argparse
import math
import sys

from flashot.cli.common import EXIT_ERROR, EXIT_NOT_CONVERGED, JSON_SCHEMA, CliError

__all__ = ["EXIT_ERROR", "EXIT_NOT_CONVERGED", "CliError", "build_parser", "load_array", "main"]

DESCRIPTION = "IO-aware entropic optimal transport (FlashSinkhorn) for large point clouds."
#: ``--cost`` choices (flashot.COSTS, checked by the tests)
COST_NAMES = ("cosine", "half_sqeuclidean", "sqeuclidean")
DTYPE_NAMES = ("float32", "float64")
PRECISION_CHOICES = ["auto", "fp32", "tf32", "bf16", "fp16"]


def _tolerance(text: str):
    """``--tol``: a number ≥ 0 or 'auto'."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def _names(text: str) -> list[str]:
    """A comma-separated list of precision modes."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in ("fp32", "tf32", "bf16", "fp16")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected fp32, tf32, bf16 or fp16, got {text!r}")
    return names


def _positive(kind):
    """An argparse type: a finite number > 0 of ``kind`` (a bad one exits with code 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _sizes(text: str) -> list[int]:
    """A comma-separated list of positive integers."""
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sizes


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


_DEVICE = "auto"  # (the GPU when there is one: resolved when the command runs)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``flashot`` command."""
    import flashot  # (its public names load on first use: nothing heavy here)

    parser = argparse.ArgumentParser(prog="flashot", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"flashot {flashot.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("solve", help="entropic OT between two point clouds stored in files",
                       formatter_class=_HelpFormatter)  # fmt: skip
    s.add_argument("x", help="source points (n, d): .npy, .npz, .pt or .csv")
    s.add_argument("y", help="target points (m, d)")
    s.add_argument("--key", help="array name inside .npz/.pt files (both inputs)")
    s.add_argument("--x-key", help="array name inside x's .npz/.pt file (overrides --key)")
    s.add_argument("--y-key", help="array name inside y's .npz/.pt file (overrides --key)")
    s.add_argument("--header", default="auto", choices=["auto", "yes", "no"],
                   help="CSV first line is a header: auto (if non-numeric), yes, no")  # fmt: skip
    s.add_argument("--a", help="source weights (n,), a file like x (default uniform)")
    s.add_argument("--b", help="target weights (m,), a file like y (default uniform)")
    s.add_argument("--eps", type=_positive(float), default=0.05, help="entropic regularization ε")
    s.add_argument("--cost", default="sqeuclidean", choices=COST_NAMES,
                   help="ground cost")  # fmt: skip
    s.add_argument("--rho", type=float, help="KL marginal relaxation ρ (default: balanced)")
    s.add_argument("--max-iter", type=int, default=1000, help="iterations at most")
    s.add_argument(
        "--tol",
        type=_tolerance,
        default="auto",
        help="L1 marginal error to reach, or 'auto' (1e-6 or float32's floor)",
    )
    s.add_argument("--update", default="auto", choices=["auto", "symmetric", "alternating"],
                   help="averaged Jacobi (GeomLoss) or Gauss-Seidel (POT) updates")  # fmt: skip
    s.add_argument("--schedule", default="geomloss", choices=["geomloss", "none"],
                   help="ε annealing")  # fmt: skip
    s.add_argument("--scaling", type=float, default=0.5, help="annealing ratio")
    s.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="streaming backend (auto: Triton on CUDA)")  # fmt: skip
    s.add_argument("--precision", default="auto", choices=PRECISION_CHOICES,
                   help="how score tiles are computed (auto: accurate)")  # fmt: skip
    s.add_argument("--device", default=_DEVICE, help="torch device (auto: the GPU if any)")
    s.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="compute dtype")
    s.add_argument("--save", help="write f, g and the barycentric map to this .npz")
    s.add_argument("--force", action="store_true", help="let --save overwrite an existing file")
    s.add_argument("--json", action="store_true",
                   help=f"one JSON object on stdout (schema {JSON_SCHEMA})")  # fmt: skip
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--progress", action="store_true",
                   help="a progress bar even when stderr is no terminal")  # fmt: skip
    s.set_defaults(run=_command)

    i = sub.add_parser("info", help="versions, backends and devices",
                       formatter_class=_HelpFormatter)  # fmt: skip
    i.add_argument("--json", action="store_true",
                   help=f"one JSON object on stdout (schema {JSON_SCHEMA})")  # fmt: skip
    i.set_defaults(run=_command)

    o = sub.add_parser("otdd", help="dataset distance (OTDD) between two labeled datasets",
                       formatter_class=_HelpFormatter)  # fmt: skip
    o.add_argument("a", help="dataset name (mnist, mnist-test, mnist5k, digits, with "
                   ":rot90, :invert, :8x8, :shuffle-labels) or an .npz with X and y")  # fmt: skip
    o.add_argument("b", help="the second dataset, the same way")
    o.add_argument("--n", type=_positive(int),
                   help="a random subset of n points of each (default all)")  # fmt: skip
    o.add_argument("--eps", type=_positive(float), default=0.5, help="entropic regularization ε")
    o.add_argument("--lambda-x", type=float, default=1.0, help="feature weight")
    o.add_argument("--lambda-y", type=float, default=1.0, help="label weight")
    o.add_argument("--inner", default="gaussian", choices=["gaussian", "exact"],
                   help="class-to-class distance (gaussian: Bures-Wasserstein)")  # fmt: skip
    o.add_argument("--diagonal", action="store_true", help="diagonal covariances (large d)")
    o.add_argument(
        "--unbiased",
        action="store_true",
        help="class covariances over n-1, as microsoft/otdd (default: over n)",
    )
    o.add_argument("--no-debias", action="store_true", help="OT_eps instead of the divergence")
    o.add_argument("--schedule", default="geomloss", choices=["geomloss", "none"],
                   help="ε annealing")  # fmt: skip
    o.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="streaming backend (auto: Triton on CUDA)")  # fmt: skip
    o.add_argument("--precision", default="auto", choices=PRECISION_CHOICES,
                   help="how score tiles are computed (auto: accurate)")  # fmt: skip
    o.add_argument("--device", default=_DEVICE, help="torch device (auto: the GPU if any)")
    o.add_argument("--json", action="store_true",
                   help=f"one JSON object on stdout (schema {JSON_SCHEMA})")  # fmt: skip
    o.set_defaults(run=_command)

    t = sub.add_parser("tune", help="tune the Triton kernels' tiles on this GPU (kept on disk)",
                       formatter_class=_HelpFormatter)  # fmt: skip
    t.add_argument(
        "--precision",
        type=_names,
        help="precision modes, comma-separated (default: fp32, tf32, bf16)",
    )
    t.add_argument("--d", type=_sizes,
                   help="feature sizes, comma-separated (default: 3, 64, 128, 512: one per "
                        "regime of the kernels' feature tile)")  # fmt: skip
    t.add_argument(
        "--n", type=_sizes, help="cloud sizes n = m, comma-separated (default: 10000, 50000)"
    )
    t.add_argument("--out", help="table to write (default: this user's table for the GPU)")
    t.add_argument("--no-hvp", action="store_true", help="skip the Hessian-vector product")
    t.add_argument("--device", default="cuda", help="the CUDA device")
    t.set_defaults(run=_command)

    b = sub.add_parser("bench", help="flashot beside the other OT libraries on this machine",
                       formatter_class=_HelpFormatter)  # fmt: skip
    from flashot.bench.options import add_arguments as bench_arguments

    bench_arguments(b)
    b.set_defaults(run=_bench)

    d = sub.add_parser("demo", help="color transfer between two pictures (writes a PNG)",
                       formatter_class=_HelpFormatter)  # fmt: skip
    d.add_argument("--out", default="flashot_demo.png", help="the figure to write")
    d.add_argument("--n", type=int, default=4000, help="pixels sampled per picture")
    d.add_argument("--eps", type=_positive(float), default=5e-3, help="entropic regularization ε")
    d.add_argument("--device", default=_DEVICE, help="torch device (auto: the GPU if any)")
    d.add_argument("--json", action="store_true",
                   help=f"one JSON object on stdout (schema {JSON_SCHEMA})")  # fmt: skip
    d.set_defaults(run=_command)
    return parser


def _command(args) -> int:
    from flashot.cli.commands import run

    return run(args)


def _bench(args) -> int:
    from flashot.cli.bench import run

    return run(args)


def __getattr__(name: str):
    if name == "load_array":  # (numpy, loaded on use)
        from flashot.cli.commands import load_array

        return load_array
    raise AttributeError(f"module 'flashot.cli' has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashot`` command."""
    args = build_parser().parse_args(argv)
    args.command_line = "flashot " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except CliError as err:
        print(f"flashot: {err}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
