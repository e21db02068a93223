#!/usr/bin/env bash
# Runs every CPU test of pdserve from a fresh clone: installs dependencies,
# builds the sanitizer configuration (unit tests under ASan+UBSan), the release
# configuration (binaries + CUDA compile check when nvcc exists), the fuzzers,
# then runs unit tests, fuzzers (bounded) and the Python integration/parity suites.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
JOBS=${JOBS:-$(nproc)}
SECTION_START=$(date +%s)
section() { echo; echo "=== [$(( $(date +%s) - SECTION_START ))s] $*"; }

section "install dependencies"
bash scripts/install_deps.sh

section "build: release (build/)"
# The release build gives the binaries the Python suites run and compiles the
# CUDA code; the unit tests run from the sanitizer build below.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPDSERVE_UNIT_TESTS=OFF >/dev/null
cmake --build build -j "$JOBS"

section "build: ASan+UBSan (build-asan/)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPDSERVE_SANITIZE=ON -DPDSERVE_CUDA=OFF >/dev/null
cmake --build build-asan -j "$JOBS"

section "unit tests under ASan+UBSan"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan -L unit -j "$JOBS" --output-on-failure --timeout 600

if [ -f tests/fuzz/CMakeLists.txt ]; then
  section "build + run fuzzers (libFuzzer, bounded)"
  CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPDSERVE_FUZZ=ON -DPDSERVE_CUDA=OFF >/dev/null
  cmake --build build-fuzz -j "$JOBS" --target pd_fuzzers
  ctest --test-dir build-fuzz -L fuzz --output-on-failure --timeout 900
fi

# One pytest run per suite: each folder has its own conftest.py, which its
# tests import by name.
export PDSERVE_BIN_DIR="$ROOT/build/bin"
section "Python parity suite (tokenizer, chat templates) against build/bin"
python3 -m pytest -q -p no:cacheprovider tests/parity "$@"
section "Python integration suite (real processes) against build/bin"
python3 -m pytest -q -p no:cacheprovider tests/integration "$@"
section "all tests passed"
