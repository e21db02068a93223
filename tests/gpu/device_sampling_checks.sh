#!/usr/bin/env bash
# The CUDA runner's sampling rows against engine::sample_step_token (the CPU sampler) and its
# prompt logprobs against the fp32 CPU runner, on one H200 (kind nvidia-h200):
#   penalties (presence, frequency, repetition), logit_bias, allowed_token_ids, bad_words,
#   min_tokens suppression (the GPU kernel's short list and the host's long one), seeded
#   temperature / min-p rows, and prompt logprobs in one step and across prefill chunks.
# Build with CUDA and pack (on the build machine):
#   cmake --build build-cuda -j2 --target pd_gpu_runner_check
#   tests/gpu/pack_for_device.sh build-cuda pd_gpu_runner_check
# then run this script from the repository root with .devcarry carried to the device.
# Output: $OUT/sampling_check.log; exit status that of the check (0 = every row passed).
set -uo pipefail
OUT=${OUT:-/tmp/sampling_checks}
mkdir -p "$OUT"
[ -f .devpack/carry.tar.xz ] && tar -xJf .devpack/carry.tar.xz
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
timeout 300 .devcarry/bin/pd_gpu_runner_check --sampling-only > "$OUT/sampling_check.log" 2>&1
rc=$?
cat "$OUT/sampling_check.log"
echo "sampling check rc=$rc"
exit $rc
