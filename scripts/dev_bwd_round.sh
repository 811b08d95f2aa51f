#!/usr/bin/env bash
# Dev round for the sm90 backward GEMMs (src/kernels/sm90_moe_backward_gemm.cu) and the fused
# backward launcher (src/launch/fused_moe_backward.cu).
#   build (CPU machine, nvcc 13, at most 2 compile jobs):   bash scripts/dev_bwd_round.sh --build
#     (the CMake target fusemoe_test_sm90_moe_backward_gemm, in build-dev-bwd/)
#   GPU round (device tool, carry=["build-dev-bwd"]):      bash scripts/dev_bwd_round.sh
#     SASS op summary, test + timing log to $OUT/test.log; --sanitize adds compute-sanitizer
#     memcheck of the small kernel cases ($OUT/memcheck.log).
set -uo pipefail
build=build-dev-bwd
out=${OUT:-/tmp/dev_bwd_out}

if [[ " $* " == *" --build "* ]]; then
  set -e
  # The CMake target (same sources and flags as the library); ptxas report of the kernels.
  [[ -f "$build/build.ninja" ]] || cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C "$build" -j2 fusemoe_test_sm90_moe_backward_gemm
  cp "$build/fusemoe_test_sm90_moe_backward_gemm" "$build/test_sm90_moe_backward_gemm"
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -Iinclude -Isrc \
    -Xptxas -v -c src/kernels/sm90_moe_backward_gemm.cu -o /dev/null 2>&1 |
    grep -E "error|warning|registers|spill|C75[0-9][0-9]" || true
  exit 0
fi

mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# SASS (cuobjdump exists on the GPU machine only): tensor-core and local-memory instructions.
cuobjdump --dump-sass "$build/test_sm90_moe_backward_gemm" | awk '
  /Function :/ { fn = $3 }
  /HGMMA|LDL|STL|UTMALDG|BAR.SYNC/ {
    op = $2; if (op ~ /^@/) op = $3; split(op, a, "."); count[fn " " a[1]]++ }
  END { for (k in count) print count[k], k }' | sort -k2 > "$out/sass_summary.txt"
cat "$out/sass_summary.txt"
timeout 95 "$build/test_sm90_moe_backward_gemm" > "$out/test.log" 2>&1 || status=$?
grep -E "FAIL|HANG|PASSED|FAILED|^\||timing|backward|TF/s|exception|stages|determinism|BN=256|routing" "$out/test.log" | head -120
if [[ " $* " == *" --sanitize "* ]]; then
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 "$build/test_sm90_moe_backward_gemm" --quick \
    > "$out/memcheck.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|PASSED|FAILED|Invalid" "$out/memcheck.log" | head -20
fi
exit $status
