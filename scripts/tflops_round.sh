#!/usr/bin/env bash
# The figures behind docs/img/tflops_vs_tokens.png: fusemoe_bench and the PyTorch path
# (benchmarks/torch_baseline.py) for both presets at 1024 to 65536 tokens per call, uniform
# routing, one JSON file each into OUTDIR, then the chart (scripts/plot_tflops.py) where
# matplotlib is installed (else draw it later from OUTDIR's JSON).
#   usage: scripts/tflops_round.sh OUTDIR [PRESET...]   (default: both presets)
# Env: BUILD_DIR (build), ITERS (10), WARMUP (3), TOKENS (1024,...,65536), CHECK_MAX_TOKENS
# (4096: the fp32 reference check of the larger T takes minutes), CHART (OUTDIR/tflops_vs_tokens.png).
# About 2 to 3 minutes per preset on an H200. Exit 0 only if every run passed.
set -u -o pipefail
ROUND_USAGE_REST="[PRESET...]" DEFAULT_ITERS=10 DEFAULT_WARMUP=3
source "$(dirname "${BASH_SOURCE[0]}")/round_setup.sh" "$@"
shift
PRESETS=("$@")
[[ ${#PRESETS[@]} -eq 0 ]] && PRESETS=(qwen3-30b-a3b qwen3-235b-a22b)
TOKENS="${TOKENS:-1024,2048,4096,8192,16384,32768,65536}"
status=0
for preset in "${PRESETS[@]}"; do
  echo "[tflops] $preset: fusemoe_bench, T=$TOKENS"
  "$BUILD_DIR/fusemoe_bench" --preset "$preset" --tokens "$TOKENS" --iters "$ITERS" \
    --warmup "$WARMUP" --check-max-tokens "${CHECK_MAX_TOKENS:-4096}" \
    --json "$OUTDIR/fusemoe_$preset.json" >"$OUTDIR/fusemoe_$preset.log" 2>&1 || status=1
  tail -n 3 "$OUTDIR/fusemoe_$preset.log"
  echo "[tflops] $preset: torch_baseline, T=$TOKENS"
  python3 benchmarks/torch_baseline.py --preset "$preset" --tokens "$TOKENS" --iters "$ITERS" \
    --warmup "$WARMUP" --json "$OUTDIR/torch_$preset.json" >"$OUTDIR/torch_$preset.log" 2>&1 ||
    status=1
  tail -n 3 "$OUTDIR/torch_$preset.log"
done
if python3 -c "import matplotlib" 2>/dev/null; then
  python3 scripts/plot_tflops.py "$OUTDIR"/fusemoe_*.json "$OUTDIR"/torch_*.json \
    --out "${CHART:-$OUTDIR/tflops_vs_tokens.png}" || status=1
else
  echo "[tflops] matplotlib missing: draw later with scripts/plot_tflops.py $OUTDIR"
fi
exit $status
