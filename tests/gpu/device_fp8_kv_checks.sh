#!/usr/bin/env bash
# FP8 KV cache, MoE / FP8 checks and the FP8 decode timings on one H200 (device tool, kind
# nvidia-h200), about 3 minutes:
#   1. pd_gpu_kernel_check (all checks): every kernel against the host reference, among them
#      FP8-KV decode attention on tensor cores and on CUDA cores, decode attention at GQA 16 / 12
#      (bf16 and FP8 KV), prefill at GQA 16, the FP8 GEMM tuner with the CUDA-core streaming
#      candidate at M <= 4;
#   2. pd_gpu_runner_check --fp8-kv-only: the CUDA runner with --kv-cache-dtype fp8 against the CPU
#      runner's FP8 KV (Qwen3 D128 graphs, D64 eager, Qwen3-MoE FP8), and the FP8-KV prefill
#      staging in groups bit for bit against the bf16 prefill kernel;
#   3. pd_gpu_runner_check --moe-fp8-only: MoE (top 4 and every expert routed) and FP8 weights,
#      the FP8 rows also against the dequantized-weight reference;
#   4. pd_gpu_engine_bench --fp8-model qwen3-32b-fp8 / qwen3-30b-a3b-fp8 / qwen3-235b-a22b-fp8
#      --layers 16 (decode b1/16/64/128 and the b64 step with FP8 KV beside bf16 KV; prefill
#      1 x / 8 x 2,000).
# Build and pack here (sm_90, nvcc 13):
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSERVE_CUDA=ON -DPDSERVE_CUDA_ARCHS=90
#   cmake --build build-cuda -j2 --target pd_gpu_kernel_check pd_gpu_engine_bench pd_gpu_runner_check
#   PACK_OUT=.devcarry-kv tests/gpu/pack_for_device.sh build-cuda pd_gpu_kernel_check pd_gpu_engine_bench \
#     pd_gpu_runner_check
#   mkdir -p .devpack-kv && tar -cJf .devpack-kv/carry.tar.xz .devcarry-kv
# Device call (carry [".devpack-kv"], kind nvidia-h200, timeout 600):
#   bash tests/gpu/device_fp8_kv_checks.sh
# Results: $OUT/*.log, a summary printed last.
set -uo pipefail
OUT=${OUT:-/tmp/fp8_kv_checks}
mkdir -p "$OUT"
[ -f .devpack-kv/carry.tar.xz ] && tar -xJf .devpack-kv/carry.tar.xz
C=${CARRY_DIR:-.devcarry-kv}
export LD_LIBRARY_PATH=$PWD/$C/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$PWD/$C/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

step "1. kernel checks (all)"
timeout 240 "$B/pd_gpu_kernel_check" > "$OUT/kernel_check.log" 2>&1
echo "kernel_check rc=$?"
step "2. runner check (FP8 KV)"
timeout 60 "$B/pd_gpu_runner_check" --fp8-kv-only > "$OUT/runner_check_kv.log" 2>&1
echo "runner_check fp8 kv rc=$?"
step "3. runner check (MoE, FP8 weights)"
timeout 90 "$B/pd_gpu_runner_check" --moe-fp8-only > "$OUT/runner_check_moe.log" 2>&1
echo "runner_check moe/fp8 rc=$?"
for m in qwen3-32b-fp8 qwen3-30b-a3b-fp8 qwen3-235b-a22b-fp8; do
  step "4. $m"
  timeout 150 "$B/pd_gpu_engine_bench" --fp8-model $m --layers $([ $m = qwen3-235b-a22b-fp8 ] && echo 16 || echo 0) \
    > "$OUT/bench_$m.log" 2>&1
  echo "bench $m rc=$?"
done

step "summary"
grep -E "FAIL|checks," "$OUT/kernel_check.log" | tail -16
grep -E "FAIL|failing|staging" "$OUT/runner_check_kv.log" | tail -12
grep -E "^variant|failing" "$OUT/runner_check_moe.log"
for m in qwen3-32b-fp8 qwen3-30b-a3b-fp8 qwen3-235b-a22b-fp8; do
  echo "--- $m"
  grep -E "^FP8 GEMM|^device" "$OUT/bench_$m.log" | head -3
  grep -E "^row:" "$OUT/bench_$m.log"
done
