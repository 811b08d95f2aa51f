#!/usr/bin/env bash
# What bounds each kernel of the fused layer (issue 19: "where a target is missed, a profile that
# shows what bounds it and by how much"): Nsight Compute's time, tensor-pipe, DRAM and L2
# throughput, DRAM bytes and SM clock for every fusemoe kernel of one fusemoe_bench run per case
# (caches flushed, clocks as found), then scripts/bound_table.py over them. On the H200 machine;
# ~15-30 s per case (measured 2026-12-02, six cases in 105 s).
#   usage: scripts/profile_bounds.sh OUTDIR [PRESET:TOKENS[:ROUTING] ...]
#   default cases: issue 19's rows (30B T=4096 and T=16384 uniform and skewed, 235B T=16384,
#   qwen3-next T=16384, deepseek-v3 T=8192)
# Writes OUTDIR/bounds_<preset>_<tokens>_<routing>.csv (the bench's output and ncu's CSV rows) and
# OUTDIR/bounds.md (the tables), and prints the tables. Env: BUILD_DIR (build), IMPL (fused_saved_z).
set -u -o pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUTDIR [PRESET:TOKENS[:ROUTING] ...]" >&2
  exit 2
fi
OUTDIR="$1"
shift
CASES=("$@")
if [[ ${#CASES[@]} -eq 0 ]]; then
  CASES=(qwen3-30b-a3b:4096 qwen3-30b-a3b:16384 qwen3-30b-a3b:16384:skewed qwen3-235b-a22b:16384
         qwen3-next:16384 deepseek-v3:8192)
fi
BUILD_DIR="${BUILD_DIR:-build}"
IMPL="${IMPL:-fused_saved_z}"
METRICS=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
METRICS+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed
METRICS+=,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second
mkdir -p "$OUTDIR"
files=()
status=0
for spec in "${CASES[@]}"; do
  IFS=: read -r preset tokens routing <<<"$spec"
  routing="${routing:-uniform}"
  out="$OUTDIR/bounds_${preset}_${tokens}_${routing}.csv"
  # -c 45: the bench's first forward, backward (fp32 weight gradients), forward+backward and
  # backward with bf16 weight gradients, with its routing kernels.
  if timeout 300 ncu --clock-control none --cache-control all --kernel-name-base demangled -k regex:fusemoe -c 45 \
    --metrics "$METRICS" --csv "$BUILD_DIR/fusemoe_bench" --preset "$preset" --tokens "$tokens" --routing "$routing" \
    --impl "$IMPL" --iters 1 --warmup 0 --no-check >"$out" 2>"$out.err"; then
    files+=("$out")
  else
    echo "profile_bounds: ncu failed on $spec (log: $out.err)" >&2
    tail -5 "$out.err" >&2
    status=1
  fi
done
if [[ ${#files[@]} -gt 0 ]]; then
  python3 "$(dirname "${BASH_SOURCE[0]}")/bound_table.py" "${files[@]}" | tee "$OUTDIR/bounds.md" || status=1
fi
exit $status
