# Source at the start of a device call (carry [".whl"]): the peer wheel, flashot from
# src/, Triton's and flashot's caches inside the (ignored) repo so a warm machine reuses them.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:$PWD:/tmp/site TRITON_CACHE_DIR=$PWD/.triton_cache \
  FLASHOT_CACHE_DIR=$PWD/.triton_cache/flashot PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
mkdir -p "${OUT:-/tmp/out}"
