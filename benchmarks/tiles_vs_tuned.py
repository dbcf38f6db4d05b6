"""Shipped tile tables against autotuning, per benchmark case (issue 14, item 1: within 10 %).

Each case runs in two fresh processes: with the tables as shipped (``FLASHOT_AUTOTUNE=0``,
an empty user table), then with autotuning opted in on a user table seeded with the
shipped one, so only keys the tables lack (they take the nearest entry or the heuristic)
are tuned, with the announcement line on stderr. The first process also lists, from
:func:`flashot.backends.triton._tables.provenance`, every launch key that had no exact
entry. do_bench medians (ms) after a first call. Env: ONLY (substrings of the case names,
comma-separated).

    python benchmarks/tiles_vs_tuned.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [f"{w} {n // 1000}k d{d}" for w in ("fwd", "grad") for n in (10_000, 50_000)
         for d in (64, 512)] + [f"geomloss {n // 1000}k d{d}" for n in (10_000, 50_000)
                                for d in (3, 64)]  # fmt: skip


def call_of(case: str):
    """The case's callable (the bench's problem and call, or the GeomLoss call)."""
    import torch

    import flashot
    from flashot.bench.providers import Flashot, make_problem

    work, size, dim = case.split()
    n, d = int(size[:-1]) * 1000, int(dim[1:])
    dev = torch.device("cuda")
    if work == "geomloss":
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.rand(n, d, device=dev, generator=gen)
        y = torch.rand(n, d, device=dev, generator=gen)
        loss = flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True)

        def run():
            xs = x.detach().requires_grad_()
            return torch.autograd.grad(loss(xs, y), xs)[0]

        return run
    workload = "forward" if work == "fwd" else "gradient"
    return Flashot("triton").prepare(workload, make_problem(n, n, d, dev, eps=0.1))


def child(cases: list[str]) -> None:
    """Time the cases in this process; one JSON line each."""
    import torch
    from triton.testing import do_bench

    from flashot.backends.triton import _tables

    for case in cases:
        _tables._CHOSEN.clear()  # each case records the sources of all its keys
        _tables._SOURCE.clear()
        run = call_of(case)
        run()
        torch.cuda.synchronize()
        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
        stand_ins = {str(key[2]): why for key, why in _tables.provenance().items()
                     if not why.startswith("the ")}  # fmt: skip
        print(json.dumps({"case": case, "ms": ms, "stand_ins": stand_ins}), flush=True)


def in_fresh_process(cases: list[str], tuned: bool) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="flashot_tiles_"))
    env = {**os.environ, "FLASHOT_CACHE_DIR": str(cache), "FLASHOT_AUTOTUNE": "1" if tuned else "0",
           "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    if tuned:  # the shipped entries count as tuned: only what they lack is tuned here
        import torch

        major, minor = torch.cuda.get_device_capability()
        shipped = ROOT / "src/flashot/backends/triton/tiles" / f"sm_{major}{minor}.json"
        if shipped.exists():
            shutil.copy(shipped, cache / f"tiles_sm_{major}{minor}.json")
    out = subprocess.run([sys.executable, __file__, "--child", *cases], env=env, text=True,
                         stdout=subprocess.PIPE, check=False)  # fmt: skip
    shutil.rmtree(cache, ignore_errors=True)
    return {row["case"]: row for row in map(json.loads, out.stdout.splitlines())}


def main() -> None:
    only = [s for s in os.environ.get("ONLY", "").split(",") if s]
    cases = [c for c in CASES if not only or any(s in c for s in only)]
    tables = in_fresh_process(cases, tuned=False)
    tuned = in_fresh_process(cases, tuned=True)
    print("| case | tables (ms) | autotuned (ms) | tables / tuned | keys without an exact entry |")
    print("|---|---|---|---|---|")
    for case in cases:
        a, b = tables.get(case), tuned.get(case)
        if a is None or b is None:
            times = ["failed" if r is None else f"{r['ms']:.2f}" for r in (a, b)]
            print(f"| {case} | {times[0]} | {times[1]} | — | — |")
            continue
        keys = "; ".join(f"{k}: {v}" for k, v in a["stand_ins"].items()) or "none"
        print(f"| {case} | {a['ms']:.2f} | {b['ms']:.2f} | {a['ms'] / b['ms']:.2f} | {keys} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
