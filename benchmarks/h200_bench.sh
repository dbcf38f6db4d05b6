#!/usr/bin/env bash
# flashot bench with the peers on the lent GPU machine (see ../shared/GPU.md for the wheels).
# Usage: bash benchmarks/h200_bench.sh OUT_DIR [flashot bench options...]
# Peer packages go first on the path; their dependencies after the machine's own (the
# machine's jax stack wins where it has one).
set -u
out=$1; shift
main=(flash_sinkhorn geomloss ott_jax jaxopt pot pykeops keopscore)
mkdir -p /tmp/site /tmp/site_deps
for w in .whl/*.whl .keops/*keops*.whl; do
  [ -e "$w" ] || continue
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  target=/tmp/site_deps
  for m in "${main[@]}"; do [ "$name" = "$m" ] && target=/tmp/site; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" "$w" > /dev/null 2>&1 || echo "could not install $w"
done
# KeOps (GeomLoss online), where its wheels were brought (.keops), linked as keops_env.sh says
[ -d .keops ] && source "$(dirname "$0")/keops_env.sh"
export PYTHONPATH=$PWD/src:/tmp/site
export TRITON_CACHE_DIR=$PWD/.triton_cache FLASHOT_CACHE_DIR=$PWD/.triton_cache/flashot
# the peers' Triton autotuning is kept on disk across calls (each shape still tunes once)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys; sys.path.append('/tmp/site_deps'); from flashot.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --out "$out" "$@"
