"""scripts/summarize_round.py on a round whose parts ran no benchmark (ROUND_PARTS=sanitizers): the
summary takes its date, commit and GPU from the round's own record (round.tsv) instead of printing
None, and a failed sanitizer still fails the round; and on a fusemoe_bench part with --kernel-times:
its in-layer kernel times listed under the case. No GPU and no PyTorch needed."""
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "summarize_round.py")


def run_summary(tmp_path, steps, round_rows, bench=None):
    parts = tmp_path / "parts"
    parts.mkdir()
    if bench is not None:
        (parts / "1_fusemoe_30b.json").write_text(json.dumps(bench))
    (parts / "steps.tsv").write_text("".join(f"{n}\t{rc}\t{s}\t{note}\n" for n, rc, s, note in steps))
    if round_rows is not None:
        (parts / "round.tsv").write_text("".join(f"{k}\t{v}\n" for k, v in round_rows))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, SCRIPT, str(out), "--parts", str(parts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return (out / "summary.md").read_text()


SANITIZERS_ONLY = [("tests", 0, 0, "left out: not in ROUND_PARTS"), ("memcheck", 0, 65, ""),
                   ("racecheck", 0, 135, ""), ("bench", 0, 0, "left out: not in ROUND_PARTS")]
ROUND = [("commit", "db90df0"), ("date", "2026-12-04T04:51:51Z"), ("gpu", "NVIDIA H200")]


def test_sanitizer_round_names_its_commit_date_and_gpu(tmp_path):
    summary = run_summary(tmp_path, SANITIZERS_ONLY, ROUND)
    assert "- date 2026-12-04T04:51:51Z, commit `db90df0`" in summary
    assert "- GPU NVIDIA H200; no benchmark in this round" in summary
    assert "None" not in summary
    assert "**Round: PASS** (partial round: tests, bench left out)" in summary


def test_failed_sanitizer_fails_the_round(tmp_path):
    steps = [s if s[0] != "racecheck" else ("racecheck", 1, 135, "") for s in SANITIZERS_ONLY]
    summary = run_summary(tmp_path, steps, ROUND)
    assert "**Round: FAIL**" in summary
    assert "- racecheck exited 1" in summary


def test_round_without_its_record_says_so(tmp_path):
    # Parts from before round.tsv existed: the header says None rather than inventing a commit.
    summary = run_summary(tmp_path, SANITIZERS_ONLY, None)
    assert "- date None, commit `None`" in summary


def test_kernel_times_are_listed_under_their_case(tmp_path):
    gemm = "void fusemoe::sm90::sm90_grouped_gemm_kernel<fusemoe::sm90::GroupedGemm<{}> >(int)"
    kernels = [{"name": gemm.format("GatheredTokenRowsA, SwiGLUEpilogue<256, false, true>"), "us_median": 1481.4},
               {"name": gemm.format("PoolRowsA, RowStoreEpilogue<256, true, (fusemoe::sm90::RowDestination)1>"),
                "us_median": 718.2}]
    case = {"tokens": 16384, "valid_rows": 131072, "timings": [], "check_status": "skipped (--no-check)",
            "kernel_times": {"status": "traced", "passes": [
                {"impl": "fused_saved_z", "pass": "forward", "weight_grad_dtype": "-", "kernels_us_median": 2199.6,
                 "kernels": kernels}],
                "clocks_by_impl": {"fused_saved_z": {"samples": 19, "sm_mhz_median": 1440.0, "sm_mhz_min": 1290.0,
                                                     "sm_mhz_max": 1485.0, "power_capped_fraction": 1.0},
                                   "unfused": {"samples": 0}}}}
    bench = {"tool": "fusemoe_bench", "meta": {"preset": "qwen3-30b-a3b", "routing": "uniform"},
             "ceiling": {"tflops": 780.0}, "cases": [case]}
    steps = [("fusemoe_bench 30b-uniform", 0, 30, "")]
    # The unfused path's per-expert cuBLAS launches: one entry per kernel name, summed and counted.
    per_expert = [{"name": "void cublas_gemm_kernel<128>(int)", "short_name": "cublas_gemm_kernel", "us_median": 5.0}]
    case["kernel_times"]["passes"].append({"impl": "unfused", "pass": "backward", "weight_grad_dtype": "bf16",
                                           "kernels_us_median": 100.0, "kernels": per_expert * 20})
    summary = run_summary(tmp_path, steps, ROUND, bench)
    assert "Kernels inside the layer (fusemoe_bench --kernel-times" in summary
    assert "- fused_saved_z forward (- weight grads): 2200 = gate/up 1481; down 718" in summary
    assert "- fused_saved_z traced at SM 1440 MHz median (1290-1485), power cap in 100% of 19 samples" in summary
    assert "unfused traced at" not in summary  # no samples: no line
    assert "- unfused backward (bf16 weight grads): 100 = cublas_gemm_kernel 100 (20 launches)" in summary
