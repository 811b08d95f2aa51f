#!/usr/bin/env bash
# The README's main command: set up and build, then run the benchmark of the default
# Qwen3-30B-A3B layer (fusemoe implementations vs baselines, with a correctness check first) and,
# where python3 has PyTorch, the PyTorch path on the same GPU for the "vs PyTorch" figures.
# Extra arguments go to the benchmark, e.g. `bash scripts/run_main.sh --tokens 4096,16384`.
# Without a Hopper GPU the build still completes and the benchmark explains why it cannot run
# (exit code 3).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${FUSEMOE_BUILD_DIR:-build}"
bash scripts/setup.sh
# The project's own commit, or "unknown" outside a git checkout of it (never a parent folder's).
export FUSEMOE_COMMIT="${FUSEMOE_COMMIT:-$(bash scripts/project_commit.sh)}"
# Where PyTorch is installed, the PyTorch path runs in the same job and each fusemoe figure is
# printed with "vs PyTorch" beside it (benchmarks/compare_torch.py; exit 5 if only PyTorch failed).
if python3 -c "import torch" 2>/dev/null; then
  exec python3 benchmarks/compare_torch.py --bench "$BUILD_DIR/fusemoe_bench" -- "$@"
fi
echo "[main] python3 has no PyTorch: fusemoe figures only (install PyTorch for the vs PyTorch" \
     "comparison)" >&2
exec "$BUILD_DIR/fusemoe_bench" "$@"
