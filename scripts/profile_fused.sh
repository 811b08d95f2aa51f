#!/usr/bin/env bash
# Per-kernel durations of one fused forward (and one unfused forward) under Nsight Compute, on
# the H200 machine: caches flushed before every kernel (--cache-control all), clocks left as
# found (--clock-control none). Usage: scripts/profile_fused.sh OUTDIR [preset] [tokens]
set -u -o pipefail
OUTDIR="$1"
PRESET="${2:-qwen3-30b-a3b}"
TOKENS="${3:-16384}"
BUILD_DIR="${BUILD_DIR:-build}"
for impl in fused unfused; do
  ncu --clock-control none --cache-control all --metrics gpu__time_duration.sum \
    --kernel-name-base demangled -k 'regex:routing|gather|combine|swiglu|Gemm|gemm|sm90' \
    --csv "$BUILD_DIR/fusemoe_bench" --preset "$PRESET" --tokens "$TOKENS" --impl "$impl" \
    --iters 1 --warmup 0 --no-check >"$OUTDIR/ncu_${impl}_${PRESET}_${TOKENS}.csv" 2>"$OUTDIR/ncu_${impl}.err"
  python3 - "$OUTDIR/ncu_${impl}_${PRESET}_${TOKENS}.csv" "$(dirname "${BASH_SOURCE[0]}")" <<'PY'
import csv, sys
sys.path.insert(0, sys.argv[2])
from bound_table import TIME_UNITS as scale  # ncu's time units -> µs, one table for both scripts
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
ki, mi, vi = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
ui = head.index("Metric Unit")
print(sys.argv[1])
total = 0.0
for r in body:
    if r[mi] != "gpu__time_duration.sum": continue
    us = float(r[vi].replace(",", "")) * scale.get(r[ui], float("nan"))
    total += us
    print(f"  {us:9.1f} us  {r[ki][:110]}")
print(f"  {total:9.1f} us  total")
PY
done
