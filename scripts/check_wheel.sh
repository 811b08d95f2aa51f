#!/usr/bin/env bash
# The package as `pip install .` makes it: builds the wheel from this checkout (scikit-build-core
# runs CMake for libfusemoe_c.so), installs it into a scratch folder, and from outside the
# repository, with FUSEMOE_LIBRARY unset, checks that `import fusemoe` loads the bundled library
# and that its C ABI version is the binding's. No GPU needed.
#   usage: scripts/check_wheel.sh [PYTHON]   (default python3; it must have torch)
# Exit 0 when the check passed; the wheel is left in ${FUSEMOE_WHEEL_DIR:-build/wheelhouse}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
# A path relative to the repository stays valid after the cd below.
if [[ "$PY" == */* ]]; then PY="$(cd "$(dirname "$PY")" && pwd -P)/$(basename "$PY")"; fi
WHEEL_DIR="${FUSEMOE_WHEEL_DIR:-build/wheelhouse}"
SCRATCH="$(mktemp -d /tmp/fusemoe_wheel.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

log() { echo "[wheel] $*"; }

rm -f "$WHEEL_DIR"/fusemoe-*.whl
log "pip wheel . -> $WHEEL_DIR"
"$PY" -m pip wheel -q --no-deps -w "$WHEEL_DIR" . >"$SCRATCH/pip_wheel.log" 2>&1 ||
  { cat "$SCRATCH/pip_wheel.log"; exit 1; }
wheel="$(ls "$WHEEL_DIR"/fusemoe-*.whl)"
log "built $(basename "$wheel")"
"$PY" -m pip install -q --no-deps --target "$SCRATCH/site" "$wheel"
cd "$SCRATCH"
env -u FUSEMOE_LIBRARY PYTHONPATH="$SCRATCH/site" "$PY" - "$SCRATCH/site" <<'PYCODE'
import os
import sys

import fusemoe
from fusemoe import _capi

site = os.path.realpath(sys.argv[1])
expected = os.path.join(site, "fusemoe", "libfusemoe_c.so")
problems = []
if os.path.realpath(fusemoe.__file__) != os.path.join(site, "fusemoe", "__init__.py"):
    problems.append(f"imported fusemoe from {fusemoe.__file__}, not the wheel")
if os.path.realpath(fusemoe.library_path()) != expected:
    problems.append(f"library path {fusemoe.library_path()}, expected the bundled {expected}")
lib = _capi.load()
version = lib.fusemoe_c_abi_version()
if version != _capi.ABI_VERSION:
    problems.append(f"C ABI version {version}, the binding needs {_capi.ABI_VERSION}")
for name, cls in _capi.STRUCTS.items():
    if _capi.library_struct_layout(name) != _capi.binding_struct_layout(name):
        problems.append(f"{name}: layout differs between the library and ctypes")
_capi.impl_code("fused")
if problems:
    print("[wheel] FAIL: " + "; ".join(problems))
    sys.exit(1)
print(f"[wheel] pass: import fusemoe loads {fusemoe.library_path()} (C ABI {version}), "
      "no FUSEMOE_LIBRARY")
PYCODE
