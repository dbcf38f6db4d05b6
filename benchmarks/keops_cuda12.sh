#!/usr/bin/env bash
# Source before benchmarks/h200_bench.sh to run GeomLoss online (KeOps 2.3) on a CUDA 13
# machine: KeOps' code generation segfaulted there with CUDA 13's NVRTC (v19, v20), so this
# points it at CUDA 12.1's NVRTC and headers from PyPI wheels (the 580 driver runs CUDA 12
# code). Usage: source benchmarks/keops_cuda12.sh DIR, where DIR holds
#   pykeops-2.3 and keopscore-2.3 wheels (pip wheel --no-deps from their sdists) and
#   nvidia_cuda_nvrtc_cu12-12.1.105, nvidia_cuda_runtime_cu12-12.1.105 and
#   nvidia_cuda_cccl_cu12-12.9.27 (pip download; cuda_fp16.h includes CCCL's nv/target,
#   which 12.1's CCCL wheel lacks: only its nv/ folder is taken).
# KeOps finds libraries with ctypes.util.find_library, which asks ldconfig first; a
# sitecustomize on the path answers nvrtc and cudart from the wheels instead.
wheels=${1:-.keops}
cuda=/tmp/keops_cuda12
mkdir -p /tmp/site "$cuda/include" "$cuda/lib"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/keops_wheels "$wheels"/*.whl > /dev/null 2>&1 || echo "could not install $wheels"
cp -r /tmp/keops_wheels/pykeops /tmp/keops_wheels/keopscore /tmp/site/
cp -r /tmp/keops_wheels/nvidia/cuda_cccl/include/nv "$cuda/include/"
for part in cuda_runtime cuda_nvrtc; do
  cp -r /tmp/keops_wheels/nvidia/$part/include/* "$cuda/include/"
  for lib in /tmp/keops_wheels/nvidia/$part/lib/*.so.*; do
    [ -e "$lib" ] || continue
    ln -sf "$lib" "$cuda/lib/$(basename "$lib")"
    ln -sf "$lib" "$cuda/lib/$(basename "$lib" | sed 's/\.so\..*/.so/')"
  done
done
cat > /tmp/site/sitecustomize.py <<'PY'
import ctypes.util
import os

_lib = os.environ.get("KEOPS_CUDA_LIB")
_find = ctypes.util.find_library


def _find_library(name):
    path = os.path.join(_lib or "", f"lib{name}.so")
    return path if _lib and name in ("nvrtc", "cudart") and os.path.exists(path) else _find(name)


ctypes.util.find_library = _find_library
PY
export CUDA_PATH=$cuda KEOPS_CUDA_LIB=$cuda/lib LD_LIBRARY_PATH=$cuda/lib:${LD_LIBRARY_PATH:-}
export KEOPS_CACHE_FOLDER=$PWD/.triton_cache/keops
