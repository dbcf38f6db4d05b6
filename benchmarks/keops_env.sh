#!/usr/bin/env bash
# Source before running GeomLoss online (KeOps 2.3) on the lent machine; h200_bench.sh does
# where .keops holds the pykeops and keopscore 2.3 wheels (built from their sdists with
# `pip wheel --no-deps`, ../shared/GPU.md).
# Why: there KeOps' JIT engine (nvrtc_jit.so) came out linked with a private static
# libstdc++ (1.9 MB; ldd lists no libstdc++.so.6, nor libcuda or libnvrtc, which its
# command gives before the source under --as-needed), and it crashed in its first
# ostringstream insert: SIGSEGV at address 0x20 in every session from v19 to v34, with
# CUDA 13's NVRTC and with 12.1's. Traced in v35 with benchmarks/segv_trace.c.
# This points KeOps (through CXX) at a g++ that links the machine's libstdc++.so.6 and
# keeps the CUDA libraries, and gives KeOps a cache folder of its own (not its default one,
# which may hold an engine built without this g++).
kx=/tmp/keops_cxx
stdcxx=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
if [ -z "$stdcxx" ] || ! command -v g++ > /dev/null; then
  echo "keops_env.sh: no libstdc++.so.6 or g++ found; KeOps left as it is" >&2
else
  mkdir -p "$kx"
  ln -sf "$stdcxx" "$kx/libstdc++.so"
  printf '#!/bin/sh\nexec %s -L%s -Wl,--no-as-needed "$@"\n' "$(command -v g++)" "$kx" > "$kx/g++"
  chmod +x "$kx/g++"
  export CXX=$kx/g++
fi
export KEOPS_CACHE_FOLDER=${KEOPS_CACHE_FOLDER:-/tmp/keops_cache}
