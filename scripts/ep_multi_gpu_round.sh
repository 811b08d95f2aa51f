#!/usr/bin/env bash
# The expert-parallel round on one host with R >= 2 GPUs (issue 15), one command:
#   1. the GPUs' topology and the copy rate between two peers (the NVLink ceiling);
#   2. per case: fusemoe.ExpertParallelMoEExperts against the torchtitan-style all-to-all baseline
#      (NCCL) on the same tokens, checked against each other, then timed forward and
#      forward+backward (benchmarks/ep_torch_baseline.py under torchrun, R ranks, a GPU each);
#   3. the single-GPU fused layer at the same tokens per GPU (fusemoe_bench, GPU 0);
#   4. the Python EP suite on the GPUs (tests/python/test_expert_parallel.py: the op bitwise
#      against the single-GPU op, and the EP training example within bf16 noise of one GPU's).
# Then scripts/summarize_ep_round.py writes summary.md. Not in it: the C++ EP suites, whose ranks
# share one GPU (fusemoe_gpu_ep_tests, fusemoe_ep_bench).
#   usage: scripts/ep_multi_gpu_round.sh OUTDIR
# Env: BUILD_DIR (build: fusemoe_bench and libfusemoe_c.so), EP_CASES ("qwen3-30b-a3b:4096,8192
#   qwen3-235b-a22b:4096,8192", tokens PER GPU), EP_ROUTINGS ("uniform skewed"), ITERS (10),
#   WARMUP (3), EP_PYTEST_TIMEOUT_S (300: the suite took over 200 s on two H200s). Exit 1 if a
#   check, a test or a step failed. On two H200s the default cases took ~2.5 min before the suite.
set -u -o pipefail
if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
OUTDIR="$1"
mkdir -p "$OUTDIR"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
BUILD_DIR="$(cd "${BUILD_DIR:-$REPO/build}" && pwd -P)"
read -r -a CASES <<<"${EP_CASES:-qwen3-30b-a3b:4096,8192 qwen3-235b-a22b:4096,8192}"
read -r -a ROUTINGS <<<"${EP_ROUTINGS:-uniform skewed}"
ITERS="${ITERS:-10}"
WARMUP="${WARMUP:-3}"
export FUSEMOE_LIBRARY="$BUILD_DIR/libfusemoe_c.so"
# NVLink multicast stays off (the lent machines' rule: it can take a shared host's GPUs out of
# service); the layer uses peer pointers only, and these keep NCCL and torch from trying it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU ")
log() { echo "[ep-round $(date +%T)] $*" | tee -a "$OUTDIR/progress.txt"; }
status=0
if [[ "$R" -lt 2 ]]; then
  log "fewer than 2 GPUs ($R): this round needs a GPU per rank"
  exit 2
fi
for f in "$BUILD_DIR/fusemoe_bench" "$FUSEMOE_LIBRARY"; do
  [[ -e "$f" ]] || { log "missing $f (BUILD_DIR=$BUILD_DIR)"; exit 2; }
done
log "R=$R GPUs; cases ${CASES[*]} (tokens per GPU); routings ${ROUTINGS[*]}"

# 1. Topology and the peer copy rate: 1 GiB from GPU 0 to GPU 1, median of 5 after one. (Both
# directions at once is not measured: two torch copies issued on two streams measured no more than
# one, 390.7 against 388.7 GB/s on two H200s, 2026-12-04, so that probe did not overlap them.)
nvidia-smi topo -m >"$OUTDIR/topo.txt" 2>&1
python3 - >"$OUTDIR/nvlink.txt" 2>&1 <<'EOF' || { log "NVLink probe failed"; status=1; }
import torch
n = 1 << 30
a0, b1 = torch.empty(n, dtype=torch.uint8, device="cuda:0"), torch.empty(n, dtype=torch.uint8, device="cuda:1")
print(f"peer access 0->1: {torch.cuda.can_device_access_peer(0, 1)}, 1->0: {torch.cuda.can_device_access_peer(1, 0)}")
s0 = torch.cuda.Stream(device=0)
times = []
for _ in range(6):
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with torch.cuda.stream(s0):
        e[0].record(s0)
        b1.copy_(a0, non_blocking=True)
        e[1].record(s0)
    torch.cuda.synchronize(0); torch.cuda.synchronize(1)
    times.append(e[0].elapsed_time(e[1]) * 1e-3)
t = sorted(times[1:])[len(times[1:]) // 2]
print(f"copy GPU 0 -> GPU 1, 1 GiB: {n / t / 1e9:.1f} GB/s")
EOF
log "$(tail -1 "$OUTDIR/nvlink.txt" | tr '\n' ' ')"

# 2. EP against the all-to-all baseline, per case and routing.
for spec in "${CASES[@]}"; do
  preset="${spec%%:*}"
  IFS=, read -r -a per_gpu <<<"${spec#*:}"
  for routing in "${ROUTINGS[@]}"; do
    for t in "${per_gpu[@]}"; do
      name="ep_${preset}_${t}_${routing}"
      if ! timeout 300 torchrun --standalone --nproc_per_node "$R" "$REPO/benchmarks/ep_torch_baseline.py" \
        --preset "$preset" --tokens $((t * R)) --routing "$routing" --iters "$ITERS" --warmup "$WARMUP" \
        --json "$OUTDIR/$name.json" >"$OUTDIR/$name.log" 2>&1; then
        log "$name failed (log: $OUTDIR/$name.log)"
        status=1
      else
        log "$name: $(grep -E "x the torchtitan" "$OUTDIR/$name.log" | sed 's/.*\] //' | tr '\n' ' ')"
      fi
    done
  done
done

# 3. The single-GPU fused layer at the same tokens per GPU.
for spec in "${CASES[@]}"; do
  preset="${spec%%:*}"
  for routing in "${ROUTINGS[@]}"; do
    name="single_${preset}_${routing}"
    if ! CUDA_VISIBLE_DEVICES=0 timeout 300 "$BUILD_DIR/fusemoe_bench" --preset "$preset" --tokens "${spec#*:}" \
      --routing "$routing" --impl fused_saved_z --iters "$ITERS" --warmup "$WARMUP" --no-check \
      --json "$OUTDIR/$name.json" >"$OUTDIR/$name.log" 2>&1; then
      log "$name failed (log: $OUTDIR/$name.log)"
      status=1
    fi
  done
done
log "single-GPU runs done"

# 4. The Python EP suite on the GPUs.
if ! FUSEMOE_REQUIRE_GPU=1 timeout "${EP_PYTEST_TIMEOUT_S:-300}" python3 -m pytest -v -rs \
  "$REPO/tests/python/test_expert_parallel.py" >"$OUTDIR/pytest_ep.log" 2>&1; then
  status=1
fi
log "pytest: $(tail -1 "$OUTDIR/pytest_ep.log")"

python3 "$REPO/scripts/summarize_ep_round.py" "$OUTDIR" "$R" >"$OUTDIR/summary.md" || status=1
cat "$OUTDIR/summary.md"
exit $status
