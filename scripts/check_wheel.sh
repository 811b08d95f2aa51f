#!/usr/bin/env bash
# The package as pip builds it, twice, each wheel installed into a scratch folder and imported
# from outside the repository with FUSEMOE_LIBRARY unset (no GPU needed):
#   `pip wheel .`                         pip's isolated build cannot see torch: the wheel bundles
#                                         libfusemoe_c.so only and the ops run over ctypes;
#   `pip wheel --no-build-isolation .`    the build sees PYTHON's torch: the wheel also bundles the
#                                         native binding libfusemoe_torch.so, which import loads.
# Each checks that `import fusemoe` loads the bundled libraries (C ABI version, struct layouts,
# which op path and why). The second needs scikit-build-core in PYTHON (installed from PyPI when
# missing) and a torch >= 2.10 CUDA build.
#   usage: scripts/check_wheel.sh [PYTHON]   (default python3; it must have torch)
# Exit 0 when both checks passed; the native wheel is left in ${FUSEMOE_WHEEL_DIR:-build/wheelhouse}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
# A path relative to the repository stays valid after the cd below.
if [[ "$PY" == */* ]]; then PY="$(cd "$(dirname "$PY")" && pwd -P)/$(basename "$PY")"; fi
WHEEL_DIR="${FUSEMOE_WHEEL_DIR:-build/wheelhouse}"
SCRATCH="$(mktemp -d /tmp/fusemoe_wheel.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

log() { echo "[wheel] $*"; }

# build_and_check NAME EXPECTED_PATH PIP_WHEEL_OPTIONS...: EXPECTED_PATH is "native" or "ctypes".
build_and_check() {
  local name="$1" expected="$2"
  shift 2
  local out="$SCRATCH/$name"
  mkdir -p "$out"
  log "pip wheel ${*:+$* }. ($name)"
  "$PY" -m pip wheel -q --no-deps "$@" -w "$out/wheel" . >"$out/pip_wheel.log" 2>&1 ||
    { cat "$out/pip_wheel.log"; exit 1; }
  local wheel
  wheel="$(ls "$out"/wheel/fusemoe-*.whl)"
  log "built $(basename "$wheel"): $("$PY" -c 'import sys, zipfile; print(" ".join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".so")))' "$wheel")"
  "$PY" -m pip install -q --no-deps --target "$out/site" "$wheel"
  (cd "$SCRATCH" && env -u FUSEMOE_LIBRARY -u FUSEMOE_NATIVE PYTHONPATH="$out/site" \
     "$PY" - "$out/site" "$expected" <<'PYCODE'
import os
import sys

import fusemoe
from fusemoe import _capi, _native

site, expected = os.path.realpath(sys.argv[1]), sys.argv[2]
package = os.path.join(site, "fusemoe")
problems = []
if os.path.realpath(fusemoe.__file__) != os.path.join(package, "__init__.py"):
    problems.append(f"imported fusemoe from {fusemoe.__file__}, not the wheel")
if os.path.realpath(fusemoe.library_path()) != os.path.join(package, _capi.LIBRARY_NAME):
    problems.append(f"library path {fusemoe.library_path()}, expected the bundled one in {package}")
lib = _capi.load()
version = lib.fusemoe_c_abi_version()
if version != _capi.ABI_VERSION:
    problems.append(f"C ABI version {version}, the binding needs {_capi.ABI_VERSION}")
for name, cls in _capi.STRUCTS.items():
    if _capi.library_struct_layout(name) != _capi.binding_struct_layout(name):
        problems.append(f"{name}: layout differs between the library and ctypes")
_capi.impl_code("fused")
status = fusemoe.native_binding_status()
bundled = os.path.join(package, _native.LIBRARY_NAME)
if expected == "native" and not status.startswith(f"native: {bundled}"):
    problems.append(f"expected the bundled native binding, got: {status}")
if expected == "ctypes" and (os.path.exists(bundled) or not status.startswith("ctypes:")):
    problems.append(f"expected the ctypes path and no {bundled}, got: {status}")
if problems:
    print("[wheel] FAIL: " + "; ".join(problems))
    sys.exit(1)
print(f"[wheel] pass: import fusemoe loads {fusemoe.library_path()} (C ABI {version}), "
      f"no FUSEMOE_LIBRARY; {status}")
PYCODE
  )
}

build_and_check isolated ctypes
if ! "$PY" -c "import scikit_build_core" 2>/dev/null; then
  log "installing scikit-build-core from PyPI (pip wheel --no-build-isolation needs it)"
  "$PY" -m pip install -q scikit-build-core
fi
build_and_check native native --no-build-isolation
mkdir -p "$WHEEL_DIR"
rm -f "$WHEEL_DIR"/fusemoe-*.whl
cp "$SCRATCH"/native/wheel/fusemoe-*.whl "$WHEEL_DIR"/
