"""One entropic OT problem sharded over the ranks of a torchrun job (flashot.distributed).
=======================================================================================

Each rank draws its own slice of two clouds (rows split evenly), solves the global
problem with ``flashot.distributed.sinkhorn``, and rank 0 prints the global cost, the
iterations and the time. GPUs use NCCL (one GPU per rank), CPUs gloo.

One host, two GPUs::

    torchrun --nproc-per-node 2 examples/distributed_sinkhorn.py --points 1000000 --dim 64

Two hosts (run on each, with the first host's address)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 examples/distributed_sinkhorn.py --points 4000000

Without torchrun it runs as a one-rank job (gloo), which is how the tests call it.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

from flashot import distributed


def main(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument("--points", type=int, default=20_000,
                   help="points per cloud, all ranks together")
    p.add_argument("--dim", type=int, default=16, help="feature dimension")
    p.add_argument("--eps", type=float, default=0.1, help="entropic regularization")
    p.add_argument("--iters", type=int, default=10, help="fixed iterations (tol=None)")
    p.add_argument("--mode", default="auto", choices=["auto", "gather", "ring"],
                   help="gather the other cloud once, or pass shards around the ring")
    p.add_argument("--precision", default="auto", help="flashot precision mode")
    args = p.parse_args(argv)

    owned = not dist.is_initialized()
    if owned:
        cuda = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
        if "RANK" not in os.environ:  # a one-rank job without torchrun
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    try:
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own rows
        n_local = args.points // world + (rank < args.points % world)
        x = torch.randn(n_local, args.dim, generator=gen).to(device) / args.dim**0.5
        y = (torch.randn(n_local, args.dim, generator=gen) / args.dim**0.5 + 0.2).to(device)
        dist.barrier()
        t0 = time.perf_counter()
        res = distributed.sinkhorn(x, y, eps=args.eps, tol=None, max_iter=args.iters,
                                   mode=args.mode, precision=args.precision)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if rank == 0:
            print(f"{world} rank(s), n = m = {args.points}, d = {args.dim}, {res.n_iter} "
                  f"iterations: cost {float(res.cost):.6f}, {seconds:.3f} s")  # fmt: skip
        return res
    finally:
        if owned:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
