#!/usr/bin/env bash
# P/D output vs collocated output (tests/gpu/pd_equality.py) for one model: a collocated
# instance on GPU 0, then WRITE and READ pairs on the GPUs given, then the comparison.
# Used by device_pd_checks.sh and device_route_checks.sh.
# Usage: pd_equality_runs.sh OUT_DIR BIN_DIR MODEL_DIR PD_GPUS "SERVE_ARGS"
#   PD_GPUS: producer,consumer CUDA ordinals, e.g. 0,1 (or 0,0: both on one GPU).
# Writes OUT_DIR/eq_{collocated,pd-write,pd-read}.{json,log}, logs_eq_*/ and eq_compare.txt;
# every deployment is bounded by a 300 s timeout. Exit status: the comparison's.
set -uo pipefail
out=$1 bin=$2 model=$3 pd_gpus=$4 serve_args=$5
for cfg in collocated pd-write pd-read; do
  gpus=(--gpus "$pd_gpus"); [ $cfg = collocated ] && gpus=(--gpus 0 --num-collocated 1)
  timeout 300 python3 tools/pdbench/deploy.py --config $cfg --device cuda "${gpus[@]}" --bin-dir "$bin" \
    --model "$model" --log-dir "$out/logs_eq_$cfg" --serve-args "$serve_args" -- \
    python3 tests/gpu/pd_equality.py run --url {url} --out "$out/eq_$cfg.json" > "$out/eq_$cfg.log" 2>&1
  echo "equality $cfg rc=$?"; tail -3 "$out/eq_$cfg.log"
done
python3 tests/gpu/pd_equality.py compare "$out/eq_collocated.json" "$out/eq_pd-write.json" "$out/eq_pd-read.json" \
  > "$out/eq_compare.txt" 2>&1
