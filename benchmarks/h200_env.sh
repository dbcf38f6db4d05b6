# Source at the start of a device call (carry [".whl"], and ".keops" for GeomLoss on KeOps):
#   source benchmarks/h200_env.sh
# Installs the peers' wheels (../shared/GPU.md) into /tmp/site, their dependencies into
# /tmp/site_deps (after the machine's own packages: its jax stack wins where it has one),
# points Python at src/ and the repository (the scripts import tests.references), and
# keeps Triton's and flashot's caches inside the (ignored) repo so a warm machine reuses
# them. Every script under benchmarks/ runs with this environment (or, on a CPU,
# PYTHONPATH=src:. python benchmarks/NAME.py).
main=(flash_sinkhorn geomloss ott_jax jaxopt pot pykeops keopscore)
mkdir -p /tmp/site /tmp/site_deps "${OUT:-/tmp/out}"
for w in .whl/*.whl .keops/*keops*.whl; do
  [ -e "$w" ] || continue
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
  target=/tmp/site_deps
  for m in "${main[@]}"; do [ "$name" = "$m" ] && target=/tmp/site; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" "$w" > /dev/null 2>&1 || echo "could not install $w"
done
export PYTHONPATH=$PWD/src:$PWD:/tmp/site:/tmp/site_deps
export TRITON_CACHE_DIR=$PWD/.triton_cache FLASHOT_CACHE_DIR=$PWD/.triton_cache/flashot
# the peers' Triton autotuning is kept on disk across calls (each shape still tunes once)
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1

# KeOps (GeomLoss online), where its wheels were brought (.keops). On the lent machine its
# JIT engine (nvrtc_jit.so) came out linked with a private static libstdc++ and crashed in
# its first ostringstream insert (SIGSEGV at 0x20, every session from v19 to v34, traced
# in v35): KeOps gets (through CXX) a g++ that links the machine's libstdc++.so.6 and keeps
# the CUDA libraries, and a cache folder of its own.
if [ -d .keops ]; then
  kx=/tmp/keops_cxx
  stdcxx=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  if [ -z "$stdcxx" ] || ! command -v g++ > /dev/null; then
    echo "h200_env.sh: no libstdc++.so.6 or g++ found; KeOps left as it is" >&2
  else
    mkdir -p "$kx"
    ln -sf "$stdcxx" "$kx/libstdc++.so"
    printf '#!/bin/sh\nexec %s -L%s -Wl,--no-as-needed "$@"\n' "$(command -v g++)" "$kx" > "$kx/g++"
    chmod +x "$kx/g++"
    export CXX=$kx/g++
  fi
  export KEOPS_CACHE_FOLDER=${KEOPS_CACHE_FOLDER:-/tmp/keops_cache}
fi
