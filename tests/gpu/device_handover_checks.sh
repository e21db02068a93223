#!/usr/bin/env bash
# Checks on a 2xH200 machine (kind nvidia-h200-x2) of the first-token hand-over and the ucx GPU
# staging, in two parts (one run each):
#   part "xfer-eq": xferbench cuda --compare (KV one batch / layer by layer, docs/perf/xfer.md); the
#                   ucx GPU-staging check (tests/gpu/xfer_ucx_staging_check.sh); P/D (WRITE, READ, both
#                   with the hand-over) vs collocated output on the ~1B model (pd_equality.py).
#   part "ttft":    TTFT at low load (one request at a time), Qwen3-32B shape, ISL 2000: collocated,
#                   WRITE and READ with the hand-over, WRITE and READ without it (the consumer computes
#                   the last prompt token, as before) -- docs/perf/connector.md.
# Needs .devpack/carry.tar.xz holding .devcarry (pdserve, pdrouter, xferbench: tests/gpu/pack_for_device.sh)
# and .devcarry-xfer (the staging check's carry, see tests/gpu/xfer_ucx_staging_check.sh).
# Results go to $OUT (JSON + logs); a short table is printed last.
set -uo pipefail
PART=${1:?usage: device_handover_checks.sh xfer-eq|ttft}
OUT=${OUT:-/tmp/handover_checks}
mkdir -p "$OUT"
[ -f .devpack/carry.tar.xz ] && tar -xJf .devpack/carry.tar.xz
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
B=$PWD/.devcarry/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

deploy() {  # config, log name, model, serve args, kv extra JSON, command...
  local cfg=$1 name=$2 model=$3 serve=$4 kv=$5
  shift 5
  local gpus=(--gpus 0,1)
  [ "$cfg" = collocated ] && gpus=(--gpus 0 --num-collocated 1)
  timeout 300 python3 tools/pdbench/deploy.py --config "$cfg" --device cuda "${gpus[@]}" --bin-dir "$B" \
    --model "$model" --log-dir "$OUT/logs_$name" --serve-args "$serve" --kv-extra "$kv" -- "$@"
}

if [ "$PART" = xfer-eq ]; then
  step "1. xferbench cuda --compare"
  timeout 180 "$B/xferbench" --backend cuda --compare --iters 10 --json > "$OUT/xferbench_compare.json" \
    2> "$OUT/xferbench_compare.log"
  echo "xferbench rc=$?"; tail -12 "$OUT/xferbench_compare.log"

  step "2. ucx GPU staging"
  OUT=$OUT/staging CARRY_DIR=.devcarry-xfer timeout 240 bash tests/gpu/xfer_ucx_staging_check.sh > "$OUT/staging.log" 2>&1
  echo "staging rc=$?"; tail -12 "$OUT/staging.log"

  step "3. P/D equality on the ~1B model (hand-over on)"
  python3 -c "
import sys, torch
sys.path.insert(0, 'tests/gpu')
from hf_parity import build_model
build_model('1b', '/tmp/models/1b', torch.device('cuda:0'))
" > "$OUT/build_1b.log" 2>&1 || { echo "model build failed"; tail "$OUT/build_1b.log"; }
  for cfg in collocated pd-write pd-read; do
    deploy $cfg "eq_$cfg" /tmp/models/1b "--max-model-len 2048 --gpu-memory-utilization 0.5" '{}' \
      python3 tests/gpu/pd_equality.py run --url {url} --out "$OUT/eq_$cfg.json" > "$OUT/eq_$cfg.log" 2>&1
    echo "equality $cfg rc=$?"; grep -E "deploy\]" "$OUT/eq_$cfg.log" | tail -3
  done
  python3 tests/gpu/pd_equality.py compare "$OUT/eq_collocated.json" "$OUT/eq_pd-write.json" \
    "$OUT/eq_pd-read.json" > "$OUT/eq_compare.txt" 2>&1
  for cfg in pd-write pd-read; do
    grep -h "pd_connector_first_tokens_total" "$OUT"/logs_eq_$cfg/*metrics* 2>/dev/null | head -2
  done
  step "summary"
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
try:
    d = json.load(open(os.path.join(out, "xferbench_compare.json")))
    for row in d.get("compare_table", d.get("rows", []))[:20]:
        print(row)
except Exception as e:
    print("xferbench json:", e)
print(open(os.path.join(out, "eq_compare.txt")).read()[-1500:])
PY
  tail -8 "$OUT/staging.log"
  exit 0
fi

if [ "$PART" = ttft ]; then
  step "4. TTFT at low load, Qwen3-32B shape"
  for spec in "collocated:collocated:{}" "pd-write:write_handover:{}" "pd-read:read_handover:{}" \
              "pd-write:write_compute:{\"first_token_handover\": false}" \
              "pd-read:read_compute:{\"first_token_handover\": false}"; do
    cfg=${spec%%:*}; rest=${spec#*:}; name=${rest%%:*}; kv=${rest#*:}
    deploy "$cfg" "ttft_$name" tests/gpu/models/qwen3-32b-shape "--load-format dummy --max-model-len 4096" "$kv" \
      python3 tools/pdbench/pdbench.py run --base-url {url} --max-concurrency 1 --num-requests 10 \
        --warmup-requests 2 --input-len 2000 --output-len 32 --label "$name" --save-requests \
        --json-out "$OUT/ttft_$name.json" > "$OUT/ttft_$name.log" 2>&1
    echo "ttft $name rc=$?"; grep -E "deploy\]" "$OUT/ttft_$name.log" | tail -2
  done
  step "summary"
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
base = None
print(f"{'config':16} {'TTFT p50':>9} {'mean':>8} {'min':>8} {'vs coll':>8} {'TPOT p50':>9}")
for name in ("collocated", "write_handover", "read_handover", "write_compute", "read_compute"):
    try:
        r = json.load(open(os.path.join(out, f"ttft_{name}.json")))["runs"][0]
    except Exception as e:
        print(name, "missing:", e)
        continue
    t = r["ttft_ms"]
    if name == "collocated":
        base = t["p50"]
    ratio = f"{t['p50'] / base - 1:+.1%}" if base else "-"
    print(f"{name:16} {t['p50']:9.1f} {t['mean']:8.1f} {t.get('min', float('nan')):8.1f} {ratio:>8} "
          f"{r['tpot_ms']['p50']:9.2f}")
PY
  exit 0
fi
echo "unknown part $PART"; exit 2
