#!/usr/bin/env bash
# One-H200 measurements for P/D engine scheduling (kind nvidia-h200), in two parts (one run each):
#   part "sweep": pd_gpu_engine_bench --pd-sweep 1 on the Qwen3-32B and Qwen3-8B shapes (dummy weights):
#                 producer prefill step time and throughput for token budgets 512..16384 at prompt
#                 lengths 2,048 and 8,192; mixed steps (16 decode rows + one prefill chunk of 64..512
#                 tokens) at 2,048- and 8,192-token contexts; the first-token path's two steps
#                 (producer whole-prompt step, consumer first decode step). Sets the producer role's
#                 default budget (kProducerMaxNumBatchedTokens, src/server/server_config.h) and the
#                 capacity model's chunk costs (docs/perf/engine.md, "P/D engine sweep").
#   part "ttft":  the first-token path end to end on one GPU (producer and consumer at 0.4 of it,
#                 WRITE and READ modes, first-token hand-over on), Qwen3-8B shape, ISL 2000: one request at a
#                 time (no step in flight on the consumer), then 8 at a time with 256-token outputs
#                 (the consumer is mid-step whenever a first token arrives); collocated beside each.
# Needs .devpack/carry.tar.xz holding .devcarry (pdserve, pdrouter, pd_gpu_engine_bench:
# tests/gpu/pack_for_device.sh build-cuda pdserve pdrouter pd_gpu_engine_bench).
# Results go to $OUT (logs + JSON); a short table is printed last.
set -uo pipefail
PART=${1:?usage: device_pd_engine_measure.sh sweep|ttft}
OUT=${OUT:-/tmp/pd_engine_measure}
mkdir -p "$OUT"
[ -f .devpack/carry.tar.xz ] && tar -xJf .devpack/carry.tar.xz
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
B=$PWD/.devcarry/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

if [ "$PART" = sweep ]; then
  for model in qwen3-32b qwen3-8b; do
    step "sweep $model"
    timeout 280 "$B/pd_gpu_engine_bench" --pd-sweep 1 --model $model --sweep-decode-batch 16 \
      > "$OUT/sweep_$model.log" 2>&1
    echo "sweep $model rc=$?"
    grep -E "^(device|Qwen3|1\.|2\.|3\.|  prefill|  mixed|  first-token)" "$OUT/sweep_$model.log"
  done
  exit 0
fi

if [ "$PART" = ttft ]; then
  serve="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.4"
  for load in "c1:1:10:32" "c8:8:40:256"; do
    IFS=: read -r lname conc num olen <<< "$load"
    for cfg in collocated pd-write pd-read; do
      name=${cfg}_$lname
      step "ttft $name"
      gpus=(--gpus 0); [ $cfg = collocated ] && gpus=(--gpus 0 --num-collocated 1)
      timeout 280 python3 tools/pdbench/deploy.py --config $cfg --device cuda "${gpus[@]}" --bin-dir "$B" \
        --model tests/gpu/models/qwen3-8b-shape --log-dir "$OUT/logs_$name" --serve-args "$serve" -- \
        python3 tools/pdbench/pdbench.py run --base-url {url} --max-concurrency "$conc" --num-requests "$num" \
          --warmup-requests 2 --input-len 2000 --output-len "$olen" --label "$name" --save-requests \
          --json-out "$OUT/ttft_$name.json" > "$OUT/ttft_$name.log" 2>&1
      echo "ttft $name rc=$?"; grep -E "deploy\]" "$OUT/ttft_$name.log" | tail -2
    done
  done
  step "summary"
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'run':22} {'TTFT p50':>9} {'p90':>8} {'mean':>8} {'TPOT p50':>9}")
for name in ("collocated_c1", "pd-write_c1", "pd-read_c1", "collocated_c8", "pd-write_c8", "pd-read_c8"):
    try:
        r = json.load(open(os.path.join(out, f"ttft_{name}.json")))["runs"][0]
    except Exception as e:
        print(name, "missing:", e)
        continue
    t = r["ttft_ms"]
    print(f"{name:22} {t['p50']:9.1f} {t.get('p90', float('nan')):8.1f} {t['mean']:8.1f} {r['tpot_ms']['p50']:9.2f}")
PY
  exit 0
fi
echo "unknown part $PART"; exit 2
