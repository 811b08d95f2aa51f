#!/usr/bin/env bash
# Times several builds of fusemoe_bench against each other on the GPU, interleaved: every round
# runs every case with every build (the builds' order rotating from round to round), so clock
# drift spreads over all of them; the summary gives each build's median over the rounds and its
# ratio to the first build.
#   usage: scripts/compare_builds.sh OUTDIR NAME=BENCH_BINARY [NAME=BENCH_BINARY ...]
# Env: ROUNDS (2), ITERS (20), WARMUP (5), IMPLS (fused,fused_saved_z),
#      CASES ("qwen3-30b-a3b:4096,16384 qwen3-235b-a22b:16384"), KERNEL_TIMES (unset; 1: every run
#      with --kernel-times, and OUTDIR/kernel_times.md puts each kernel's in-layer time of every
#      build and round side by side, scripts/kernel_times_table.py). Timings only (--no-check): the
#      correctness of each build is the GPU round's business.
# With more than one impl, builds from 2dff31e on time them one after another (--timing per-impl),
# older ones interleaved: compare such builds with one impl, or within one method.
# Writes OUTDIR/compare.json (every run) and OUTDIR/compare.md (the table), and prints the table.
set -u -o pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 OUTDIR NAME=BENCH_BINARY [NAME=BENCH_BINARY ...]" >&2
  exit 2
fi
OUTDIR="$1"
shift
mkdir -p "$OUTDIR"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
ROUNDS="${ROUNDS:-2}"
ITERS="${ITERS:-20}"
WARMUP="${WARMUP:-5}"
IMPLS="${IMPLS:-fused,fused_saved_z}"
read -r -a CASES <<<"${CASES:-qwen3-30b-a3b:4096,16384 qwen3-235b-a22b:16384}"
BUILDS=("$@")
PARTS="$(mktemp -d /tmp/fusemoe_compare.XXXXXX)"
status=0
for ((round = 0; round < ROUNDS; ++round)); do
  for ((ci = 0; ci < ${#CASES[@]}; ++ci)); do
    spec="${CASES[$ci]}"
    preset="${spec%%:*}"
    tokens="${spec#*:}"
    # The case's index in the part's name: a preset listed twice (two token specs) keeps both.
    part="$PARTS/${round}_${preset}_c${ci}"
    for ((i = 0; i < ${#BUILDS[@]}; ++i)); do
      build="${BUILDS[$(((i + round) % ${#BUILDS[@]}))]}"
      name="${build%%=*}"
      binary="${build#*=}"
      echo "[compare] round $round $preset T=$tokens: $name" >&2
      if ! "$binary" --preset "$preset" --tokens "$tokens" --impl "$IMPLS" --iters "$ITERS" --warmup "$WARMUP" \
        --no-check ${KERNEL_TIMES:+--kernel-times} --json "${part}_${name}.json" >"${part}_${name}.log" 2>&1; then
        echo "[compare] $name failed on $preset (log: ${part}_${name}.log)" >&2
        tail -5 "${part}_${name}.log" >&2
        status=1
      fi
    done
  done
done
python3 "$REPO/scripts/summarize_compare.py" "$PARTS" "$OUTDIR" "${BUILDS[@]%%=*}" || status=1
if [[ -n "${KERNEL_TIMES:-}" ]]; then
  # One column per (build, round), its cases' files together; the first build's first round is
  # the base of the ratios.
  runs=()
  for ((round = 0; round < ROUNDS; ++round)); do
    for ((i = 0; i < ${#BUILDS[@]}; ++i)); do
      name="${BUILDS[$i]%%=*}"
      files=""
      for ((ci = 0; ci < ${#CASES[@]}; ++ci)); do
        spec="${CASES[$ci]}"
        file="$PARTS/${round}_${spec%%:*}_c${ci}_${name}.json"
        [[ -f "$file" ]] && files+="${files:+,}$file"
      done
      [[ -n "$files" ]] && runs+=("${name}.r${round}=$files")
    done
  done
  python3 "$REPO/scripts/kernel_times_table.py" "${runs[@]}" >"$OUTDIR/kernel_times.md" || status=1
fi
rm -rf "$PARTS"
exit $status
