"""scripts/compare_builds.sh with stand-in fusemoe_bench binaries (small Python scripts that write
the bench's --json): the per-build table, and with KERNEL_TIMES=1 the flag passed on and
kernel_times.md with one column per build and round. No GPU, no torch."""
import os
import stat
import subprocess

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "compare_builds.sh")

FAKE_BENCH = r'''#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
us = SCALE * 1000.0
case = {"tokens": int(value("--tokens")), "clocks": {"samples": 0},
        "timings": [{"impl": "fused_saved_z", "pass": "forward", "weight_grad_dtype": "-", "ms_median": us / 1e3}]}
if "--kernel-times" in args:
    gemm = "void fusemoe::sm90::sm90_grouped_gemm_kernel<fusemoe::sm90::GroupedGemm<GatheredTokenRowsA> >(int)"
    case["kernel_times"] = {"status": "traced", "passes": [
        {"impl": "fused_saved_z", "pass": "forward", "weight_grad_dtype": "-", "kernels_us_median": us,
         "kernels": [{"name": gemm, "short_name": "gemm", "us_median": us}]}]}
json.dump({"tool": "fusemoe_bench", "meta": {"preset": value("--preset")}, "cases": [case]}, open(value("--json"), "w"))
'''


def fake_bench(tmp_path, name, scale):
    path = tmp_path / name
    path.write_text(FAKE_BENCH.replace("SCALE", str(scale)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def compare(tmp_path, kernel_times):
    env = dict(os.environ, ROUNDS="2", IMPLS="fused_saved_z", CASES="qwen3-30b-a3b:4096 qwen3-next:16384")
    env.pop("KERNEL_TIMES", None)
    if kernel_times:
        env["KERNEL_TIMES"] = "1"
    out = tmp_path / "out"
    a, b = fake_bench(tmp_path, "a.py", 1.0), fake_bench(tmp_path, "b.py", 1.25)
    proc = subprocess.run(["bash", SCRIPT, str(out), f"a={a}", f"b={b}"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return out


def test_kernel_times_table_per_build_and_round(tmp_path):
    out = compare(tmp_path, kernel_times=True)
    assert "| 1.250 |" in (out / "compare.md").read_text()
    table = (out / "kernel_times.md").read_text()
    assert "| a.r0 us | b.r0 us | a.r1 us | b.r1 us |" in table.splitlines()[0]
    gate_up = [line for line in table.splitlines() if "qwen3-next T=16384" in line and "gate/up" in line]
    assert len(gate_up) == 1 and "| 1000.0 | 1250.0 | 1000.0 | 1250.0 | 1.250 | 1.000 | 1.250 |" in gate_up[0]


def test_no_kernel_times_without_the_switch(tmp_path):
    out = compare(tmp_path, kernel_times=False)
    assert (out / "compare.md").exists()
    assert not (out / "kernel_times.md").exists()
