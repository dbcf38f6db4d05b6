"""``flashot bench``'s options, parsed with the standard library only (``--help`` is instant)."""

from __future__ import annotations

import argparse

__all__ = ["FULL", "PROVIDERS", "QUICK", "WORKLOADS", "add_arguments"]

#: provider names accepted by ``--providers`` (flashot's precision rows included)
PROVIDERS = ("flashot-torch", "flashot-triton", "flashot-triton-tf32", "flashot-triton-bf16",
             "flashot-triton-stream", "flashot-triton-cache", "dense-torch", "geomloss-tensorized",
             "geomloss-online", "pot", "pot-lazy", "flash-sinkhorn", "ott-dense",
             "ott-online")  # fmt: skip

WORKLOADS = ("forward", "gradient", "converge", "plan", "hvp", "otdd")
#: the default suite per device type: (sizes, dims); --full: FULL
QUICK = {"cuda": ((10_000, 50_000), (64,)), "cpu": ((1_000, 4_000), (3, 64))}
FULL = {"cuda": ((1_000, 10_000, 50_000, 200_000, 1_000_000), (3, 64, 512, 1024)),
        "cpu": ((1_000, 4_000, 10_000, 30_000), (3, 64))}  # fmt: skip


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(v) for v in text.split(",") if v)
        except ValueError:
            msg = f"expected comma-separated values, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` options."""
    p.add_argument("--full", action="store_true",
                   help="the suite behind BENCHMARKS.md (sizes up to 1M on a GPU)")  # fmt: skip
    p.add_argument("--workloads", type=_csv(str), default="forward,gradient",
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")  # fmt: skip
    p.add_argument("--sizes", type=_csv(int), help="n = m, comma-separated (default: per device)")
    p.add_argument("--dims", type=_csv(int), help="feature sizes d (default: per device)")
    p.add_argument("--providers", type=_csv(str),
                   help=f"comma-separated, run in this order, of {', '.join(PROVIDERS)} "
                        "(default: all)")  # fmt: skip
    p.add_argument("--eps", type=float, default=0.1, help="ε, for the cost |x − y|²")
    p.add_argument("--iters", type=int, default=10, help="iterations of the fixed workloads")
    p.add_argument("--tol", type=float, default=1e-3, help="marginal error of 'converge'")
    p.add_argument("--device", default="auto", help="torch device (auto: the GPU if any)")
    p.add_argument("--out", default="flashot_bench", help="folder for CSV, JSON and PNGs")
    p.add_argument("--no-floor", action="store_true", help="skip measuring the GPU's ceilings")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--row-budget", type=float, default=30.0, metavar="SECONDS",
                   help="skip a provider at a size where its previous size predicts calls "
                        "over SECONDS (time × (n/n_prev)²)")  # fmt: skip
    p.add_argument("--largest", type=float, default=0.0, metavar="SECONDS",
                   help="also find the largest n each provider runs a workload at in one "
                        "call of at most SECONDS (doubling n; 0: skip)")  # fmt: skip
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="run nothing: merge the results of earlier runs (their --out folders, "
                        "the same device) into --out, later runs' rows replacing earlier "
                        "ones: a sweep split over several sessions")  # fmt: skip
    p.add_argument("--resume", action="store_true",
                   help="keep the rows --out already holds (a run cut short writes them as "
                        "it goes) and run only the missing ones, and those a smaller "
                        "--row-budget skipped; --largest reruns")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="replace a result --out already holds (without it, a run into a "
                        "folder with a result refuses to start)")  # fmt: skip
    p.add_argument("--largest-cap", type=int, default=None, metavar="N",
                   help="the largest n tried by --largest (default 4M on a GPU, 64k on a "
                        "CPU)")  # fmt: skip
