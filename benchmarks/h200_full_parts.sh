#!/usr/bin/env bash
# The --full suite of BENCHMARKS.md in parts that each fit one 10-minute device call;
# `flashot bench --merge OUT/a OUT/b ... --out OUT/full` assembles them (one table, CSV,
# JSON, plots). Usage: bash benchmarks/h200_full_parts.sh PART OUT [OPTIONS]
# (PART: a … h, c2, c3, k).
# a, b: every peer at n ≤ 50k (d 3/64, then 512/1024); c: n 200k, 1M for flashot; c2, c3:
# the peer that streams at 200k, then 1M; d: HVP and time-to-tolerance; e: the largest n
# per provider in 60 s; k: GeomLoss on KeOps beside flashot at 10k/50k;
# f: the fast modes beside the default at n ≤ 50k; g: time to a marginal error of 1e-5 (its
# own settings: --merge keeps it apart from d's 1e-3); h: the core grid (10k/50k × d64/512),
# flashot, flash-sinkhorn, OTT online and dense and GeomLoss-KeOps in one process.
# Each row is written as it finishes and a part runs with --resume: a call cut by its
# timeout keeps its rows, and the same command in the next call runs only the missing ones
# (part a took over 520 s in v27; cut at its last rows). --row-budget (30 s) skips sizes
# a provider's previous size predicts too slow.
# On the lent machine use OUT=.bench_out (ignored): pass it in the call's carry so a fresh
# machine resumes too, and copy it to $OUT at the end of each call to bring it back
# (then commit the rows to results/h200_full/PART, which seeds an OUT without them).
set -u
part=$1 out=$2
gpu_peers=flashot-triton,flash-sinkhorn,ott-online,ott-dense,geomloss-tensorized,geomloss-online,dense-torch,pot
case $part in
  a) args=(--sizes 1000,10000,50000 --dims 3,64 --providers $gpu_peers) ;;
  b) args=(--sizes 1000,10000,50000 --dims 512,1024 --providers $gpu_peers) ;;
  # (c2, the peer, into c's folder after flashot's rows: its first call at each size
  # autotunes for minutes, which cut part c at 1M d3 in v30 and v32)
  c) args=(--sizes 200000,1000000 --dims 3,64,512 --providers flashot-triton) ;;
  # (its 1M d3 first call did not finish in 420 s in v34: c3 apart, after c2's 200k rows)
  c2) args=(--sizes 200000 --dims 3,64,512 --providers flash-sinkhorn) ;;
  c3) args=(--sizes 1000000 --dims 3,64,512 --providers flash-sinkhorn) ;;
  d) args=(--workloads hvp,converge --sizes 10000,50000 --dims 64
           --providers flashot-triton,flash-sinkhorn,ott-online) ;;
  e) args=(--sizes 10000 --dims 64 --largest 60 --no-floor
           --providers flashot-triton,flash-sinkhorn,ott-online,geomloss-tensorized) ;;
  f) args=(--sizes 10000,50000 --dims 64,512
           --providers flashot-triton,flashot-triton-tf32,flashot-triton-bf16) ;;
  g) args=(--workloads converge --tol 1e-5 --sizes 10000,50000 --dims 64
           --providers flashot-triton,ott-online,pot) ;;
  # k: GeomLoss on KeOps beside flashot (KeOps needs .keops: see h200_env.sh)
  k) args=(--sizes 10000,50000 --dims 64,512 --providers flashot-triton,geomloss-online) ;;
  # h: run it twice on one machine (the first into a scratch OUT) so that the measured
  # process meets warm caches (the peer's autotuning, KeOps' formulas): one run with the
  # caches cold took over 560 s; the budget admits KeOps' 50k d512 gradient (62 s a call)
  h) args=(--sizes 10000,50000 --dims 64,512 --row-budget 200
           --providers flashot-triton,flash-sinkhorn,ott-online,ott-dense,geomloss-online) ;;
  *) echo "PART: one of a b c c2 c3 d e f g h k" >&2; exit 2 ;;
esac
[ "$part" = c2 ] || [ "$part" = c3 ] && part=c
# rows committed from an earlier session (results/h200_full/PART) seed a fresh OUT
saved="$(dirname "$0")/results/h200_full/$part"
if [ ! -e "$out/$part/bench.csv" ] && [ -e "$saved/bench.csv" ]; then
  mkdir -p "$out" && cp -r "$saved" "$out/" && chmod -R u+w "$out/$part"
fi
# OPTIONS go to flashot bench after the part's own: --row-budget 150 in a resumed part runs
# the rows its 30 s budget skipped (k: KeOps' 50k d512 gradient, 81 s predicted from 10k,
# where KeOps is far from full: its forward grew 8.9x from 10k to 50k, not 25x)
source "$(dirname "$0")/h200_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
exec python3 -m flashot.cli bench --out "$out/$part" --resume "${args[@]}" "${@:3}"
