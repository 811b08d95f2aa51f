#!/usr/bin/env bash
# The README's test command: set up and build (scripts/setup.sh), then run every test suite.
#   ctest label cpu : fp64 reference and API validation (no GPU needed)
#   ctest label gpu : GPU suites; reported "Skipped" (exit 77) where there is no sm_90 GPU
#   tests/python    : pytest; PyTorch from PyPI into build/test-venv where python3 has none; the
#                     GPU tests report skipped where there is no sm_90 GPU. Twice: on the native
#                     binding (libfusemoe_torch.so, built here against that PyTorch; required in
#                     CI) and on the ctypes path (FUSEMOE_NATIVE=0)
#   the package     : scripts/check_wheel.sh (pip wheel . with and without build isolation,
#                     import fusemoe from each wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${FUSEMOE_BUILD_DIR:-build}"
bash scripts/setup.sh
echo "[tests] ctest (labels cpu, gpu)"
ctest --test-dir "$BUILD_DIR" --output-on-failure
# Python: the interpreter with PyTorch, else a virtual environment with PyPI's torch (installed
# on first use: ~1 min and ~5.8 GB; CI's clean clone pays it once per run).
PY=python3
if ! python3 -c "import torch" 2>/dev/null; then
  VENV="${FUSEMOE_TEST_VENV:-$BUILD_DIR/test-venv}"
  mkdir -p "$(dirname "$VENV")"
  VENV="$(cd "$(dirname "$VENV")" && pwd -P)/$(basename "$VENV")"  # absolute: scripts cd away
  if ! "$VENV/bin/python" -c "import torch, pytest, transformers, matplotlib" 2>/dev/null; then
    echo "[tests] python3 has no PyTorch: installing tests/python/requirements.txt from PyPI into $VENV"
    start=$SECONDS
    # No pip cache (the ~3 GB of wheels would stay on disk twice) and pip's scratch beside the
    # venv, so the install needs room on one disk only, and a full disk is named as such.
    mkdir -p "$VENV.tmp"
    if python3 -m venv "$VENV" &&
       TMPDIR="$VENV.tmp" "$VENV/bin/python" -m pip install -q --no-cache-dir \
         -r tests/python/requirements.txt; then
      echo "[tests] installed in $((SECONDS - start)) s"
    else
      echo "[tests] could not install PyTorch into $VENV; free space there:"
      df -h "$(dirname "$VENV")" || true
    fi
    rm -rf "$VENV.tmp"
  fi
  PY="$VENV/bin/python"
elif ! python3 -c "import pytest" 2>/dev/null; then
  echo "[tests] installing pytest from PyPI (tests/python)"
  python3 -m pip install -q pytest || echo "[tests] could not install pytest"
fi
if ! "$PY" -c "import torch, pytest" 2>/dev/null; then
  echo "[tests] tests/python skipped: no PyTorch and pytest (see above)"
  # CI must run the Python suite: a skip there is a failure, not a pass.
  if [ "${CI:-}" = true ]; then exit 1; fi
  exit 0
fi
# torchtitan for tests/python/test_torchtitan.py (its MoE module is what the adapter is checked
# against): without its dependencies, whose pins (torchdata's torch) would replace the test
# interpreter's PyTorch, plus the two its models import (spmd_types, tyro). Where it does not
# install or import, those tests report skipped.
if ! "$PY" -c "import torchtitan.models.common.moe" 2>/dev/null; then
  if "$PY" -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" &&
     "$PY" -m pip install -q tyro && "$PY" -c "import torchtitan.models.common.moe" 2>/dev/null; then
    echo "[tests] installed torchtitan 0.3.0 (tests/python/test_torchtitan.py)"
  else
    echo "[tests] torchtitan did not install or import: tests/python/test_torchtitan.py reports skipped"
  fi
fi
# The native binding needs the headers of the PyTorch the tests use: configure the build for
# that interpreter (CMake says why when it cannot build it) and build what the package loads.
echo "[tests] the native binding against $PY"
cmake -S . -B "$BUILD_DIR" -DFUSEMOE_PYTHON="$PY" >"$BUILD_DIR.binding.log" 2>&1 ||
  { cat "$BUILD_DIR.binding.log"; exit 1; }
grep "fusemoe: PyTorch binding" "$BUILD_DIR.binding.log" || true
ninja -C "$BUILD_DIR" -j"${FUSEMOE_BUILD_JOBS:-2}" fusemoe_package
native=0
if grep -q "fusemoe: PyTorch binding against" "$BUILD_DIR.binding.log"; then
  native=1
elif [ "${CI:-}" = true ]; then
  echo "[tests] CI must test the native binding, and it was not built (see above)" >&2
  exit 1
fi
export FUSEMOE_LIBRARY="${FUSEMOE_LIBRARY:-$(cd "$BUILD_DIR" && pwd -P)/libfusemoe_c.so}"
torch_version="$("$PY" -c 'import torch; print("torch", torch.__version__)')"
# run_pytest WHAT [ENV=VALUE...]: any non-zero exit is a failure, 5 included: pytest exits 5 when
# it collected no tests, and a suite that runs nothing must not pass.
run_pytest() {
  local what="$1"
  shift
  echo "[tests] pytest tests/python, $what ($torch_version)"
  set +e
  env "$@" "$PY" -m pytest -q -rs tests/python
  local status=$?
  set -e
  if [ $status -eq 5 ]; then echo "[tests] pytest collected no tests in tests/python" >&2; fi
  if [ $status -ne 0 ]; then exit $status; fi
}
if [ $native = 1 ]; then
  run_pytest "native binding" FUSEMOE_REQUIRE_NATIVE=1
else
  echo "[tests] no native binding to test (see above): the ctypes path only"
fi
run_pytest "ctypes path" FUSEMOE_NATIVE=0
echo "[tests] the package: pip wheel . and import fusemoe from it (scripts/check_wheel.sh)"
bash scripts/check_wheel.sh "$PY"
