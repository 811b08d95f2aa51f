#!/usr/bin/env bash
# The README's main command: set up and build, then run the benchmark of the default
# Qwen3-30B-A3B layer (fusemoe implementations vs baselines, with a correctness check first).
# Extra arguments go to the benchmark, e.g. `bash scripts/run_main.sh --tokens 4096,16384`.
# Without a Hopper GPU the build still completes and the benchmark explains why it cannot run
# (exit code 3).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${FUSEMOE_BUILD_DIR:-build}"
bash scripts/setup.sh
# The report names the commit the build recorded from this checkout (or $FUSEMOE_COMMIT if set).
exec "$BUILD_DIR/fusemoe_bench" "$@"
