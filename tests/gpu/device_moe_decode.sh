#!/usr/bin/env bash
# MoE decode on one H200 (device tool, kind nvidia-h200), about 3-4 minutes:
#   1. pd_gpu_kernel_check --moe-decode-only: the decode expert path against the host reference
#      (warp-item kernel at depth 4 / 8, SwiGLU fused into down bit for bit against silu_mul, the
#      whole MoE layer on every stream kernel);
#   2. pd_gpu_runner_check --moe-fp8-only: the CUDA runner on small Qwen3-MoE / FP8 configs against
#      the CPU runner (its decode graphs run the default stream kernel);
#   3. pd_gpu_engine_bench --fp8-model qwen3-30b-a3b-fp8 --decode-only 1: decode b1/16/64/128 with
#      the per-stage MoE breakdown and the step on each expert-kernel choice, same process.
#   STEPS (default "moe runner bench") picks and orders the parts; "da", "others" and "fp8moe" run
#   the whole pd_gpu_kernel_check in its three parts (--decode-attention-only, --others-only,
#   --fp8-moe-only), each with its own time limit. BATCHES (default 1,4,16,64,128) for the bench.
# Build and pack here (sm_90, nvcc 13), from the worktree:
#   cmake --build build-cuda -j2 --target pd_gpu_kernel_check pd_gpu_runner_check pd_gpu_engine_bench
#   PACK_OUT=.devcarry-moedecode tests/gpu/pack_for_device.sh build-cuda pd_gpu_kernel_check \
#     pd_gpu_runner_check pd_gpu_engine_bench
#   D=<checkout the device call sends>/.devpack-moedecode; mkdir -p $D
#   tar -cJf $D/carry.tar.xz .devcarry-moedecode && cp tests/gpu/device_moe_decode.sh $D/run.sh
# Device call (carry [".devpack-moedecode"], kind nvidia-h200): bash .devpack-moedecode/run.sh
# Results: $OUT/kernel_check.log, $OUT/runner_check.log, $OUT/bench.log; a summary printed last.
set -uo pipefail
OUT=${OUT:-/tmp/moe_decode}
STEPS=${STEPS:-moe runner bench}
BATCHES=${BATCHES:-1,4,16,64,128}
mkdir -p "$OUT"
D=.devpack-moedecode
tar -xJf "$D/carry.tar.xz"
C=.devcarry-moedecode
export LD_LIBRARY_PATH=$PWD/$C/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=$PWD/$C/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.sm --format=csv,noheader

for s in $STEPS; do
  case $s in
    moe)
      step "kernel checks (MoE decode)"
      timeout 90 "$B/pd_gpu_kernel_check" --moe-decode-only > "$OUT/kernel_check.log" 2>&1
      echo "kernel_check rc=$?" ;;
    runner)
      step "runner check (MoE, FP8)"
      timeout 90 "$B/pd_gpu_runner_check" --moe-fp8-only > "$OUT/runner_check.log" 2>&1
      echo "runner_check rc=$?" ;;
    bench)
      step "Qwen3-30B-A3B-FP8 decode"
      timeout 200 "$B/pd_gpu_engine_bench" --fp8-model qwen3-30b-a3b-fp8 --decode-only 1 --batches "$BATCHES" \
        > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" ;;
    da | others | fp8moe)
      flag=$([ $s = da ] && echo decode-attention || ([ $s = others ] && echo others || echo fp8-moe))
      step "kernel check --$flag-only"
      timeout 200 "$B/pd_gpu_kernel_check" --$flag-only > "$OUT/kernel_check_$s.log" 2>&1
      echo "kernel_check --$flag-only rc=$?" ;;
  esac
done

step "summary"
for f in kernel_check kernel_check_da kernel_check_others kernel_check_fp8moe; do
  [ -f "$OUT/$f.log" ] && echo "--- $f" && grep -E "FAIL|checks," "$OUT/$f.log" | tail -8
done
[ -f "$OUT/runner_check.log" ] && grep -E "failing|FAIL" "$OUT/runner_check.log" | tail -6
if [ -f "$OUT/bench.log" ]; then
  grep -E "^device|step ms|moe stages|^row:" "$OUT/bench.log"
fi
