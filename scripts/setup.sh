#!/usr/bin/env bash
# Installs what the build needs and is missing (Debian/Ubuntu packages), then configures and
# builds fusemoe into ${FUSEMOE_BUILD_DIR:-build}. Safe to run again: it only installs what is
# absent and ninja rebuilds only what changed. The CUDA 13 toolkit (nvcc, cuBLAS) must already
# be installed (it is not a Debian package of the right version); the script says so if not.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${FUSEMOE_BUILD_DIR:-build}"

log() { echo "[setup] $*"; }

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  missing+=(libgtest-dev)
fi
# The benchmarks write JSON with nlohmann::json (header only: needed to build, not to run).
if [ ! -f /usr/include/nlohmann/json.hpp ] && [ ! -f /usr/local/include/nlohmann/json.hpp ]; then
  missing+=(nlohmann-json3-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing missing packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if ! command -v nvcc >/dev/null; then
  for candidate in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
    if [ -x "$candidate/nvcc" ]; then export PATH="$candidate:$PATH"; break; fi
  done
fi
if ! command -v nvcc >/dev/null; then
  echo "[setup] error: nvcc not found. fusemoe needs the CUDA 13 toolkit (nvcc, cuBLAS);" \
       "install it and put its bin/ on PATH (usually /usr/local/cuda/bin)." >&2
  exit 1
fi
log "nvcc: $(nvcc --version | tail -1)"

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" >"$BUILD_DIR.configure.log" 2>&1 ||
    { cat "$BUILD_DIR.configure.log"; exit 1; }
fi
# Two jobs: nvcc needs ~2 GB per job and CI machines have 2 cores.
log "building (ninja -j${FUSEMOE_BUILD_JOBS:-2})"
ninja -C "$BUILD_DIR" -j"${FUSEMOE_BUILD_JOBS:-2}"
log "build ready in $BUILD_DIR"
