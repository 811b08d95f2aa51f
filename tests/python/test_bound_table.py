"""scripts/bound_table.py on a made-up case file (the real ones come from scripts/profile_bounds.sh
on the H200: fusemoe_bench's output with ncu's --csv rows): the passes it picks, the units it
converts, what it says bounds each kernel, the DRAM-read ratio, and its refusal of a file with no
kernel rows. No GPU, no torch."""
import csv
import io
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "bound_table.py")

HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
GEMM = "void fusemoe::sm90::sm90_grouped_gemm_kernel<fusemoe::sm90::GroupedGemm<{}>>(fusemoe::sm90::GemmParams<T1>)"
NAMES = {
    "count": "void fusemoe::(anonymous namespace)::routing_count_kernel(const int *, long, int, int *, int *)",
    "place": "void fusemoe::(anonymous namespace)::routing_place_kernel(const int *, long, int, long, RoutingPlan, int *)",
    "gate_up": GEMM.format("GatheredTokenRowsA, GateUpWeightsB<256>, RowTileScheduler, SwiGLUEpilogue<256, 1>"),
    "down": GEMM.format("PoolRowsA, WeightsB<256>, RowTileScheduler, RowStoreEpilogue<256, 1, 1>"),
    "combine": "void fusemoe::(anonymous namespace)::combine_slots_kernel(const bf16 *, long)",
    "gather": "void fusemoe::(anonymous namespace)::gather_rows_kernel(const bf16 *, bf16 *)",
    "dgrad1": GEMM.format("PoolRowsA, TransposedB<128>, RowTileScheduler, DgradSwiGLUEpilogue<128, 0, 128>, PingPongConsumers"),
    "dgrad2": GEMM.format("PoolRowsA, TransposedB<256>, RowTileScheduler, RowStoreEpilogue<256, 0, 1>"),
    "dw_fp32": GEMM.format("PoolRowsTransposedA, TransposedB<256>, ExpertOutputTileScheduler, WeightGradEpilogue<1, 0>"),
    "dw_bf16": GEMM.format("PoolRowsTransposedA, TransposedB<256>, ExpertOutputTileScheduler, WeightGradEpilogue<0, 0>"),
    "flush": "void fusemoe::harness::flush_l2_kernel(char *, long)",
    # FP8 (names as ncu printed them on the H200)
    "quantize": "unnamed>::quantize_rows_fp8_kernel(const __nv_bfloat16 *, const int *, long, long, long, "
                "__nv_bfloat16 *, unsigned char *, float *, Fp8ScaleLayout, Fp8RowsPlainCopy)",
    "quantize_token": "unnamed>::quantize_token_rows_fp8_kernel(const __nv_bfloat16 *, long, unsigned char *, float *)",
    "quantize_pool": "unnamed>::quantize_pool_rows_fp8_kernel(const __nv_bfloat16 *, const int *, long, long, long, "
                     "__nv_bfloat16 *, unsigned char *, float *, Fp8ScaleLayout, Fp8RowsPlainCopy)",
    "quantize_w": "void unnamed>::quantize_weights_fp8_kernel<0>(const __nv_bfloat16 *, const __nv_bfloat16 *, long, "
                  "long, unsigned char *, unsigned char *, float *)",
    "fp8_gate_up": GEMM.format("Fp8GatheredTokenRowsA, Fp8GateUpWeightsB, RowTileScheduler, SwiGLUFp8Epilogue<0, 1>"),
    "fp8_down": GEMM.format("Fp8PoolRowsA, Fp8WeightsB<256>, RowTileScheduler, RowStoreEpilogue<256, 1, 1>"),
    # FP8 dgrad-1 and the z recompute gather token rows as the gate/up does (since e6af4a4)
    "fp8_dgrad1": GEMM.format("Fp8GatheredTokenRowsA, Fp8WeightsB<256>, RowTileScheduler, "
                              "DgradSwiGLUFp8Epilogue<0, 2, 256>, CooperativeConsumers, StaticTileOrder"),
    "fp8_recompute": GEMM.format("Fp8GatheredTokenRowsA, Fp8WeightsB<256>, RowTileScheduler, "
                                 "RowStoreEpilogue<256, 0, 0>, CooperativeConsumers, StaticTileOrder"),
    "scatter": "unnamed>::scatter_token_rows_kernel(const bf16 *, const int *, long, bf16 *)",
    # FP8 weight gradients (LayerConfig::fp8_weight_grads)
    "token_offsets": "void fusemoe::(anonymous namespace)::token_block_offsets_kernel(const int *, int, int, int *, int *)",
    "token_blocked": "void fusemoe::(anonymous namespace)::quantize_token_blocked_kernel<1, 0>(const bf16 *, long, int, "
                     "const int *, int, const int *, const int *, const int *, unsigned char *, float *)",
    "fp8_dw": GEMM.format("Fp8TokenBlockedA, Fp8TokenBlockedB<256>, TokenBlockOutputTileScheduler, "
                          "Fp8WeightGradEpilogue<0, 0>"),
}
# (kernel, ns, tensor %, dram %, L2 %, DRAM read in Mbyte, clock in hz)
FORWARD = [("count", 4000, 0, 1, 2, 0.1, 1.97e9), ("place", 10000, 0, 0, 4, 0.2, 1.97e9),
           ("gate_up", 400000, 90, 40, 70, 1200, 1.5e9), ("down", 200000, 60, 82, 70, 450, 1.6e9),
           ("combine", 40000, 0, 80, 85, 130, 1.97e9)]
BACKWARD_FP32 = [("count", 4000, 0, 1, 2, 0.1, 1.97e9), ("place", 10000, 0, 0, 4, 0.2, 1.97e9),
                 ("gather", 100000, 1, 80, 94, 160, 1.94e9), ("dgrad1", 300000, 44, 66, 88, 800, 1.7e9),
                 ("dgrad2", 380000, 81, 58, 79, 900, 1.55e9), ("combine", 40000, 0, 80, 85, 130, 1.97e9),
                 ("dw_fp32", 330000, 37, 60, 73, 180, 1.7e9), ("dw_fp32", 690000, 36, 55, 64, 230, 1.7e9)]
BACKWARD_BF16 = BACKWARD_FP32[:-2] + [("dw_bf16", 250000, 50, 46, 70, 185, 1.68e9),
                                      ("dw_bf16", 530000, 48, 40, 53, 235, 1.69e9)]


def case_file(path, launches, with_layer=True):
    buf = io.StringIO()
    if with_layer:
        buf.write("fusemoe_bench  commit abc1234\n")
        buf.write("layer qwen3-30b-a3b: H=2048 I=768 E=128 K=8; tokens 4096; routing uniform; impls fused_saved_z\n")
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL)
    writer.writerow(HEADER)
    metrics = [("gpu__time_duration.sum", "ns", 1),
               ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed", "%", 2),
               ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", 3),
               ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "%", 4),
               ("dram__bytes_read.sum", "Mbyte", 5), ("sm__cycles_elapsed.avg.per_second", "hz", 6)]
    for i, launch in enumerate(launches):
        for name, unit, col in metrics:
            value = launch[col]
            cell = f"{value:,.2f}" if name != "gpu__time_duration.sum" else f"{int(value):,}"
            writer.writerow([str(i), "1", "fusemoe_bench", "127.0.0.1", NAMES[launch[0]], "1", "7", "(384, 1, 1)",
                             "(132, 1, 1)", "0", "9.0", "Command line profiler metrics", name, unit, cell])
    buf.write("  fused_saved_z     forward           -      0.700 ...\n")  # the bench prints between rows too
    path.write_text(buf.getvalue())


def run(*files):
    return subprocess.run([sys.executable, SCRIPT, *map(str, files)], capture_output=True, text=True)


def test_picks_the_first_forward_and_the_bf16_backward(tmp_path):
    f = tmp_path / "case.csv"
    flush = ("flush", 300000, 2, 7, 10, 0.0, 1.98e9)
    case_file(f, [flush] + FORWARD + [flush] + BACKWARD_FP32 + [flush] + FORWARD + [flush] + BACKWARD_BF16)
    r = run(f)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| qwen3-30b-a3b T=4096 |")]
    forward = next(line for line in rows if "| forward:" in line)
    backward = next(line for line in rows if "| backward:" in line)
    # ns -> µs, summed over routing, the GEMMs and the combine; the harness's flush is left out
    assert "forward: 654 µs" in forward
    assert "gate/up 400, 90 / 40 / 70, 1.50: tensor pipe" in forward
    assert "down 200, 60 / 82 / 70, 1.60: DRAM" in forward
    # the bf16 weight gradients' backward, not the fp32 one before it
    assert "dW2 250, 50 / 46 / 70, 1.68: none near its peak (latency)" in backward
    assert "dW13 530" in backward
    assert "dgrad-1 300, 44 / 66 / 88, 1.70: L2" in backward
    assert "x, dy pools 100" in backward
    assert "backward: 1614 µs" in backward
    # DRAM bytes over w13 + routed x rows: 1.2 GB / (128*1536*2048*2 + 4096*8*2048*2) bytes
    ratio = next(line for line in r.stdout.splitlines() if "| gate/up | 1.20 |" in line)
    assert ratio.rstrip().endswith("| 1.28x |"), ratio


@pytest.mark.parametrize("x_quantize", ["quantize", "quantize_token"])
def test_fp8_passes_count_quantization_and_pools(tmp_path, x_quantize):
    # FP8 forward: routing, the x quantization (its kernel's name before and since 0cf4413), FP8
    # gate/up and down, combine; the weights' quantization before it is not part of the pass.
    # Backward: the token-major pools.
    f = tmp_path / "fp8.csv"
    forward = [("quantize_w", 400000, 0, 80, 50, 1000, 1.9e9)] + FORWARD[:2] + [
        (x_quantize, 45000, 0, 40, 60, 130, 1.97e9), ("fp8_gate_up", 300000, 55, 26, 53, 640, 1.62e9),
        ("fp8_down", 150000, 53, 37, 55, 310, 1.62e9), FORWARD[-1]]
    backward = BACKWARD_BF16[:2] + [("scatter", 320000, 0, 80, 90, 500, 1.9e9)] + BACKWARD_BF16[3:]
    case_file(f, forward + backward)
    r = run(f)
    assert r.returncode == 0, r.stderr
    fwd = next(line for line in r.stdout.splitlines() if "| forward:" in line)
    assert "forward: 549 µs" in fwd  # 4 + 10 + 45 + 300 + 150 + 40, without the weights' 400
    assert "FP8 quantize 45" in fwd
    assert "gate/up 300, 55 / 26 / 53, 1.62: none near its peak (latency)" in fwd
    bwd = next(line for line in r.stdout.splitlines() if "| backward:" in line)
    assert "x, dy pools 320" in bwd
    assert "backward: 1834 µs" in bwd
    # one byte an element plus the scales: 128*1536*2048 (1 + 4/16384) + 4096*8*2048 (1 + 4/128)
    ratio = next(line for line in r.stdout.splitlines() if "| gate/up | 0.64 |" in line)
    assert "| 0.47 |" in ratio and ratio.rstrip().endswith("| 1.36x |"), ratio


def test_fp8_backward_counts_the_pools_quantization(tmp_path):
    # The FP8 backward's dy quantization with the bf16 pools (quantize_pool_rows_fp8 since 0cf4413)
    # in place of the BF16 path's pools.
    f = tmp_path / "fp8_backward.csv"
    backward = BACKWARD_BF16[:2] + [("quantize_pool", 420000, 0, 71, 90, 500, 1.9e9)] + BACKWARD_BF16[3:]
    case_file(f, FORWARD + backward)
    r = run(f)
    assert r.returncode == 0, r.stderr
    bwd = next(line for line in r.stdout.splitlines() if "| backward:" in line)
    assert "FP8 quantize 420" in bwd
    assert "backward: 1934 µs" in bwd


def test_refuses_a_file_without_kernel_rows(tmp_path):
    f = tmp_path / "empty.csv"
    f.write_text("fusemoe_bench  commit abc1234\nno kernels matched\n")
    r = run(f)
    assert r.returncode == 2
    assert "no ncu kernel rows" in r.stderr


def test_names_the_file_when_the_layer_line_is_missing(tmp_path):
    f = tmp_path / "nolayer.csv"
    case_file(f, FORWARD, with_layer=False)
    r = run(f)
    assert r.returncode == 0, r.stderr
    assert f"| {f} | forward: 654 µs |" in r.stdout
    assert "read / operands" not in r.stdout  # no shape, no ratio


def test_fp8_gathering_backward_gemms_keep_their_roles(tmp_path):
    # FP8 dgrad-1 and the z recompute read gathered token rows (Fp8GatheredTokenRowsA, as the
    # gate/up): named by their epilogues, not taken for a second gate/up.
    f = tmp_path / "fp8_gathering.csv"
    backward = BACKWARD_BF16[:2] + [("quantize_pool", 330000, 0, 75, 80, 500, 1.97e9),
                                    ("quantize_token", 25000, 0, 66, 89, 70, 1.95e9),
                                    ("fp8_recompute", 400000, 50, 30, 60, 600, 1.6e9),
                                    ("fp8_dgrad1", 750000, 31, 60, 71, 900, 1.72e9)] + BACKWARD_BF16[4:]
    case_file(f, FORWARD + backward)
    r = run(f)
    assert r.returncode == 0, r.stderr
    fwd = next(line for line in r.stdout.splitlines() if "| forward:" in line)
    bwd = next(line for line in r.stdout.splitlines() if "| backward:" in line)
    assert "gate/up 400" in fwd and "gate/up" not in bwd, bwd
    assert "z recompute 400, 50 / 30 / 60" in bwd
    assert "dgrad-1 750, 31 / 60 / 71, 1.72" in bwd
    assert "dgrad-2 380" in bwd


def test_fp8_weight_gradients_name_their_token_blocks(tmp_path):
    # LayerConfig::fp8_weight_grads: the transposing quantizations are one role, and the FP8
    # weight-gradient GEMMs stay weight gradients (Fp8WeightGradEpilogue<0, 0>).
    f = tmp_path / "fp8_wgrad.csv"
    backward = BACKWARD_BF16[:2] + [("token_offsets", 2000, 0, 1, 1, 1, 1.9e9),
                                    ("token_blocked", 300000, 0, 60, 70, 500, 1.9e9),
                                    ("fp8_dw", 400000, 60, 30, 40, 300, 1.6e9)]
    case_file(f, FORWARD + backward)
    r = run(f)
    assert r.returncode == 0, r.stderr
    bwd = next(line for line in r.stdout.splitlines() if "| backward:" in line)
    assert "FP8 token blocks" in bwd, bwd
    assert "dW" in bwd and "None" not in bwd, bwd
