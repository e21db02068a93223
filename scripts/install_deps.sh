#!/usr/bin/env bash
# Idempotent: installs the Debian packages and PyPI test tools pdserve needs
# (DESIGN.md §4). Safe to run again; does nothing when everything is present.
set -euo pipefail

DEBIAN_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev
  libucx-dev ucx-utils
  libboost-dev libboost-system-dev
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev
  libpcre2-dev libxxhash-dev libsodium-dev libicu-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-14 libclang-rt-14-dev clang-format
  iproute2 curl python3 python3-pip python3-venv
)
PYPI_PACKAGES=(pytest pytest-timeout openai tokenizers transformers jinja2 numpy msgpack pyzmq matplotlib llguidance==1.9.1)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install] Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "[install] Debian packages: all present"
fi

PYTHON=${PYTHON:-python3}
need_pip=0
for mod in pytest pytest_timeout openai tokenizers transformers jinja2 numpy msgpack zmq matplotlib llguidance; do
  "$PYTHON" -c "import $mod" 2>/dev/null || need_pip=1
done
if [ $need_pip = 1 ]; then
  echo "[install] PyPI test tools: ${PYPI_PACKAGES[*]}"
  "$PYTHON" -m pip install -q --disable-pip-version-check "${PYPI_PACKAGES[@]}" \
    || "$PYTHON" -m pip install -q --disable-pip-version-check --break-system-packages "${PYPI_PACKAGES[@]}"
else
  echo "[install] PyPI test tools: all present"
fi

# CUTLASS's C++ headers for the grouped FP8 MoE prefill GEMM (src/kernels/cuda/grouped_fp8_gemm.cu),
# from PyPI's nvidia-cutlass, pinned; CMake finds them through python3 at configure time. Headers only:
# installed without the package's Python dependencies. Without them the build still works (MoE FP8
# prefill then runs one GEMM per expert).
CUTLASS_VERSION=4.2.0.0
if "$PYTHON" -m pip show nvidia-cutlass 2>/dev/null | grep -x "Version: $CUTLASS_VERSION" >/dev/null; then
  echo "[install] nvidia-cutlass $CUTLASS_VERSION: present"
else
  echo "[install] nvidia-cutlass $CUTLASS_VERSION (C++ headers)"
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass==$CUTLASS_VERSION" \
    || "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --break-system-packages \
      "nvidia-cutlass==$CUTLASS_VERSION"
fi
