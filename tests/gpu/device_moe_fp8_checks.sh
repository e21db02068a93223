#!/usr/bin/env bash
# FP8 and MoE checks and timings on one H200 (device tool, kind nvidia-h200), about 8 minutes:
#   1. pd_gpu_kernel_check --fp8-moe-only: every FP8 / MoE kernel against the host reference
#      (quantization, FP8 GEMM through cuBLASLt's block-scaled mode and the streaming kernel,
#      router, expert sort, combine, grouped streaming GEMM, whole MoE layer both paths, the FP8
#      KV write, decode attention over FP8 KV and the FP8 -> bf16 block staging for prefill, and a
#      probe of cuBLASLt's block-scale layouts);
#   2. pd_gpu_runner_check --moe-fp8-only: the CUDA runner on small Qwen3-MoE (bf16 and FP8 experts,
#      graphs on and off) and block-FP8 Qwen3 configs against the CPU runner, step by step;
#   3. pd_gpu_engine_bench --fp8-model ...: the FP8 GEMM rate beside the bf16 rate, then
#      kernel-level forward passes (decode = one CUDA graph per step) against their floors:
#      Qwen3-30B-A3B-FP8 decode b1/16/64/128 at 2,048-token contexts (floor counts the distinct
#      experts routed per layer) and prefill 1x2000 / 8x2000 against the FP8 GEMM rate;
#      Qwen3-32B-FP8 decode b1/16/64 and prefill; Qwen3-235B-A22B-FP8 layer shapes, 16 layers;
#      each with one more b64 decode step whose KV cache is FP8 (beside the bf16-KV b64 row).
# Build and pack here (sm_90, nvcc 13):
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSERVE_CUDA=ON -DPDSERVE_CUDA_ARCHS=90
#   cmake --build build-cuda -j2 --target pd_gpu_kernel_check pd_gpu_engine_bench pd_gpu_runner_check
#   PACK_OUT=.devcarry-moe tests/gpu/pack_for_device.sh build-cuda pd_gpu_kernel_check pd_gpu_engine_bench \
#     pd_gpu_runner_check
#   mkdir -p .devpack-moe && tar -cJf .devpack-moe/carry.tar.xz .devcarry-moe
# Device call (carry [".devpack-moe"], kind nvidia-h200, timeout 600):
#   bash tests/gpu/device_moe_fp8_checks.sh
# Results: $OUT/kernel_check.log, $OUT/runner_check.log, $OUT/bench_<model>.log, a summary printed last.
set -uo pipefail
OUT=${OUT:-/tmp/moe_fp8_checks}
mkdir -p "$OUT"
[ -f .devpack-moe/carry.tar.xz ] && tar -xJf .devpack-moe/carry.tar.xz
C=${CARRY_DIR:-.devcarry-moe}
export LD_LIBRARY_PATH=$PWD/$C/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$PWD/$C/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

step "1. kernel checks (FP8 / MoE)"
timeout 120 "$B/pd_gpu_kernel_check" --fp8-moe-only > "$OUT/kernel_check.log" 2>&1
echo "kernel_check rc=$?"
grep -E "FAIL|checks," "$OUT/kernel_check.log" | tail -15

step "2. runner check (MoE, FP8)"
timeout 50 "$B/pd_gpu_runner_check" --moe-fp8-only > "$OUT/runner_check.log" 2>&1
echo "runner_check rc=$?"
grep -E "FAIL|failing" "$OUT/runner_check.log" | tail -8

step "3. Qwen3-30B-A3B-FP8"
timeout 150 "$B/pd_gpu_engine_bench" --fp8-model qwen3-30b-a3b-fp8 > "$OUT/bench_qwen3-30b-a3b-fp8.log" 2>&1
echo "bench 30b-a3b rc=$?"

step "4. Qwen3-32B-FP8"
timeout 100 "$B/pd_gpu_engine_bench" --fp8-model qwen3-32b-fp8 > "$OUT/bench_qwen3-32b-fp8.log" 2>&1
echo "bench 32b rc=$?"

step "5. Qwen3-235B-A22B-FP8 (16 layers)"
timeout 70 "$B/pd_gpu_engine_bench" --fp8-model qwen3-235b-a22b-fp8 --layers 16 \
  > "$OUT/bench_qwen3-235b-a22b-fp8.log" 2>&1
echo "bench 235b rc=$?"

step "summary"
grep -E "checks,|FAIL" "$OUT/kernel_check.log" | tail -20
grep -E "^variant|failing" "$OUT/runner_check.log"
for m in qwen3-30b-a3b-fp8 qwen3-32b-fp8 qwen3-235b-a22b-fp8; do
  echo "--- $m"
  grep -E "^FP8 GEMM|^  [0-9]|fallback" "$OUT/bench_$m.log" | head -6
  grep -E "^row:" "$OUT/bench_$m.log"
  tail -2 "$OUT/bench_$m.log" | grep -v "^row:\|^qwen3\|^step" || true
done
