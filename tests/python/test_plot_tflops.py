"""scripts/plot_tflops.py on made-up benchmark JSON (the real figures come from a GPU round):
it draws what is there, lists what it leaves out (a failed check, a missing figure, a wrong
file) and refuses to draw nothing. Needs matplotlib; no GPU, no torch."""
import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import plot_tflops  # noqa: E402

TOKENS = [1024, 4096, 16384, 65536]


def bench_json(tool, preset, impls, scale, fail_tokens=(), null_tokens=()):
    cases = []
    for t in TOKENS:
        timings = []
        for impl in impls:
            for pass_name in plot_tflops.PASSES:
                for wgrad in (["-"] if pass_name == "forward" else ["fp32", "bf16"]):
                    tflops = None if t in null_tokens else scale * (1 + t / 65536)
                    timings.append(dict(impl=impl, **{"pass": pass_name},
                                        weight_grad_dtype=wgrad, tflops=tflops))
        cases.append(dict(tokens=t, check_status="FAIL" if t in fail_tokens else "pass",
                          timings=timings))
    meta = dict(preset=preset, routing="uniform", gpu="NVIDIA H200", commit="abc1234")
    if tool == "torch_baseline":
        meta["path"] = "grouped_mm"
    return dict(tool=tool, meta=meta, ceiling=dict(tflops=700.0), cases=cases)


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def test_draws_both_presets_and_lists_what_it_left_out(tmp_path, capsys):
    files = [
        write(tmp_path / "f30.json", bench_json("fusemoe_bench", "qwen3-30b-a3b",
                                                ["unfused", "fused", "fused_saved_z"], 300,
                                                fail_tokens=(4096,))),
        write(tmp_path / "f235.json", bench_json("fusemoe_bench", "qwen3-235b-a22b",
                                                 ["fused", "fused_saved_z"], 450)),
        write(tmp_path / "t30.json", bench_json("torch_baseline", "qwen3-30b-a3b",
                                                ["torch_grouped_mm"], 150, null_tokens=(65536,))),
        write(tmp_path / "t235.json", bench_json("torch_baseline", "qwen3-235b-a22b",
                                                 ["torch_grouped_mm"], 250)),
        write(tmp_path / "other.json", {"something": "else"}),
    ]
    out = tmp_path / "img" / "chart.png"
    assert plot_tflops.main(files + ["--out", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert "qwen3-30b-a3b T=4096: correctness check FAILED" in err
    assert "T=65536: no finite TFLOP/s (None), left out" in err
    assert "other.json: neither fusemoe_bench, torch_baseline nor results.json" in err


def test_series_keep_the_figures_and_the_ceiling(tmp_path):
    runs = [bench_json("fusemoe_bench", "qwen3-30b-a3b", ["fused", "fused_saved_z"], 300),
            bench_json("torch_baseline", "qwen3-30b-a3b", ["torch_grouped_mm"], 150)]
    series, ceilings, _, problems = plot_tflops.collect(runs[:1], runs[1:], "uniform", "bf16")
    assert problems == [] and ceilings == {"qwen3-30b-a3b": [700.0]}
    lines = series["qwen3-30b-a3b"]["forward+backward"]
    assert sorted(lines) == ["PyTorch grouped_mm", "fusemoe fused", "fusemoe fused, z saved"]
    assert lines["PyTorch grouped_mm"][65536] == (300.0, True)


def test_reads_a_round_results_json(tmp_path):
    results = {"fusemoe": [bench_json("fusemoe_bench", "qwen3-30b-a3b", ["fused"], 300)],
               "torch": [bench_json("torch_baseline", "qwen3-30b-a3b", ["torch_grouped_mm"], 150)],
               "steps": []}
    out = tmp_path / "chart.png"
    assert plot_tflops.main([write(tmp_path / "results.json", results), "--out", str(out)]) == 0
    assert out.exists()


def test_nothing_to_draw_is_an_error(tmp_path):
    skewed = bench_json("fusemoe_bench", "qwen3-30b-a3b", ["fused"], 300)
    skewed["meta"]["routing"] = "skewed"
    out = tmp_path / "chart.png"
    assert plot_tflops.main([write(tmp_path / "s.json", skewed), "--out", str(out)]) == 2
    assert not out.exists()
