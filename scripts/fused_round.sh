#!/usr/bin/env bash
# One GPU round for the fused forward on the H200 (device tool, carry=["build"], prebuilt here):
#   1. facts: GPU, power and clock state, SASS op counts of the sm90 GEMM variants  -> gpu.txt
#   2. fused GPU tests (gtest Fused*)                                                -> tests.log
#   3. sm90 GEMM test: checks, then timings of direct vs pool dispatch               -> gemm.log
#   4. fusemoe_bench, both presets, T = 4096 and 16384, unfused and fused             -> bench.log
#   5. gap diagnosis, Qwen3-235B T=16384: a sustained fused run (100 timed calls)
#      while nvidia-smi samples SM clock, power and throttle reasons every 50 ms      -> gap.log,
#      clocks.csv (the sampler runs from step 2 on; every log line carries a wall-clock stamp)
#   6. Nsight Compute: duration and SM clock of every kernel of one fused forward
#      (caches flushed, clocks as found), 235B and 30B at T=16384                    -> ncu.csv
#   7. compute-sanitizer memcheck over the sm90 GEMM test's small cases              -> memcheck.log
# Usage: scripts/fused_round.sh OUTDIR   (at most 8 files land in OUTDIR)
set -u -o pipefail
OUTDIR="${1:?usage: scripts/fused_round.sh OUTDIR}"
BUILD_DIR="${BUILD_DIR:-build}"
mkdir -p "$OUTDIR"
status=0

stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%H:%M:%S.%3N)" "$line"; done; }
step() {  # step NAME LIMIT_S LOG CMD...: runs CMD with stamped output appended to LOG
  local name="$1" limit="$2" log="$3" start=$SECONDS rc
  shift 3
  echo "== $name: $*" | stamp | tee -a "$OUTDIR/$log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | stamp >>"$OUTDIR/$log"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s" | stamp | tee -a "$OUTDIR/$log"
  [[ $rc -eq 0 ]] || status=1
}

# ---- 1. facts
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,power.limit,power.draw,temperature.gpu --format=csv
  nvidia-smi -q -d POWER,CLOCK,PERFORMANCE
  for bin in "$BUILD_DIR/fusemoe_test_sm90_moe_gemm"; do
    cuobjdump --dump-sass "$bin" | awk '
      /Function :/ { fn = $3 }
      /HGMMA|LDL|STL|UTMALDG|SYNCS/ {
        op = $2; if (op ~ /^@/) op = $3; split(op, a, "."); if (fn ~ /moe_gemm/) count[fn " " a[1]]++ }
      END { for (k in count) print count[k], k }' | sort -k2
  done
} >"$OUTDIR/gpu.txt" 2>&1
head -2 "$OUTDIR/gpu.txt"

reason=clocks_event_reasons.active
nvidia-smi --query-gpu=$reason --format=csv,noheader >/dev/null 2>&1 || reason=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,$reason \
  --format=csv -lms 50 >"$OUTDIR/clocks.csv" 2>&1 &
sampler=$!

# ---- 2-4. tests and benchmarks
step "fused tests" 150 tests.log "$BUILD_DIR/fusemoe_gpu_tests" --gtest_filter='Fused*'
step "sm90 gemm test + timing" 200 gemm.log "$BUILD_DIR/fusemoe_test_sm90_moe_gemm"
step "bench 30B" 150 bench.log "$BUILD_DIR/fusemoe_bench" --preset qwen3-30b-a3b --tokens 4096,16384 \
  --impl unfused,fused
step "bench 235B" 200 bench.log "$BUILD_DIR/fusemoe_bench" --preset qwen3-235b-a22b --tokens 4096,16384 \
  --impl unfused,fused --check-max-tokens 4096

# ---- 5. sustained fused run under the sampler
step "gap: 235B T=16384 fused, 100 timed calls" 120 gap.log "$BUILD_DIR/fusemoe_bench" \
  --preset qwen3-235b-a22b --tokens 16384 --impl fused --iters 100 --warmup 10 --no-check
kill "$sampler" 2>/dev/null
wait "$sampler" 2>/dev/null

# ---- 6. per-kernel durations and SM clocks
for preset in qwen3-235b-a22b qwen3-30b-a3b; do
  echo "# $preset T=16384" >>"$OUTDIR/ncu.csv"
  timeout --kill-after=10 150 ncu --clock-control none --cache-control all \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max \
    --kernel-name-base demangled -k 'regex:routing|gather|moe_gemm|combine' --launch-count 16 --csv \
    "$BUILD_DIR/fusemoe_bench" --preset "$preset" --tokens 16384 --impl fused --iters 1 --warmup 0 \
    --no-check >>"$OUTDIR/ncu.csv" 2>&1 || status=1
done
step "memcheck (small cases)" 60 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BUILD_DIR/fusemoe_test_sm90_moe_gemm" --no-large --no-timing
echo "round exit $status"
exit $status
