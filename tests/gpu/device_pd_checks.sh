#!/usr/bin/env bash
# Checks on a 2xH200 machine (kind nvidia-h200-x2), in one run:
#   1. router benchmark on an idle 32-core host (pdrouter vs the toy proxy, docs/perf/router.md);
#   2. whole-model parity of pdserve --device cuda vs HF transformers, tiny and ~1B (hf_parity.py);
#   3. P/D (WRITE, READ) vs collocated output on the ~1B model, GPU 0 -> GPU 1 (pd_equality.py);
#   4. TTFT at low load (one request at a time), Qwen3-32B shape, collocated vs WRITE vs READ.
# Needs .devcarry from tests/gpu/pack_for_device.sh plus .devcarry/toyproxy (upstream file, never
# committed) and .devcarry/router_bench/{fast_backend,loadgen}; wheels for the toy proxy in .whl.
# Results go to $OUT (JSON + logs); a short table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/pdchecks}
mkdir -p "$OUT"
# The carried binaries and libraries travel as one xz tarball (the 64 MiB transfer limit).
[ -f .devpack/carry.tar.xz ] && tar -xJf .devpack/carry.tar.xz
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
B=$PWD/.devcarry/bin
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | head -3

step "1. router bench"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && cp .devcarry/router_bench/* /tmp/ && touch /tmp/fast_backend /tmp/loadgen \
  && PYTHONPATH=/tmp/site timeout 240 python3 tools/router_bench/run_bench.py --pdrouter "$B/pdrouter" \
       --toy-proxy .devcarry/toyproxy/moriio_toy_proxy_server.py --duration-s 5 --router-io-threads 2 \
       --json-out "$OUT/router_bench.json" > "$OUT/router_bench.log" 2>&1
echo "router bench rc=$?"

step "2. HF parity"
timeout 420 python3 tests/gpu/hf_parity.py --pdserve "$B/pdserve" --cuda-device 0 --hf-device 1 \
  --keep-dir /tmp/models --json-out "$OUT/hf_parity.json" > "$OUT/hf_parity.log" 2>&1
echo "hf parity rc=$?"

step "3. P/D equality on the ~1B model"
bash tests/gpu/pd_equality_runs.sh "$OUT" "$B" /tmp/models/1b 0,1 "--max-model-len 2048 --gpu-memory-utilization 0.5"

step "4. TTFT at low load, Qwen3-32B shape"
for cfg in collocated pd-write pd-read; do
  extra=(--gpus 0,1); [ $cfg = collocated ] && extra=(--gpus 0 --num-collocated 1)
  timeout 300 python3 tools/pdbench/deploy.py --config $cfg --device cuda "${extra[@]}" --bin-dir "$B" \
    --model tests/gpu/models/qwen3-32b-shape --log-dir "$OUT/logs_ttft_$cfg" \
    --serve-args "--load-format dummy --max-model-len 4096" -- \
    python3 tools/pdbench/pdbench.py run --base-url {url} --max-concurrency 1 --num-requests 10 \
      --warmup-requests 2 --input-len 2000 --output-len 32 --label "$cfg" --save-requests \
      --json-out "$OUT/ttft_$cfg.json" > "$OUT/ttft_$cfg.log" 2>&1
  echo "ttft $cfg rc=$?"; grep -E "TTFT|TPOT|KV bytes|deploy\]" "$OUT/ttft_$cfg.log" | tail -6
done

step "summary"
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        return None
rb = load("router_bench.json")
if rb:
    print("router added latency us p50/p90/p99:", rb.get("added_latency_us", {}).get("pdrouter"),
          "rate ratio:", rb.get("rate_ratio_pdrouter_over_toy"))
print(open(os.path.join(out, "eq_compare.txt")).read() if os.path.exists(os.path.join(out, "eq_compare.txt")) else "no equality compare")
for cfg in ("collocated", "pd-write", "pd-read"):
    d = load(f"ttft_{cfg}.json")
    if d and d.get("runs"):
        r = d["runs"][0]
        print(cfg, "TTFT ms", {k: round(v, 1) for k, v in r["ttft_ms"].items() if isinstance(v, (int, float))},
              "TPOT p50", round(r["tpot_ms"]["p50"], 2))
PY
tail -6 "$OUT/hf_parity.log"
