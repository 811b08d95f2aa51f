#!/usr/bin/env bash
# Where one kernel's warps stall, instruction by instruction: Nsight Compute's PC sampling
# (SourceCounters) and warp-state sections over ONE launch of the kernel whose name matches
# KERNEL_REGEX inside a fusemoe_bench run, on the H200 machine; clocks left as found. Made for
# the FP8 GEMMs, whose tensor pipe idles two thirds of the time (docs/perf_log.md#fp8-from-its-first-figures-to-the-sixth-session-2026-12-01).
#   usage: scripts/profile_stalls.sh OUTDIR [KERNEL_REGEX] [IMPL] [PRESET] [TOKENS]
#   defaults: GateUp, fused_fp8_saved_z, qwen3-30b-a3b, 16384
# Writes OUTDIR/stalls_<IMPL>.ncu-rep (open it in Nsight Compute), stalls_<IMPL>_details.csv (the
# sections), stalls_<IMPL>_source.csv (SASS with per-instruction counters) and prints the SASS
# lines holding the most stall samples, with opcode totals (scripts/stall_table.py).
set -u -o pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUTDIR [KERNEL_REGEX] [IMPL] [PRESET] [TOKENS]" >&2
  exit 2
fi
OUTDIR="$1"
KERNEL="${2:-GateUp}"
IMPL="${3:-fused_fp8_saved_z}"
PRESET="${4:-qwen3-30b-a3b}"
TOKENS="${5:-16384}"
BUILD_DIR="${BUILD_DIR:-build}"
mkdir -p "$OUTDIR"
REP="$OUTDIR/stalls_${IMPL}"
# -c 1 after --launch-skip 1: the second matching launch, so the first call's one-time work
# (tensor-map creation, first-touch of the workspace) is not what is sampled.
ncu --clock-control none --section SourceCounters --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section SpeedOfLight --kernel-name-base demangled \
  -k "regex:$KERNEL" --launch-skip 1 -c 1 -f -o "$REP" \
  "$BUILD_DIR/fusemoe_bench" --preset "$PRESET" --tokens "$TOKENS" --impl "$IMPL" \
  --iters 2 --warmup 0 --no-check >"$REP.log" 2>&1 || {
  echo "ncu failed (log: $REP.log)" >&2
  tail -20 "$REP.log" >&2
  exit 1
}
ncu --import "$REP.ncu-rep" --page details --csv >"${REP}_details.csv" 2>>"$REP.log"
ncu --import "$REP.ncu-rep" --page source --csv --print-source sass >"${REP}_source.csv" 2>>"$REP.log"
python3 "$(dirname "${BASH_SOURCE[0]}")/stall_table.py" "${REP}_source.csv"
