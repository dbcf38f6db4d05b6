"""OTDD between MNIST digits and their rotated copy, then a dataset flow toward it.
================================================================================

Dataset A: MNIST images; B: the same digits turned a quarter turn (another sample).
Prints the distance and the class-to-class mass, then moves A's images down the
gradient of OTDD(A, B) and writes PNG grids of every class as they rotate into B's
shapes (``--out``, one per ``--snapshot-every`` steps).

    python examples/otdd_flow.py --source mnist5k --n 2000 --steps 20 --out flow_pngs
    python examples/otdd_flow.py --source mnist --n 60000 --device cuda   # the full set
"""

import argparse

import torch

from flashot.tasks import datasets
from flashot.tasks.flows import dataset_flow
from flashot.tasks.otdd import dataset_distance


def main():
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--source", default="mnist5k", help="mnist, mnist-test, mnist5k")
    p.add_argument("--n", type=int, default=2000, help="images per dataset")
    p.add_argument("--eps", type=float, default=5.0, help="MNIST costs are ~10-100: eps ~5")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-size", type=float, default=0.5)
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--out", default="otdd_flow")
    p.add_argument("--hold-stats", action="store_true",
                   help="keep the class statistics of the start (default: recompute each step)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    xa, ya = datasets.load(args.source, n=args.n, seed=0)
    xb, yb = datasets.load(args.source + ":rot90", n=args.n, seed=1)
    xa, ya, xb, yb = (t.to(args.device) for t in (xa, ya, xb, yb))
    kw = dict(eps=args.eps, eps_schedule="geomloss", diagonal=xa.shape[1] > 256, max_iter=20000)
    out = dataset_distance(xa, ya, xb, yb, **kw)
    print(f"OTDD({args.source}, {args.source}:rot90) = {float(out.distance):.4f}")
    print("class-to-class mass (%):")
    print((100 * out.class_mass.cpu()).round(decimals=1))
    flow = dataset_flow(xa, ya, xb, yb, steps=args.steps, step_size=args.step_size,
                        recompute_stats=not args.hold_stats, snapshot_every=args.snapshot_every,
                        snapshot_dir=args.out, **kw)  # fmt: skip
    print(f"OTDD along the flow: {[round(d, 4) for d in flow.distances]}")
    print(f"snapshots: {[str(s) for s in flow.snapshots]}")


if __name__ == "__main__":
    main()
