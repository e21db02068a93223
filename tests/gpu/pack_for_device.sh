#!/usr/bin/env bash
# Packs built binaries for a run on the GPU machine: stripped copies of the
# named programs from build/bin plus every shared library they need that is not
# the C runtime or CUDA (the GPU machine has its own glibc and CUDA 13), into
# .devcarry/bin and .devcarry/lib (ignored by git). UCX transport modules come
# too (UCX loads them at run time). On the GPU machine:
#   export LD_LIBRARY_PATH=$PWD/.devcarry/lib:$LD_LIBRARY_PATH UCX_MODULE_DIR=$PWD/.devcarry/lib/ucx
# Usage: [PACK_OUT=dir] tests/gpu/pack_for_device.sh [build dir] program...
# PACK_OUT (default .devcarry) lets two people pack from one checkout at once.
set -euo pipefail
build=${1:-build}
shift || true
programs=("$@")
[ ${#programs[@]} -gt 0 ] || programs=(pdserve pdrouter xferbench pd_gpu_kernel_check pd_gpu_engine_bench)
out=${PACK_OUT:-.devcarry}
rm -rf "$out/bin" "$out/lib"
mkdir -p "$out/bin" "$out/lib/ucx"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libresolv\.so|libgcc_s\.so|libcuda\.so|libcudart\.so|libcublas|libcublasLt)'
for p in "${programs[@]}"; do
  strip -o "$out/bin/$p" "$build/bin/$p"
  ldd "$build/bin/$p" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [ -e "$out/lib/$name" ] || cp -L "$path" "$out/lib/$name"
  done
done
if [ -d /usr/lib/x86_64-linux-gnu/ucx ]; then
  cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so* "$out/lib/ucx/" 2>/dev/null || true
  cp -L /usr/lib/x86_64-linux-gnu/ucx/libucx_perftest*.so* "$out/lib/ucx/" 2>/dev/null || true
fi
strip --strip-unneeded "$out"/lib/*.so* "$out"/lib/ucx/*.so* 2>/dev/null || true
du -sh "$out"
