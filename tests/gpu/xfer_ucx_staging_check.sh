#!/usr/bin/env bash
# GPU check of xfer's ucx staging: GPU memory through the ucx backend when the
# UCX build has no CUDA transports. Two processes on one GPU machine (xferbench forks the
# target), GPU regions on both sides, every iteration verified byte-exact on the GPU;
# bandwidth beside ucx_perftest's host put on the same transport. Also checks that the
# engine's "auto" choice stays cuda for GPU <-> GPU on one host.
#
# Runs from the repository root on the GPU machine, with xferbench (built with CUDA) packed by
#   PACK_OUT=.devcarry-xfer tests/gpu/pack_for_device.sh build-hB xferbench
#   cp /usr/bin/ucx_perftest /usr/bin/ucx_info .devcarry-xfer/bin/
#   cp -L /usr/lib/x86_64-linux-gnu/libgomp.so.1 .devcarry-xfer/lib/
# carried, and CARRY_DIR=.devcarry-xfer (default .devcarry). ucx_perftest is optional (the
# reference: without it the GB/s columns still come, the perftest column reads 0). Results and logs go to $OUT; a short table
# is printed last; the exit status is non-zero if any transfer was not byte-exact or a
# run failed.
set -uo pipefail
OUT=${OUT:-/tmp/xfer_staging}
mkdir -p "$OUT"
CARRY=$PWD/${CARRY_DIR:-.devcarry}  # where pack_for_device.sh put the binaries (PACK_OUT)
export LD_LIBRARY_PATH=$CARRY/lib:${LD_LIBRARY_PATH:-}
[ -d "$CARRY/lib/ucx" ] && export UCX_MODULE_DIR=$CARRY/lib/ucx
XFERBENCH=${XFERBENCH:-$CARRY/bin/xferbench}
# The reference: a carried ucx_perftest (same UCX as xferbench), else the machine's, else none.
PERFTEST=$CARRY/bin/ucx_perftest
[ -x "$PERFTEST" ] || PERFTEST=$(command -v ucx_perftest || echo /nonexistent/ucx_perftest)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
NUM_GPUS=$(nvidia-smi -L | wc -l)
REMOTE=$([ "$NUM_GPUS" -ge 2 ] && echo 1 || echo 0)
UCX_INFO=$CARRY/bin/ucx_info
[ -x "$UCX_INFO" ] || UCX_INFO=ucx_info
"$UCX_INFO" -d 2>/dev/null | grep -E "Transport: cuda" || echo "(the carried UCX lists no cuda transports: staging is used)"
# Qwen3-8B KV shape cut to 8 layers (70 MiB per pattern); 5 timed iterations.
SHAPE=(--layers 8 --iters 5 --warmup 1 --local-device 0 --remote-device "$REMOTE" --perftest "$PERFTEST" --json)

status=0
run() {  # name, xferbench flags...
  local name=$1
  shift
  echo "=== $(date -u +%H:%M:%S) $name: xferbench $*"
  timeout 300 "$XFERBENCH" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -8 "$OUT/$name.txt"
  [ $rc -eq 0 ] || { echo "$name: rc=$rc"; status=1; }
}
run staged_shm --backend ucx --memory gpu "${SHAPE[@]}"
run staged_tcp --backend ucx --memory gpu --ucx-tls tcp "${SHAPE[@]}"
run host_shm --backend ucx --memory host "${SHAPE[@]}"
if [ "$REMOTE" = 1 ]; then
  run auto_gpu --backend auto --memory gpu --scenarios kv --iters 2 --warmup 0 --no-b2b --local-device 0 \
    --remote-device 1 --perftest /nonexistent/ucx_perftest --json
fi

python3 - "$OUT" "$REMOTE" <<'PY' || status=1
import json, sys, pathlib
out, remote = pathlib.Path(sys.argv[1]), sys.argv[2]
def report(name):
    text = (out / f"{name}.txt").read_text()
    try:
        return json.loads(text[text.index("{"):text.rindex("}") + 1])
    except ValueError:
        return None
ok = True
rows = []
for name in ["staged_shm", "staged_tcp", "host_shm"]:
    r = report(name)
    if r is None:
        ok = False
        rows.append((name, "-", "no report", "", "", "", ""))
        continue
    ok = ok and r["all_verified_byte_exact"]
    for s in r["scenarios"]:
        rows.append((name, r.get("transports", ""), s["name"], f'{s["gbps"]:.2f}', f'{s["b2b_gbps"]:.2f}',
                     f'{s["reference_gbps"]:.2f}', "exact" if s["mismatched_bytes"] == 0 and not s["error"]
                     else "MISMATCH " + s["error"]))
if remote == "1":
    r = report("auto_gpu")
    chosen = r.get("session_backend") if r else None
    print(f"auto backend for GPU<->GPU on one host: {chosen} (expected cuda)")
    ok = ok and chosen == "cuda"
print(f"\n{'run':<11} {'transports':<32} {'scenario':<11} {'GB/s':>7} {'b2b GB/s':>9} {'perftest':>9}  verified")
for row in rows:
    print(f"{row[0]:<11} {row[1][:32]:<32} {row[2]:<11} {row[3]:>7} {row[4]:>9} {row[5]:>9}  {row[6]}")
print("ALL BYTE-EXACT" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
exit $status
