#!/usr/bin/env bash
# The grouped FP8 MoE prefill GEMM on one H200 (device tool, kind nvidia-h200), about 4 minutes:
#   1. pd_gpu_kernel_check --fp8-moe-only: every FP8 / MoE kernel against the host reference,
#      the grouped GEMM (grouped_fp8_gemm_*: empty groups, sizes off the tile multiples, compacted
#      weight scales, gathered and silu-fused inputs) and the MoE layer on its grouped path;
#   2. pd_gpu_runner_check --moe-fp8-only: the CUDA runner (prefill on the grouped path) on small
#      Qwen3-MoE / block-FP8 configs against the CPU runner;
#   3. pd_gpu_engine_bench --fp8-model qwen3-30b-a3b-fp8, then the Qwen3-235B-A22B-FP8 shape with
#      16 layers (decode b1 only): prefill 1 x / 8 x 2,000 on the grouped and the per-expert path,
#      against the FP8 GEMM rate measured in the same process.
# Build and pack here (sm_90, nvcc 13, CUTLASS headers from pip's nvidia-cutlass):
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSERVE_CUDA=ON -DPDSERVE_CUDA_ARCHS=90
#   cmake --build build-cuda -j2 --target pd_gpu_kernel_check pd_gpu_engine_bench pd_gpu_runner_check
#   PACK_OUT=.devcarry-grouped tests/gpu/pack_for_device.sh build-cuda pd_gpu_kernel_check pd_gpu_engine_bench \
#     pd_gpu_runner_check
#   mkdir -p .devpack-grouped && tar -cJf .devpack-grouped/carry.tar.xz .devcarry-grouped \
#     && cp tests/gpu/device_moe_grouped_checks.sh .devpack-grouped/
# Device call (carry [".devpack-grouped"], kind nvidia-h200, timeout 400):
#   bash .devpack-grouped/device_moe_grouped_checks.sh
# Results: $OUT/kernel_check.log, $OUT/runner_check.log, $OUT/bench_<model>.log, a summary printed last.
set -uo pipefail
OUT=${OUT:-/tmp/moe_grouped_checks}
mkdir -p "$OUT"
[ -f .devpack-grouped/carry.tar.xz ] && tar -xJf .devpack-grouped/carry.tar.xz
C=${CARRY_DIR:-.devcarry-grouped}
export LD_LIBRARY_PATH=$PWD/$C/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$PWD/$C/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

step "1. kernel checks (FP8 / MoE, grouped GEMM)"
timeout 120 "$B/pd_gpu_kernel_check" --fp8-moe-only --progress > "$OUT/kernel_check.log" 2>&1
echo "kernel_check rc=$?"
grep -E "grouped|FAIL|checks," "$OUT/kernel_check.log" | tail -25

step "2. runner check (MoE, FP8)"
timeout 60 "$B/pd_gpu_runner_check" --moe-fp8-only > "$OUT/runner_check.log" 2>&1
echo "runner_check rc=$?"
grep -E "FAIL|failing" "$OUT/runner_check.log" | tail -8

step "3. Qwen3-30B-A3B-FP8"
timeout 120 "$B/pd_gpu_engine_bench" --fp8-model qwen3-30b-a3b-fp8 --batches 1 --kv-fp8-batch 0 \
  > "$OUT/bench_qwen3-30b-a3b-fp8.log" 2>&1
echo "bench 30b-a3b rc=$?"

step "4. Qwen3-235B-A22B-FP8 (16 layers)"
timeout 90 "$B/pd_gpu_engine_bench" --fp8-model qwen3-235b-a22b-fp8 --layers 16 --batches 1 --kv-fp8-batch 0 \
  > "$OUT/bench_qwen3-235b-a22b-fp8.log" 2>&1
echo "bench 235b rc=$?"

step "summary"
grep -E "checks,|FAIL" "$OUT/kernel_check.log" | tail -20
grep -E "^variant|failing" "$OUT/runner_check.log"
for m in qwen3-30b-a3b-fp8 qwen3-235b-a22b-fp8; do
  echo "--- $m"
  grep -E "^FP8 GEMM|fallback" "$OUT/bench_$m.log" | head -4
  grep -E "^row:.*prefill" "$OUT/bench_$m.log"
done
