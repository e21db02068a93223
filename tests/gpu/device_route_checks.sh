#!/usr/bin/env bash
# Checks on a one-GPU machine (kind nvidia-h200; or two GPUs, below) for the cuda backend's route
# checks (commit 102e7c7: a peer's offset + size must lie in the allocation its IPC handle maps;
# the same-process shortcut only takes spans a cuda backend of this process registered):
#   1. xferbench --backend cuda between two processes, GPU 0 -> GPU $REMOTE_GPU (CUDA IPC; within one
#      device when REMOTE_GPU=0, over NVLink when 1) and with the target on a thread (the
#      same-process shortcut); every iteration byte-verified;
#   2. if built, pd_gpu_xfer_route_check: forged descriptors refused, real ones accepted (the
#      target's buffer on GPU $REMOTE_GPU);
#   3. P/D (WRITE, READ) vs collocated on the ~1B HF-format model, producer on GPU 0, consumer on
#      GPU $REMOTE_GPU.
# REMOTE_GPU defaults to 0 (one-GPU machines); on the two-GPU kind run it with REMOTE_GPU=1.
# Needs .devcarry (or .devpack/carry.tar.xz) from tests/gpu/pack_for_device.sh with xferbench,
# pdserve, pdrouter (and pd_gpu_xfer_route_check). Results go to $OUT; a short table is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/routechecks}
mkdir -p "$OUT"
[ -f .devpack/carry.tar.xz ] && tar -xJf .devpack/carry.tar.xz
export LD_LIBRARY_PATH=$PWD/.devcarry/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
B=$PWD/.devcarry/bin
R=${REMOTE_GPU:-0}
step() { echo "=== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader

step "1. xferbench cuda, two processes, GPU 0 -> GPU $R (IPC)"
timeout 240 "$B/xferbench" --backend cuda --local-device 0 --remote-device "$R" --iters 10 --json \
  > "$OUT/xb_ipc.txt" 2> "$OUT/xb_ipc.err"
echo "xferbench ipc rc=$?"
step "1b. xferbench cuda, target on a thread (same-process shortcut)"
timeout 240 "$B/xferbench" --backend cuda --local-device 0 --remote-device "$R" --same-process --iters 10 --json \
  > "$OUT/xb_same.txt" 2> "$OUT/xb_same.err"
echo "xferbench same-process rc=$?"

if [ -x "$B/pd_gpu_xfer_route_check" ]; then
  step "2. forged descriptors"
  timeout 120 "$B/pd_gpu_xfer_route_check" "$R" > "$OUT/route_check.txt" 2>&1
  echo "route check rc=$?"
  tail -15 "$OUT/route_check.txt"
fi

step "3. P/D equality on the ~1B model, producer on GPU 0, consumer on GPU $R"
python3 - <<'PY'
import sys, torch
sys.path.insert(0, "tests/gpu")
import hf_parity
hf_parity.build_model("1b", "/tmp/models/1b", torch.device("cuda:0"))
print("model built")
PY
bash tests/gpu/pd_equality_runs.sh "$OUT" "$B" /tmp/models/1b "0,$R" "--max-model-len 2048 --num-kv-blocks 4096"
echo "compare rc=$?"
grep -h -i -E "refus|route|recompute|transfer.*fail" "$OUT"/logs_eq_pd-*/*.log 2>/dev/null | head -10

step "summary"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
for name in ("xb_ipc", "xb_same"):
    path = os.path.join(out, name + ".txt")
    text = open(path).read() if os.path.exists(path) else ""
    start = text.find("{")
    try:
        d = json.JSONDecoder().raw_decode(text[start:])[0] if start >= 0 else None
    except ValueError:
        d = None
    if d is None:
        print(name, "no JSON; stderr tail:", open(os.path.join(out, name + ".err")).read()[-400:])
        continue
    print(name, "all_verified_byte_exact:", d.get("all_verified_byte_exact"))
    for r in d.get("results", d.get("scenarios", [])):
        if isinstance(r, dict):
            print("  ", {k: r[k] for k in r if k in ("name", "gbps", "reference_gbps", "ratio", "verified")})
p = os.path.join(out, "eq_compare.txt")
print(open(p).read() if os.path.exists(p) else "no equality compare")
PY
