#!/usr/bin/env bash
# One GPU round for the sm90 grouped GEMMs (run on the H200 through the device tool, with the
# prebuilt build-dev-gemm/ carried): SASS summary, correctness + timing of the default build
# and of the variant builds present, optional ncu of one kernel. Everything lands in $OUT.
#   build (on the CPU machine; needs nvcc 13, links cuBLAS dynamically):
#     bash scripts/dev_gemm_round.sh --build
#   GPU round (device tool, carry=["build-dev-gemm"]):
#     bash scripts/dev_gemm_round.sh [--sanitize] [--ncu]
set -uo pipefail
build=build-dev-gemm
out=${OUT:-/tmp/dev_gemm_out}
status=0

if [[ " $* " == *" --build "* ]]; then
  set -e
  # The CMake target (same sources and flags as the library); ptxas report of the kernels.
  [[ -f "$build/build.ninja" ]] || cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C "$build" -j2 fusemoe_test_sm90_moe_gemm
  cp "$build/fusemoe_test_sm90_moe_gemm" "$build/test_sm90_moe_gemm"
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -Iinclude -Isrc \
    -Xptxas -v -c src/kernels/sm90_moe_gemm.cu -o /dev/null 2>&1 | grep -E "registers|spill|C75[0-9][0-9]" || true
  exit 0
fi
mkdir -p "$out"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

# SASS: the tensor-core instructions and any local-memory traffic per kernel.
for bin in "$build"/test_sm90_moe_gemm*; do
  [ -x "$bin" ] || continue
  cuobjdump --dump-sass "$bin" | awk '
    /Function :/ { fn = $3 }
    /HGMMA|LDL|STL|UTMALDG|STG.E|SHFL|WARPSYNC|SYNCS/ {
      op = $2; if (op ~ /^@/) op = $3; split(op, a, "."); key = fn " " a[1]; count[key]++ }
    END { for (k in count) print count[k], k }' | sort -k2 > "$out/sass_$(basename "$bin").txt"
done
echo "== SASS op counts (default build)"; cat "$out/sass_test_sm90_moe_gemm.txt" 2>/dev/null | grep -v "ref_\|fill_\|compare\|count_"

echo "== default build"
timeout 240 "$build/test_sm90_moe_gemm" 2>&1 | tee "$out/test.log" || status=1
for variant in "$build"/test_sm90_moe_gemm_*; do
  [ -x "$variant" ] || continue
  echo "== variant $(basename "$variant")"
  timeout 150 "$variant" 2>&1 | tee "$out/$(basename "$variant").log" | grep -E "FAIL|PASSED|FAILED|^\|" || status=1
done

if [[ " $* " == *" --sanitize "* ]]; then
  echo "== compute-sanitizer memcheck (small cases)"
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$build/test_sm90_moe_gemm" --no-large \
    > "$out/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|PASSED|FAILED|Invalid|error" "$out/memcheck.log" | head -20
fi

if [[ " $* " == *" --ncu "* ]]; then
  timeout 200 ncu --clock-control none -k regex:moe_gemm_kernel --launch-skip 0 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    "$build/test_sm90_moe_gemm" --only "30B T16384 uniform" --no-check > "$out/ncu.txt" 2>&1
  grep -E "moe_gemm_kernel|Duration|Throughput|Stall|Issued|Eligible" "$out/ncu.txt" | head -60
fi
exit $status
