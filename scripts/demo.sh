#!/usr/bin/env bash
# The main job: installs dependencies, builds pdserve, then runs a P/D
# deployment on this machine (pdrouter + one producer + one consumer on the
# built-in tiny model; on the GPU with --device cuda when one is present),
# streams one chat completion through the router, prints a short report
# (transfer bytes and time, TTFT) and shuts everything down cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
echo "[demo] building (release) ..."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target pdserve pdrouter
exec python3 scripts/demo.py --bin-dir build/bin "$@"
