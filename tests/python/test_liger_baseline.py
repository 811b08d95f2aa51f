"""benchmarks/liger_baseline.py and the round's handling of it, without a GPU: its options (those
of torch_baseline.py, whose presets must be fusemoe_bench's), the skip when liger_kernel is absent
or broken (exit 6, said, never a pass), the check and timings through a CPU stand-in for
LigerFusedMoEFunction, and scripts/summarize_round.py's Liger rows and optional steps."""
import json
import os
import re
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for folder in ("benchmarks", "scripts"):
    sys.path.insert(0, os.path.join(REPO, folder))
import compare_torch  # noqa: E402
import liger_baseline  # noqa: E402
import summarize_round  # noqa: E402
import torch_baseline  # noqa: E402
from torch_timings import LIGER_IMPL, LIGER_SKIPPED_EXIT  # noqa: E402

SCRIPT = os.path.join(REPO, "benchmarks", "liger_baseline.py")
TINY = ("tiny", 256, 128, 8, 2)  # short name, H, I, E, K: a preset small enough for the CPU


def cpp_presets():
    """{name: (H, I, E, K)} from tests/common/layer_config.h and benchmarks/bench/options.h."""
    with open(os.path.join(REPO, "tests", "common", "layer_config.h")) as f:
        shapes = {name: tuple(int(v) for v in dims.split(","))
                  for name, dims in re.findall(r"constexpr LayerShape (\w+)\{([\d, ]+)\};", f.read())}
    with open(os.path.join(REPO, "benchmarks", "bench", "options.h")) as f:
        names = re.findall(r"\{harness::(\w+), \"([\w-]+)\", \"\w+\"\}", f.read())
    return {name: shapes[constant] for constant, name in names}


def test_python_presets_are_fusemoe_benchs():
    presets = cpp_presets()
    assert {"qwen3-next", "deepseek-v3"} <= set(presets)
    assert presets["qwen3-next"] == (2048, 512, 512, 10)
    assert presets["deepseek-v3"] == (7168, 2048, 256, 8)
    assert {name: shape[1:] for name, shape in torch_baseline.PRESETS.items()} == presets


def test_options_are_torch_baselines():
    args = liger_baseline.parse_args(["--preset", "deepseek-v3", "--tokens", "8192,4096",
                                      "--num-experts", "128", "--iters", "3"])
    assert args.layer == ("DSv3", 7168, 2048, 128, 8)
    assert args.token_list == [8192, 4096] and args.iters == 3
    assert liger_baseline.parse_args([]).layer == torch_baseline.PRESETS["qwen3-30b-a3b"]
    for bad in (["--num-experts", "4"], ["--tokens", "0"], ["--preset", "nope"], ["--fp8"]):
        with pytest.raises(SystemExit) as exit_info:
            liger_baseline.parse_args(bad)
        assert exit_info.value.code == 2, bad
    assert compare_torch.experts_option({"meta": {"num_experts": 128}}) == ["--num-experts", "128"]
    assert compare_torch.experts_option({"meta": {}}) == []


def run_script(tmp_path, package_init, fused_moe=None):
    """liger_baseline.py with a liger_kernel package of the given sources first on sys.path."""
    package = tmp_path / "site" / "liger_kernel"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text(package_init)
    (package / "ops" / "__init__.py").write_text("")
    if fused_moe is not None:
        (package / "ops" / "fused_moe.py").write_text(fused_moe)
    out = tmp_path / "liger.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    result = subprocess.run([sys.executable, SCRIPT, "--json", str(out)], capture_output=True,
                            text=True, timeout=120, env=env)
    return result, json.loads(out.read_text())


@pytest.mark.parametrize("package_init, fused_moe, reason", [
    ("raise ModuleNotFoundError(\"No module named 'liger_kernel'\", name='liger_kernel')", None,
     "skipped: liger_kernel not installed (pip install liger-kernel)"),
    ("", "raise ImportError('triton is too old')",
     "skipped: liger_kernel not importable: ImportError('triton is too old')"),
    ("", None, "skipped: liger_kernel not importable: No module named 'liger_kernel.ops.fused_moe'"),
])
def test_absent_or_broken_liger_is_a_skip(tmp_path, package_init, fused_moe, reason):
    result, data = run_script(tmp_path, package_init, fused_moe)
    assert result.returncode == LIGER_SKIPPED_EXIT == 6, result.stdout + result.stderr
    assert f"liger_baseline: {reason}" in result.stdout
    assert "pass" not in result.stdout
    assert data["tool"] == "liger_baseline" and data["skipped"] == reason[len("skipped: "):]
    assert data["cases"] == [] and "self_check" not in data
    assert data["meta"]["preset"] == "qwen3-30b-a3b"


def stand_in(scale=1.0, seen=None):
    """A liger_kernel.ops.fused_moe module whose LigerFusedMoEFunction is torch_baseline's loop."""
    class LigerFusedMoEFunction:
        @staticmethod
        def apply(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
            if seen is not None:
                seen.append(top_k_index.dtype)
            y = torch_baseline.moe_per_expert_loop(x, top_k_index.long(), top_k_weights,
                                                   gate_up_proj, down_proj, torch.float32)
            return y * scale
    module = types.ModuleType("liger_kernel.ops.fused_moe")
    module.LigerFusedMoEFunction = LigerFusedMoEFunction
    return module


def run_in_process(monkeypatch, tmp_path, module):
    monkeypatch.setitem(torch_baseline.PRESETS, "test-tiny", TINY)
    for name in ("liger_kernel", "liger_kernel.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_moe", module)
    out = tmp_path / "liger.json"
    code = liger_baseline.main(["--device", "cpu", "--preset", "test-tiny", "--tokens", "16,24",
                                "--iters", "2", "--warmup", "0", "--json", str(out)])
    return code, json.loads(out.read_text())


def test_stand_in_is_checked_then_timed(monkeypatch, tmp_path, capsys):
    seen = []
    code, data = run_in_process(monkeypatch, tmp_path, stand_in(seen=seen))
    assert code == 0, capsys.readouterr()
    assert set(seen) == {torch.int32}  # Liger's ids are int32
    check = data["self_check"]
    assert check["pass"] and check["shape"] == "T=203 H=256 I=128 E=8 K=2"
    assert max(check["rel_err"].values()) <= check["tol"]
    assert data["meta"]["tuned_at_tokens"] == 16 and data["meta"]["autotune_seconds"] >= 0
    assert [c["tokens"] for c in data["cases"]] == [16, 24]
    for case in data["cases"]:
        assert [(t["impl"], t["pass"], t["weight_grad_dtype"]) for t in case["timings"]] == [
            (LIGER_IMPL, "forward", "-"), (LIGER_IMPL, "backward", "bf16"),
            (LIGER_IMPL, "forward+backward", "bf16")]
        assert case["valid_rows"] == case["tokens"] * TINY[4]


def test_a_wrong_layer_fails_its_check_and_is_not_timed(monkeypatch, tmp_path, capsys):
    code, data = run_in_process(monkeypatch, tmp_path, stand_in(scale=1.1))
    assert code == 1
    assert not data["self_check"]["pass"] and data["cases"] == []
    assert "SELF-CHECK FAILED" in capsys.readouterr().out


def timing(impl, pass_name, wgrad, ms):
    return {"impl": impl, "pass": pass_name, "weight_grad_dtype": wgrad, "ms_median": ms,
            "tflops": 100.0 / ms}


def round_results(liger_run, liger_rc, note="optional, limit 150 s"):
    meta = {"preset": "qwen3-30b-a3b", "routing": "uniform"}
    passes = (("forward", "-"), ("forward+backward", "bf16"))
    fusemoe = {"tool": "fusemoe_bench", "meta": dict(meta), "ceiling": {"tflops": 800.0},
               "cases": [{"tokens": 4096, "check_status": "pass",
                          "timings": [timing("fused", p, w, 0.5) for p, w in passes]}]}
    torch_run = {"tool": "torch_baseline", "meta": dict(meta, path="grouped_mm"),
                 "self_check": {"pass": True}, "source_file": "1_torch.json",
                 "cases": [{"tokens": 4096,
                            "timings": [timing("torch_grouped_mm", p, w, 2.0) for p, w in passes]}]}
    steps = [{"name": "fusemoe_bench 30b-uniform", "rc": 0, "seconds": 10, "note": ""},
             {"name": "liger_baseline 30b-uniform", "rc": liger_rc, "seconds": 5, "note": note}]
    return {"steps": steps, "fusemoe": [fusemoe], "kernels": [], "torch": [torch_run], "ep": [],
            "liger": [dict(liger_run, tool="liger_baseline", source_file="2_liger.json")]}


def table_rows(summary):
    return {(cells[1], cells[2]): cells[-3:] for cells in
            ([c.strip() for c in line.split("|")] for line in summary.splitlines()
             if line.startswith("| ")) if len(cells) > 8}


def test_summary_sets_liger_beside_pytorch():
    liger = {"meta": {"preset": "qwen3-30b-a3b", "routing": "uniform", "liger_kernel": "0.8.5",
                      "autotune_seconds": 42.0},
             "self_check": {"pass": True, "shape": "T=203 H=2048 I=768 E=32 K=8", "rel_err": {}},
             "cases": [{"tokens": 4096, "timings": [timing(LIGER_IMPL, "forward", "-", 1.0),
                                                    timing(LIGER_IMPL, "forward+backward", "bf16",
                                                           1.0)]}]}
    summary, problems = summarize_round.render(round_results(liger, 0))
    assert problems == [] and "**Round: PASS**" in summary
    rows = table_rows(summary)
    label = summarize_round.LIGER_LABEL
    for pass_name in ("forward", "forward+backward"):
        assert rows[("fused", pass_name)] == ["4.00x", "2.00x", ""], rows  # vs PyTorch, vs Liger
        assert rows[(label, pass_name)] == ["2.00x", "1.00x", ""], rows
    assert "first call (autotune) 42 s" in summary
    assert "Optional baselines" not in summary


def test_a_skipped_or_failed_liger_never_fails_the_round():
    skipped = {"meta": {"preset": "qwen3-30b-a3b", "routing": "uniform"}, "cases": [],
               "skipped": liger_baseline.NOT_INSTALLED}
    summary, problems = summarize_round.render(round_results(skipped, LIGER_SKIPPED_EXIT))
    assert problems == [] and "**Round: PASS**" in summary
    assert f"Liger-Kernel baseline skipped: {liger_baseline.NOT_INSTALLED}" in summary
    assert "liger_baseline 30b-uniform exited 6" in summary
    assert "vs Liger" not in summary  # no Liger figures, no column

    failed = {"meta": {"preset": "qwen3-30b-a3b", "routing": "uniform"}, "cases": [],
              "self_check": {"pass": False, "rel_err": {"y": 0.5}}, "error": ""}
    summary, problems = summarize_round.render(round_results(failed, 1))
    assert problems == []
    assert "Liger-Kernel self-check **FAIL**: not timed" in summary

    # The same exit code from a step that is not optional is a failure.
    results = round_results(skipped, LIGER_SKIPPED_EXIT, note="")
    assert summarize_round.verdict(results) == ["liger_baseline 30b-uniform exited 6"]


def test_summary_says_when_fusemoe_ran_fewer_experts():
    results = round_results({"meta": {}, "cases": [], "skipped": "x"}, LIGER_SKIPPED_EXIT)
    note = "E reduced 256 -> 128: 202.5 GiB needed at E=256, 139.0 GiB free (108.0 GiB at E=128)"
    results["fusemoe"][0]["meta"].update(experts_reduced=note, num_experts=128)
    summary, _ = summarize_round.render(results)
    assert f"**{note}**: fusemoe ran E=128." in summary


def test_summary_names_per_impl_timing_and_each_impl_clock():
    # fusemoe_bench --timing per-impl: the meta says so and each implementation's clocks are listed.
    results = round_results({"meta": {}, "cases": []}, 6, note="optional")
    f = results["fusemoe"][0]
    f["meta"]["timing"] = "per-impl"
    clocks = {"samples": 50, "sm_mhz_median": 1500.0, "sm_mhz_min": 1400.0, "sm_mhz_max": 1900.0,
              "power_capped_fraction": 1.0}
    f["cases"][0]["clocks"] = clocks
    f["cases"][0]["clocks_by_impl"] = {"fused": dict(clocks, sm_mhz_median=1470.0)}
    summary, _ = summarize_round.render(results)
    assert "Timed implementation after implementation (--timing per-impl):" in summary
    assert "- fused alone: SM 1470 MHz median (1400-1900), power cap in 100% of 50 samples" in summary
    # interleaved says so; a bench from before --timing says nothing
    f["meta"]["timing"] = "interleaved"
    del f["cases"][0]["clocks_by_impl"]
    summary, _ = summarize_round.render(results)
    assert "Timed interleaved (--timing interleaved)" in summary and "alone: SM" not in summary
    del f["meta"]["timing"]
    summary, _ = summarize_round.render(results)
    assert "--timing" not in summary


def test_summary_names_a_minimum_warmup_time():
    results = round_results({"meta": {}, "cases": []}, 6, note="optional")
    meta = results["fusemoe"][0]["meta"]
    meta.update(iters=20, warmup=5)
    summary, _ = summarize_round.render(results)
    assert "median of 20 after 5 warm-up, CUDA" in summary  # no --warmup-ms: nothing said
    meta["warmup_ms"] = 3000.0
    summary, _ = summarize_round.render(results)
    assert "median of 20 after 5 warm-up (at least 3000 ms per implementation), CUDA" in summary
    meta["timing"] = "interleaved"
    summary, _ = summarize_round.render(results)
    assert "median of 20 after 5 warm-up (at least 3000 ms of the interleaved rounds), CUDA" in summary
