# Sourced by the GPU round scripts: OUTDIR from the first argument (created, made absolute), the
# repository as the working folder, BUILD_DIR (default build), ITERS and WARMUP, and the commit the
# results record (FUSEMOE_COMMIT, exported).
#   usage (in a script): source "$(dirname "${BASH_SOURCE[0]}")/round_setup.sh" "$@"; shift
if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUTDIR ${ROUND_USAGE_REST:-}" >&2
  exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
mkdir -p "$1"
OUTDIR="$(cd "$1" && pwd -P)"
cd "$REPO" || exit 2
BUILD_DIR="${BUILD_DIR:-build}"
ITERS="${ITERS:-$DEFAULT_ITERS}"
WARMUP="${WARMUP:-$DEFAULT_WARMUP}"
# The project's own commit (never a parent folder's repository), "-dirty" with local changes;
# in a copy that is no checkout of its own, the commit a carried build recorded from its source
# checkout (cmake/commit_id.cmake), if there is one.
FUSEMOE_COMMIT="${FUSEMOE_COMMIT:-$(bash scripts/project_commit.sh)}"
if [[ "$FUSEMOE_COMMIT" == unknown && -s "$BUILD_DIR/fusemoe_commit.txt" ]]; then
  FUSEMOE_COMMIT="$(head -1 "$BUILD_DIR/fusemoe_commit.txt")"
fi
export FUSEMOE_COMMIT
