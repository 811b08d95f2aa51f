"""The PyTorch baseline among torch_baseline.py's timings (benchmarks/torch_timings.py): with
--fp8 a case also holds torch._scaled_grouped_mm timings of the same passes, which must not stand
in for the bf16 path in any figure compared with fusemoe's: compare_torch.py's "vs PyTorch",
perf_table.py, summarize_round.py's speedups and plot_tflops.py's PyTorch line.
Standard library only (the scripts are)."""
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for folder in ("benchmarks", "scripts"):
    sys.path.insert(0, os.path.join(REPO, folder))
import compare_torch  # noqa: E402
import plot_tflops  # noqa: E402
import summarize_round  # noqa: E402
import torch_timings  # noqa: E402

PASSES = (("forward", "-"), ("backward", "bf16"), ("forward+backward", "bf16"))


def timing(impl, pass_name, wgrad, ms):
    return {"impl": impl, "pass": pass_name, "weight_grad_dtype": wgrad, "ms_median": ms,
            "tflops": 100.0 / ms, "pct_ceiling": 10.0 / ms}


def runs():
    """fusemoe "fused" at 0.5 ms per pass; PyTorch grouped_mm at 2 ms, then (listed after it, as
    torch_baseline.py --fp8 appends them) its FP8 path at 1 ms."""
    meta = {"preset": "qwen3-30b-a3b", "routing": "uniform", "gpu": "NVIDIA H200",
            "commit": "abc1234"}
    fusemoe = {"tool": "fusemoe_bench", "meta": dict(meta), "ceiling": {"tflops": 700.0},
               "cases": [{"tokens": 4096, "check_status": "pass",
                          "timings": [timing("fused", p, w, 0.5) for p, w in PASSES]}]}
    torch_run = {"tool": "torch_baseline", "meta": dict(meta, path="grouped_mm", torch="2.11.0"),
                 "ceiling": {"tflops": 700.0},
                 "cases": [{"tokens": 4096, "timings":
                            [timing("torch_grouped_mm", p, w, 2.0) for p, w in PASSES] +
                            [timing(torch_timings.FP8_IMPL, p, w, 1.0) for p, w in PASSES]}]}
    return fusemoe, torch_run


def test_the_helper_picks_the_bf16_path():
    _, torch_run = runs()
    picked = torch_timings.baseline_by_pass(torch_run["meta"], torch_run["cases"][0]["timings"])
    assert sorted(picked) == sorted(p for p, _ in PASSES)
    assert {t["impl"] for t in picked.values()} == {"torch_grouped_mm"}
    # A meta without a path: anything but the FP8 path.
    assert torch_timings.is_baseline({}, {"impl": "torch_per_expert_loop"})
    assert not torch_timings.is_baseline({}, {"impl": torch_timings.FP8_IMPL})


def test_compare_torch_compares_with_the_bf16_path(capsys):
    fusemoe, torch_run = runs()
    compare_torch.print_comparison(fusemoe, torch_run)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    for pass_name, wgrad in PASSES:
        assert ["fused", pass_name, wgrad, "0.500", "200.0", "2.000", "50.0", "4.00x"] in lines


def test_perf_table_compares_with_the_bf16_path(tmp_path):
    fusemoe, torch_run = runs()
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"fusemoe": [fusemoe], "torch": [torch_run]}))
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "perf_table.py"),
                          str(path), "--impls", "fused"], capture_output=True, text=True,
                         check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| qwen3")]
    assert len(rows) == 3 and all(row.rstrip().endswith("| 4.00x |") for row in rows), out


def test_summarize_round_compares_with_the_bf16_path():
    fusemoe, torch_run = runs()
    cases = summarize_round.collect_cases({"fusemoe": [fusemoe], "torch": [torch_run]})
    lines = []
    for key, entry in cases.items():
        summarize_round.render_case(key, entry, lines)
    rows = {(cells[1], cells[2]): cells[-2] for cells in
            ([c.strip() for c in line.split("|")] for line in lines if line.startswith("| "))
            if len(cells) > 3 and cells[2] in {p for p, _ in PASSES}}
    for pass_name, _ in PASSES:
        assert rows[("fused", pass_name)] == "4.00x", rows
        assert rows[("PyTorch (torch._grouped_mm)", pass_name)] == "1.00x", rows
        assert rows[("PyTorch FP8 (torch._scaled_grouped_mm, rowwise)", pass_name)] == "2.00x"


def test_plot_line_is_the_bf16_path():
    fusemoe, torch_run = runs()
    series, _, _, problems = plot_tflops.collect([fusemoe], [torch_run], "uniform", "bf16")
    assert problems == []
    for pass_name, _ in PASSES:
        assert series["qwen3-30b-a3b"][pass_name]["PyTorch grouped_mm"][4096][0] == 50.0
