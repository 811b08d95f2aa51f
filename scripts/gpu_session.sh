#!/usr/bin/env bash
# A whole GPU session on the H200 machine in two phases, for a device tool that ends each command
# at 600 s but keeps detached processes alive while the machine stays warm:
#   phase 1, sharing the GPU (correctness only): the sustained run (fusemoe_soak_test, 235B
#     T=16384, SOAK_S seconds) beside `ROUND_PARTS=tests,sanitizers` and the training comparison
#     (`ROUND_PARTS=train`, TRAIN_PRECISION as given);
#   phase 2, alone (timings, and pytest, which crawls when it shares the GPU): `ROUND_PARTS=bench`,
#     `ROUND_PARTS=pytest`, then the TFLOP/s sweep (TFLOPS=1) and scripts/compare_builds.sh over
#     COMPARE_BUILDS ("name=binary ..." with the carried build's fusemoe_bench first) if given.
# Start it detached, then collect in later calls, each within the machine's idle window:
#   scripts/gpu_session.sh start OUTDIR          # returns at once; the session runs on
#   scripts/gpu_session.sh wait OUTDIR SECONDS [MARKER] [ARCHIVE]
#       waits until OUTDIR/MARKER exists (default session.done) or SECONDS pass, prints the
#       progress, and packs OUTDIR into ARCHIVE (a .tar.gz) if given.
# Markers: phase1.done, phase2.done (= session.done). Measured on 2026-12-01 (third session):
# phase 1 ~11 min, phase 2 ~13 min with Liger's step at 150 s; 1700 s of device time in all.
# Env: BUILD_DIR (build), SOAK_S (615), TRAIN_PRECISION (bf16), TFLOPS (1), COMPARE_BUILDS,
# and what gpu_round.sh reads (FUSEMOE_COMMIT, LIGER_TIMEOUT_S, ...).
set -u -o pipefail
usage() {
  echo "usage: $0 start OUTDIR | $0 wait OUTDIR SECONDS [MARKER] [ARCHIVE]" >&2
  exit 2
}
[[ $# -ge 2 ]] || usage
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
mode="$1"
mkdir -p "$2"
OUTDIR="$(cd "$2" && pwd -P)"

case "$mode" in
  start)
    setsid nohup bash "$REPO/scripts/gpu_session.sh" run "$OUTDIR" >"$OUTDIR/session.out" 2>&1 </dev/null &
    echo "gpu_session: started (pid $!), output in $OUTDIR"
    exit 0
    ;;
  wait)
    [[ $# -ge 3 ]] || usage
    end=$((SECONDS + $3))
    marker="${4:-session.done}"
    while ((SECONDS < end)) && [[ ! -e "$OUTDIR/$marker" ]]; do sleep 5; done
    cat "$OUTDIR/progress.log" 2>/dev/null
    tail -n 2 "$OUTDIR/soak.log" 2>/dev/null
    if [[ $# -ge 5 ]]; then
      tar czf "$5" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" && echo "packed into $5"
    fi
    [[ -e "$OUTDIR/$marker" ]]
    exit $?
    ;;
  run) ;;
  *) usage ;;
esac

cd "$REPO" || exit 2
BUILD_DIR="${BUILD_DIR:-build}"
export BUILD_DIR PYTHONUNBUFFERED=1
log() { echo "[session $(date -u +%H:%M:%S)] $*" >>"$OUTDIR/progress.log"; }
log "start: build $BUILD_DIR, commit ${FUSEMOE_COMMIT:-$(bash scripts/project_commit.sh)}"

# ---- phase 1: sharing the GPU ----
(
  "$BUILD_DIR/fusemoe_soak_test" --preset qwen3-235b-a22b --tokens 16384 --seconds "${SOAK_S:-615}" \
    >"$OUTDIR/soak.log" 2>&1
  log "soak exit $?"
) &
soak=$!
sleep 5  # the soak's first window alone
(
  ROUND_PARTS=tests,sanitizers bash scripts/gpu_round.sh "$OUTDIR/tests" >"$OUTDIR/tests.out" 2>&1
  log "tests and sanitizers exit $?"
) &
tests=$!
ROUND_PARTS=train bash scripts/gpu_round.sh "$OUTDIR/train" >"$OUTDIR/train.out" 2>&1
log "training comparison (${TRAIN_PRECISION:-bf16}) exit $?"
wait "$tests" "$soak"
touch "$OUTDIR/phase1.done"
log "phase 1 done"

# ---- phase 2: alone ----
ROUND_PARTS=bench bash scripts/gpu_round.sh "$OUTDIR/bench" >"$OUTDIR/bench.out" 2>&1
log "benchmarks exit $?"
ROUND_PARTS=pytest bash scripts/gpu_round.sh "$OUTDIR/pytest" >"$OUTDIR/pytest.out" 2>&1
log "pytest exit $?"
if [[ "${TFLOPS:-1}" == 1 ]]; then
  bash scripts/tflops_round.sh "$OUTDIR/tflops" >"$OUTDIR/tflops.out" 2>&1
  log "TFLOP/s sweep exit $?"
fi
if [[ -n "${COMPARE_BUILDS:-}" ]]; then
  # shellcheck disable=SC2086  # a list of name=binary
  bash scripts/compare_builds.sh "$OUTDIR/compare" $COMPARE_BUILDS >"$OUTDIR/compare.out" 2>&1
  log "compare_builds exit $?"
fi
touch "$OUTDIR/phase2.done" "$OUTDIR/session.done"
log "session done"
