#!/usr/bin/env bash
# Dev round for the sm90 backward GEMMs (src/kernels/sm90_moe_backward_gemm.cu) and the fused
# backward launcher (src/launch/fused_moe_backward.cu).
#   build (CPU machine, nvcc 13, at most 2 compile jobs):   bash scripts/dev_bwd_round.sh --build
#     The rest of the library is compiled from a snapshot of HEAD (build-dev-bwd/snap), so
#     edits in progress elsewhere in the tree do not enter this build.
#   GPU round (device tool, carry=["build-dev-bwd"]):      bash scripts/dev_bwd_round.sh
#     SASS op summary, test + timing log to $OUT/test.log; --sanitize adds compute-sanitizer
#     memcheck of the small kernel cases ($OUT/memcheck.log).
set -uo pipefail
build=build-dev-bwd
out=${OUT:-/tmp/dev_bwd_out}

if [[ " $* " == *" --build "* ]]; then
  set -e
  mkdir -p "$build/snap" "$build/obj"
  if [[ ! -f "$build/snap/HEAD" || "$(cat "$build/snap/HEAD")" != "$(git rev-parse HEAD)" ]]; then
    rm -rf "$build/snap"/* "$build"/obj/lib_*
    git archive HEAD src include | tar -x -C "$build/snap"
    git rev-parse HEAD > "$build/snap/HEAD"
  fi
  flags="-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr"
  inc="-I$build/snap/include -I$build/snap/src -Isrc -Iinclude"
  # Library objects from the snapshot (built once per HEAD).
  lib_objs=()
  for f in api/api.cpp kernels/routing.cu kernels/moe_elementwise.cu launch/unfused_moe.cu launch/fused_moe.cu \
           kernels/sm90_moe_gemm.cu; do
    o="$build/obj/lib_$(basename "${f%.*}").o"
    lib_objs+=("$o")
    [[ -f "$o" ]] && continue
    if [[ "$f" == *.cpp ]]; then
      g++ -std=c++17 -O2 -Wall -Wextra $inc -I/usr/local/cuda/include -c "$build/snap/src/$f" -o "$o"
    else
      nvcc $flags $inc -c "$build/snap/src/$f" -o "$o"
    fi
  done
  # This work: kernels (register / spill report), launcher, test.
  nvcc $flags $inc -Xptxas -v -c src/kernels/sm90_moe_backward_gemm.cu -o "$build/obj/bwd_gemm.o" 2>&1 |
    grep -E "error|warning|registers|spill|C75[0-9][0-9]" || true
  nvcc $flags $inc -c src/launch/fused_moe_backward.cu -o "$build/obj/fused_moe_backward.o"
  nvcc $flags $inc -c tests/gpu/test_sm90_moe_backward_gemm.cu -o "$build/obj/test_main.o"
  nvcc $flags "$build/obj/test_main.o" "$build/obj/bwd_gemm.o" "$build/obj/fused_moe_backward.o" "${lib_objs[@]}" \
    -lcublas -o "$build/test_sm90_moe_backward_gemm"
  exit 0
fi

mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# SASS (cuobjdump exists on the GPU machine only): tensor-core and local-memory instructions.
cuobjdump --dump-sass "$build/obj/bwd_gemm.o" | awk '
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
