"""The main job's plumbing without a GPU: benchmarks/compare_torch.py (which options reach
torch_baseline, the "vs PyTorch" table, fusemoe_bench's failures passed through) and
scripts/project_commit.sh (this checkout's commit, never a parent folder's repository)."""
import os
import shutil
import stat
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import compare_torch  # noqa: E402


def test_shared_options_reach_torch_baseline():
    shared, json_path = compare_torch.split_options(
        ["--preset", "qwen3-235b-a22b", "--tokens=4096,16384", "--impl", "fused", "--no-check",
         "--json", "out.json", "--iters", "7", "--check-max-tokens", "4096", "--routing=skewed"])
    assert shared == ["--preset", "qwen3-235b-a22b", "--tokens", "4096,16384", "--iters", "7",
                      "--routing", "skewed"]
    assert json_path == "out.json"


def timing(impl, pass_name, wgrad, ms, tflops):
    return {"impl": impl, "pass": pass_name, "weight_grad_dtype": wgrad, "ms_median": ms,
            "tflops": tflops}


def test_each_fusemoe_figure_gets_its_vs_pytorch(capsys):
    fusemoe = {"meta": {"preset": "qwen3-30b-a3b", "routing": "uniform"}, "cases": [
        {"tokens": 4096, "check_status": "pass", "timings": [
            timing("unfused", "forward", "-", 1.0, 100.0),
            timing("fused", "forward", "-", 0.25, 400.0),
            timing("fused", "backward", "bf16", 0.5, 400.0),
            timing("fused", "forward+backward", "bf16", 0.75, 400.0)]},
        {"tokens": 8192, "check_status": "pass", "timings": [
            timing("fused", "forward", "-", 0.5, 400.0)]}]}
    torch_result = {"meta": {"path": "grouped_mm", "torch": "2.11.0"}, "cases": [
        {"tokens": 4096, "timings": [timing("torch_grouped_mm", "forward", "-", 1.0, 100.0),
                                     timing("torch_grouped_mm", "backward", "bf16", 1.0, 200.0),
                                     timing("torch_grouped_mm", "forward+backward", "bf16",
                                            2.25, 133.0)]}]}
    compare_torch.print_comparison(fusemoe, torch_result)
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert ["fused", "forward", "-", "0.250", "400.0", "1.000", "100.0", "4.00x"] in lines
    assert ["fused", "backward", "bf16", "0.500", "400.0", "1.000", "200.0", "2.00x"] in lines
    assert ["fused", "forward+backward", "bf16", "0.750", "400.0", "2.250", "133.0", "3.00x"] in lines
    assert "torch._grouped_mm, torch 2.11.0" in out
    assert "unfused" not in out.split("vs PyTorch =")[1]  # the cuBLAS baseline stays in its table
    assert "(no PyTorch figure)" in out  # T=8192 has no PyTorch case: said, not invented


def fake_bench(tmp_path, exit_code):
    path = tmp_path / "fake_bench"
    path.write_text(f"#!/bin/sh\necho fake bench \"$@\"\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_bench_failure_is_passed_through_and_pytorch_not_run(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compare_torch.py"),
                             "--bench", fake_bench(tmp_path, 3), "--", "--tokens", "64"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "fake bench --tokens 64 --json" in result.stdout
    assert "torch_baseline" not in result.stdout


def run_commit_script(folder):
    return subprocess.run(["bash", os.path.join(folder, "scripts", "project_commit.sh")],
                          capture_output=True, text=True, timeout=60).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="skipped: git is not installed")
def test_commit_is_the_projects_own_or_unknown(tmp_path):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    parent = tmp_path / "parent"
    (parent / "copy" / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "project_commit.sh"), parent / "copy" / "scripts")
    subprocess.run([*git, "init", "-q", str(parent)], check=True)
    subprocess.run([*git, "-C", str(parent), "commit", "-q", "--allow-empty", "-m", "p"],
                   check=True)
    assert run_commit_script(str(parent / "copy")) == "unknown"  # not the parent's commit
    own = tmp_path / "own"
    (own / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "project_commit.sh"), own / "scripts")
    subprocess.run([*git, "init", "-q", str(own)], check=True)
    subprocess.run([*git, "-C", str(own), "add", "."], check=True)
    subprocess.run([*git, "-C", str(own), "commit", "-q", "-m", "own"], check=True)
    head = subprocess.run(["git", "-C", str(own), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert run_commit_script(str(own)) == head
    (own / "scripts" / "project_commit.sh").write_text(
        (own / "scripts" / "project_commit.sh").read_text() + "\n")
    assert run_commit_script(str(own)) == head + "-dirty"
