"""scripts/summarize_ep_round.py on made-up outputs of scripts/ep_multi_gpu_round.sh (the real ones
come from a host with 2 or more H200s): the ratios against the baseline and the single-GPU layer,
the check column, and its exit status when a check failed, a case is missing its figures, or the
Python EP suite failed or was cut short. No GPU, no torch."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "summarize_ep_round.py")

CHECK = {"y": 6.2e-3, "dx": 5.0e-3, "d_topk_weights": 4.0e-3, "dw13": 4.5e-3, "dw2": 4.1e-3}
COMPLETE = ("tests/python/test_expert_parallel.py::test_op_matches_single_gpu_op_gpu PASSED [ 50%]\n"
            "tests/python/test_expert_parallel.py::test_example_trains_like_the_single_gpu_run_gpu PASSED [100%]\n"
            "============ 2 passed in 95.20s ============\n")


def ep_result(timed=True):
    timings = []
    if timed:
        for pass_name, ep_ms, base_ms, ep_tf, base_tf in (("forward", 2.0, 6.0, 300.0, 100.0),
                                                          ("forward+backward", 5.0, 14.0, 360.0, 128.6)):
            timings += [{"impl": "torchtitan-style (nccl)", "pass": pass_name, "ms": base_ms, "tflops_per_rank": base_tf},
                        {"impl": "fusemoe EP", "pass": pass_name, "ms": ep_ms, "tflops_per_rank": ep_tf}]
    return {"meta": {}, "check": CHECK, "timings": timings}


def single_result():
    timings = [{"impl": "fused_saved_z", "pass": "forward", "weight_grad_dtype": "-", "tflops": 400.0},
               {"impl": "fused_saved_z", "pass": "forward+backward", "weight_grad_dtype": "fp32", "tflops": 1.0},
               {"impl": "fused_saved_z", "pass": "forward+backward", "weight_grad_dtype": "bf16", "tflops": 450.0}]
    return {"cases": [{"tokens": 4096, "timings": timings}, {"tokens": 8192, "timings": []}]}


def write_round(d, result, pytest_log=COMPLETE):
    (d / "nvlink.txt").write_text("copy GPU 0 -> GPU 1, 1 GiB: 388.7 GB/s\n")
    (d / "ep_qwen3-30b-a3b_4096_uniform.log").write_text("[ep-bench] ...\n")
    if result is not None:
        (d / "ep_qwen3-30b-a3b_4096_uniform.json").write_text(json.dumps(result))
    (d / "single_qwen3-30b-a3b_uniform.json").write_text(json.dumps(single_result()))
    (d / "pytest_ep.log").write_text(pytest_log)


def run(d):
    return subprocess.run([sys.executable, SCRIPT, str(d), "2"], capture_output=True, text=True)


def test_ratios_against_the_baseline_and_one_gpu(tmp_path):
    write_round(tmp_path, ep_result())
    r = run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "- copy GPU 0 -> GPU 1, 1 GiB: 388.7 GB/s" in r.stdout
    fwd = next(line for line in r.stdout.splitlines() if "| forward |" in line)
    both = next(line for line in r.stdout.splitlines() if "| forward+backward |" in line)
    # EP / baseline is the time ratio; EP / single-GPU the TFLOP/s ratio (the bf16 row, not fp32)
    assert "| 2.000 | 300.0 | 100.0 | 3.00x | 400.0 | 0.75x | 6.20e-03 |" in fwd, fwd
    assert "| 5.000 | 360.0 | 128.6 | 2.80x | 450.0 | 0.80x |" in both, both
    assert "test_expert_parallel.py`): 2 passed" in r.stdout


def test_failed_check_missing_figures_and_a_cut_suite_fail(tmp_path):
    for result, log, expect in ((ep_result(timed=False), COMPLETE, "not timed (check failed)"),
                                (None, COMPLETE, "failed: see ep_qwen3-30b-a3b_4096_uniform.log"),
                                (ep_result(), COMPLETE.splitlines(keepends=True)[0], "cut short: 1 passed"),
                                (ep_result(), COMPLETE.replace("::test_op_matches_single_gpu_op_gpu PASSED",
                                                               "::test_op_matches_single_gpu_op_gpu FAILED")
                                 .replace("2 passed", "1 failed, 1 passed"), "failed: test_op_matches_single_gpu_op_gpu")):
        d = tmp_path / str(len(os.listdir(tmp_path)))
        d.mkdir()
        write_round(d, result, log)
        r = run(d)
        assert r.returncode == 1, (expect, r.stdout)
        assert expect in r.stdout, (expect, r.stdout)


def test_round_refuses_a_host_without_two_gpus(tmp_path):
    # scripts/ep_multi_gpu_round.sh needs a GPU per rank: on this CI machine (no nvidia-smi, or one
    # GPU) it says so and exits 2 before running anything.
    import shutil
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        if sum(line.startswith("GPU ") for line in listed.splitlines()) >= 2:
            pytest.skip("skipped: this host has 2 or more GPUs, where the script would run the whole round")
    round_script = os.path.join(os.path.dirname(SCRIPT), "ep_multi_gpu_round.sh")
    r = subprocess.run(["bash", round_script, str(tmp_path / "out")], capture_output=True, text=True,
                       env=dict(os.environ, PATH="/usr/bin:/bin"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "this round needs a GPU per rank" in r.stdout


def test_check_column_shows_nan_wherever_it_stands(tmp_path):
    # A NaN error after a finite one: max() alone would keep the finite one.
    result = ep_result(timed=False)
    result["check"] = dict(CHECK, dw2=float("nan"))
    write_round(tmp_path, result)
    r = run(tmp_path)
    assert r.returncode == 1, r.stdout
    row = next(line for line in r.stdout.splitlines() if "not timed (check failed)" in line)
    assert row.rstrip().endswith("| nan |"), row
