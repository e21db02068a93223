#!/usr/bin/env bash
# Tensor parallelism on the CUDA runner, on one H200 (kind nvidia-h200; every TP 2 part runs too
# when two GPUs are visible, kind nvidia-h200-x2). Two device calls (each well inside 600 s):
#   bash tests/gpu/device_tp_checks.sh checks   # parts 1, 2, 4 and 5
#   bash tests/gpu/device_tp_checks.sh bench    # part 3
# (no argument: all five in one call, for a longer limit).
#   1. pd_gpu_tp_check: NCCL all-reduce / all-gather (eager and from a replayed graph) over every
#      visible rank count; CudaTpRunner at TP 1 (and TP 2) on small dense / Qwen2 / MoE / FP8 models
#      against the CPU runner, TP 2 tokens against TP 1, GPU-generated weights at TP 2 against TP 1,
#      and the refusal of more ranks than GPUs;
#   2. pd_gpu_runner_check and pd_gpu_gemm_plan_check: the single-GPU runner checks, now loading
#      through the rank-slicing path at TP 1;
#   3. pd_gpu_engine_bench: the decode table of docs/perf/engine.md (Qwen3-8B b1/16/64/128 and
#      prefill, Qwen3-32B decode b1/16/64) at TP 1, to compare with the table's rows;
#   4. pdserve --device cuda --load-format dummy on an 8-layer Qwen3-32B shape at TP 1 (and TP 2):
#      56 greedy token-id prompts through tests/gpu/pd_equality.py, TP 2 compared with TP 1 (a first
#      difference must sit at a bf16 tie of TP 1's top-2 logprobs);
#   5. pd_gpu_kernel_check: the kernels the runner calls (unchanged by this path; run last).
# Build and pack here (sm_90, nvcc 13):
#   cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSERVE_CUDA=ON -DPDSERVE_CUDA_ARCHS=90
#   cmake --build build-cuda -j2 --target pd_gpu_tp_check pd_gpu_runner_check pd_gpu_gemm_plan_check \
#     pd_gpu_kernel_check pd_gpu_engine_bench pdserve
#   PACK_OUT=.devcarry-tp tests/gpu/pack_for_device.sh build-cuda pd_gpu_tp_check pd_gpu_runner_check \
#     pd_gpu_gemm_plan_check pd_gpu_kernel_check pd_gpu_engine_bench pdserve
#   mkdir -p .devpack-tp && tar -cJf .devpack-tp/carry.tar.xz .devcarry-tp
# Device calls (carry [".devpack-tp"], kind nvidia-h200 or nvidia-h200-x2, timeout 600): see above.
# NCCL: libnccl.so.2 from LD_LIBRARY_PATH (PyTorch's site-packages/nvidia/nccl/lib on the GPU
# machine; found through python3 when it is not on the path). pdserve at TP 1 never loads it;
# pd_gpu_tp_check's collective check uses it even with one GPU.
# Results: $OUT/*.log, a summary printed last.
set -uo pipefail
STAGE=${1:-all}
want() { [ "$STAGE" = all ] || [ "$STAGE" = "$1" ]; }
OUT=${OUT:-/tmp/tp_checks}
mkdir -p "$OUT"
[ -f .devpack-tp/carry.tar.xz ] && tar -xJf .devpack-tp/carry.tar.xz
C=${CARRY_DIR:-.devcarry-tp}
export LD_LIBRARY_PATH=$PWD/$C/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nccl_on_path() {
  local d
  for d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$d/libnccl.so.2" ] && { echo "$d"; return 0; }; done
  ldconfig -p 2>/dev/null | grep -m1 libnccl.so.2 && return 0
  return 1
}
if ! nccl_on_path > /dev/null; then
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
  [ -n "$nccl_dir" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl_dir
fi
B=$PWD/$C/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
NGPU=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
echo "GPUs: $NGPU; libnccl.so.2: $(nccl_on_path || echo 'not found (TP > 1 will refuse to start)')"

if want checks; then
step "1. tp check"
timeout 180 "$B/pd_gpu_tp_check" > "$OUT/tp_check.log" 2>&1
echo "tp_check rc=$?"
grep -E "FAIL|nccl|refused|skipped|failing" "$OUT/tp_check.log" | tail -20

step "2. runner check, gemm plan check (TP 1)"
timeout 90 "$B/pd_gpu_runner_check" > "$OUT/runner_check.log" 2>&1
echo "runner_check rc=$?"
grep -E "FAIL|failing" "$OUT/runner_check.log" | tail -8
timeout 45 "$B/pd_gpu_gemm_plan_check" > "$OUT/gemm_plan_check.log" 2>&1
echo "gemm_plan_check rc=$?"
tail -2 "$OUT/gemm_plan_check.log"
fi

if want bench; then
step "3. decode table (docs/perf/engine.md), TP 1"
timeout 200 "$B/pd_gpu_engine_bench" --model qwen3-8b > "$OUT/bench_qwen3-8b.log" 2>&1
echo "bench 8b rc=$?"
timeout 150 "$B/pd_gpu_engine_bench" --model qwen3-32b --decode-only 1 > "$OUT/bench_qwen3-32b.log" 2>&1
echo "bench 32b rc=$?"
fi

if want checks; then
step "4. pdserve at TP 1$([ "$NGPU" -ge 2 ] && echo " and TP 2")"
MODEL=/tmp/tp_model
mkdir -p $MODEL
python3 - tests/gpu/models/qwen3-32b-shape/config.json $MODEL/config.json <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["num_hidden_layers"] = 8
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
serve_and_run() {  # tp port
  local tp=$1 port=$2
  "$B/pdserve" --model $MODEL --load-format dummy --device cuda --cuda-device 0 --tensor-parallel-size "$tp" \
    --max-model-len 2048 --gpu-memory-utilization 0.5 --port "$port" > "$OUT/pdserve_tp$tp.log" 2>&1 &
  local pid=$!
  local up=0
  for _ in $(seq 1 120); do
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/v1/models', timeout=2)" \
      2> /dev/null; then up=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if [ $up = 1 ]; then
    timeout 180 python3 tests/gpu/pd_equality.py run --url "http://127.0.0.1:$port" --out "$OUT/serve_tp$tp.json" \
      --max-tokens 16 --concurrency 16 > "$OUT/serve_tp$tp.run.log" 2>&1
    echo "pdserve TP $tp: run rc=$?"; tail -2 "$OUT/serve_tp$tp.run.log"
  else
    echo "pdserve TP $tp: did not come up"; tail -5 "$OUT/pdserve_tp$tp.log"
  fi
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  grep -E "tensor_parallel_size|nccl|decode buckets" "$OUT/pdserve_tp$tp.log" | head -4
}
serve_and_run 1 18431
if [ "$NGPU" -ge 2 ]; then
  serve_and_run 2 18432
  python3 tests/gpu/pd_equality.py compare "$OUT/serve_tp1.json" "$OUT/serve_tp2.json" > "$OUT/serve_compare.txt" 2>&1
  echo "TP 2 vs TP 1 compare rc=$?"
fi

step "5. kernel check (the kernels the runner calls; last: the longest)"
timeout 150 "$B/pd_gpu_kernel_check" > "$OUT/kernel_check.log" 2>&1
echo "kernel_check rc=$?"
grep -E "FAIL|checks," "$OUT/kernel_check.log" | tail -8
fi

step "summary"
if want checks; then
  grep -E "nccl|refused|skipped|tp check" "$OUT/tp_check.log"
  grep -cE " PASS$" "$OUT/tp_check.log" | sed 's/^/tp_check passing rows: /'
  grep -E "runner check" "$OUT/runner_check.log"
  tail -1 "$OUT/gemm_plan_check.log"
  grep -E "checks," "$OUT/kernel_check.log" | tail -1
  [ -f "$OUT/serve_compare.txt" ] && cat "$OUT/serve_compare.txt"
fi
if want bench; then
  for m in qwen3-8b qwen3-32b; do
    echo "--- $m"
    tail -14 "$OUT/bench_$m.log"
  done
fi
true
