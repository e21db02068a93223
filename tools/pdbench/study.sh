#!/usr/bin/env bash
# The goodput study of docs/perf/goodput.md, one configuration per call:
#   tools/pdbench/study.sh CONFIG OUT_DIR
# CONFIG: collocated-default | collocated-tuned | pd-write | pd-read
# Qwen3-32B-shaped dummy weights, one GPU per instance (GPUs 0 and 1), behind pdrouter.
# Inside one deployment: a TTFT probe at low load (one request at a time, ISL 2000,
# OSL 16), then (MODE=search, the default) a steady-state search between RATE_LO and RATE_HI
# (plateaus of >= MIN_REQUESTS measured requests, Little's law checked, every server's /metrics
# per window, bisection for the 90 % crossing of SEARCH_VARIANT, at most MAX_POINTS plateaus),
# or (MODE=staircase) a staircase sweep over $RATES ($WINDOW_S s per rate), ISL 2000, OSL 1000,
# fixed lengths, Poisson arrivals, SLO TTFT <= 1 s and ITL <= 50 ms.
# Environment: BIN_DIR (pdserve/pdrouter), MODE, RATE_LO, RATE_HI, MIN_REQUESTS, MAX_POINTS,
# SEARCH_VARIANT, RATES, WINDOW_S, TAIL_S, LEAD_S and HOLD_S (staircase plateaus), TUNED_BUDGET,
# MODEL, DEVICE (cuda). ISL/OSL: ISL, OSL (2000/1000).
set -uo pipefail
config=${1:?config}
out=${2:?out dir}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bin=${BIN_DIR:-$root/build/bin}
model=${MODEL:-$root/tests/gpu/models/qwen3-32b-shape}
rates=${RATES:-1,2,3,4}
window=${WINDOW_S:-25}
tuned_budget=${TUNED_BUDGET:-512}
serve="--load-format dummy --max-model-len 4096 --gpu-memory-utilization 0.92"
case $config in
  collocated-default) deploy=(--config collocated --num-collocated 2 --serve-args "$serve --max-num-batched-tokens 2048") ;;
  collocated-tuned) deploy=(--config collocated --num-collocated 2 --serve-args "$serve --max-num-batched-tokens $tuned_budget") ;;
  # The producer only prefills: a large budget lets it batch several prompts per step.
  pd-write) deploy=(--config pd-write --serve-args "$serve" --producer-args "--max-num-batched-tokens 8192") ;;
  pd-read) deploy=(--config pd-read --serve-args "$serve" --producer-args "--max-num-batched-tokens 8192") ;;
  *) echo "unknown config $config" >&2; exit 2 ;;
esac
bench="python3 $root/tools/pdbench/pdbench.py"
probe="$bench run --base-url {url} --max-concurrency 1 --num-requests 8 --warmup-requests 2 --input-len ${ISL:-2000} \
  --output-len 16 --seed 11 --label $config --save-requests --json-out $out/ttft_$config.json --quiet"
sweep="$bench sweep --base-url {url} --rates $rates --staircase-window-s $window --warmup-requests 4 \
  --staircase-tail-s ${TAIL_S:-$window} ${LEAD_S:+--staircase-lead-s $LEAD_S} ${HOLD_S:+--staircase-hold-s $HOLD_S} --input-len ${ISL:-2000} --output-len ${OSL:-1000} --slo-ttft-ms 1000 --slo-itl-ms 50 --request-timeout-s 240 \
  --label $config --save-requests --json-out $out/sweep_$config.json"
if [ "${MODE:-search}" = search ]; then
  sweep="$bench search --base-url {url} {metrics_args} --rate-lo ${RATE_LO:-1} --rate-hi ${RATE_HI:-4} \
    --min-requests ${MIN_REQUESTS:-200} --max-points ${MAX_POINTS:-5} --search-variant ${SEARCH_VARIANT:-ttft_tpot} \
    --input-len ${ISL:-2000} --output-len ${OSL:-1000} --slo-ttft-ms 1000 --slo-itl-ms 50 --request-timeout-s 240 \
    --label $config --save-requests --json-out $out/search_$config.json"
fi
python3 "$root/tools/pdbench/deploy.py" --device "${DEVICE:-cuda}" --gpus 0,1 --bin-dir "$bin" --model "$model" \
  --log-dir "$out/logs_$config" "${deploy[@]}" -- bash -c "$probe && $sweep"
