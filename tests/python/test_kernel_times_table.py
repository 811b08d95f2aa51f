"""scripts/kernel_times_table.py on made-up fusemoe_bench --json files with --kernel-times (the real
ones come from the H200): the roles it gives the kernels (names as the C++ ABI demangles them, bool
template arguments as false/true), dW2 before dW13, the ratios to the first run, and its refusal of
a file with no traced kernel times. No GPU, no torch."""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "kernel_times_table.py")
GEMM = "void fusemoe::sm90::sm90_grouped_gemm_kernel<fusemoe::sm90::GroupedGemm<{}> >(fusemoe::sm90::GemmParams<T> const)"
FORWARD = [
    ("fusemoe::(anonymous namespace)::routing_count_kernel(int const*, long, int, int*, int*)", 4.0),
    (GEMM.format("GatheredTokenRowsA, GateUpWeightsB<256>, RowTileScheduler, SwiGLUEpilogue<256, false, true>"), 1500.0),
    (GEMM.format("PoolRowsA, WeightsB<256>, RowTileScheduler, RowStoreEpilogue<256, true, (RowDestination)1>"), 700.0),
    ("void fusemoe::(anonymous namespace)::combine_slots_kernel(__nv_bfloat16 const*, long)", 150.0),
]
BACKWARD = [
    ("fusemoe::(anonymous namespace)::scatter_token_rows_kernel(__nv_bfloat16 const*, int const*, long)", 320.0),
    (GEMM.format("PoolRowsA, TransposedB<128>, RowTileScheduler, DgradSwiGLUEpilogue<128, false, 128>"), 990.0),
    (GEMM.format("PoolRowsA, TransposedB<256>, RowTileScheduler, RowStoreEpilogue<256, false, (RowDestination)1>"),
     1300.0),
    (GEMM.format("PoolRowsTransposedA, TransposedB<256>, ExpertOutputTileScheduler, WeightGradEpilogue<false, false>"),
     670.0),
    (GEMM.format("PoolRowsTransposedA, TransposedB<256>, ExpertOutputTileScheduler, WeightGradEpilogue<false, false>"),
     1320.0),
]


def bench_json(path, scale=1.0, traced=True, events=True):
    def pass_of(name, kernels):
        ks = [{"name": n, "short_name": "", "per_call": 1, "us_median": us * scale, "us_min": us, "us_max": us}
              for n, us in kernels]
        total = sum(k["us_median"] for k in ks)
        p = {"impl": "fused_saved_z", "pass": name, "weight_grad_dtype": "bf16", "calls": 20,
             "kernels_us_median": total, "span_us_median": 0, "note": "", "kernels": ks}
        if events:  # benches before c7cdb1d wrote no events
            p["event_us_median"] = total + 12.0
        return p
    case = {"tokens": 16384, "timings": []}
    if traced:
        case["kernel_times"] = {"status": "traced", "passes": [pass_of("forward", FORWARD),
                                                               pass_of("backward", BACKWARD)]}
    path.write_text(json.dumps({"tool": "fusemoe_bench", "meta": {"preset": "qwen3-30b-a3b"}, "cases": [case]}))


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def test_roles_order_and_ratios(tmp_path):
    bench_json(tmp_path / "a.json")
    bench_json(tmp_path / "b.json", scale=1.1)
    out = run(f"main={tmp_path / 'a.json'}", f"new={tmp_path / 'b.json'}")
    assert out.returncode == 0, out.stderr
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[2:4]): line
            for line in out.stdout.splitlines()[2:]}
    for key in [("forward", "routing"), ("forward", "gate/up"), ("forward", "down"), ("forward", "combine"),
                ("backward", "x, dy pools"), ("backward", "dgrad-1"), ("backward", "dgrad-2"),
                ("backward", "dW2"), ("backward", "dW13"), ("backward", "(kernels' sum)")]:
        assert key in rows, (key, out.stdout)
    assert "| 670.0 | 737.0 | 1.100 |" in rows[("backward", "dW2")]
    assert "| 1320.0 | 1452.0 | 1.100 |" in rows[("backward", "dW13")]
    assert "| 4600.0 |" in rows[("backward", "(kernels' sum)")]
    assert "| 4612.0 |" in rows[("backward", "(events around the pass)")]


def test_files_without_events_have_no_event_row(tmp_path):
    bench_json(tmp_path / "a.json", events=False)
    out = run(str(tmp_path / "a.json"))
    assert out.returncode == 0, out.stderr
    assert "(kernels' sum)" in out.stdout
    assert "(events around the pass)" not in out.stdout


def test_file_without_traced_times_is_refused(tmp_path):
    bench_json(tmp_path / "a.json", traced=False)
    out = run(str(tmp_path / "a.json"))
    assert out.returncode == 2
    assert "--kernel-times" in out.stderr


def test_enum_arguments_tell_the_z_recompute_from_dgrad_of_x():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from kernel_times_table import label_of
    recompute = GEMM.format("PoolRowsA, WeightsB<256>, RowTileScheduler, "
                            "RowStoreEpilogue<256, false, (fusemoe::sm90::RowDestination)0>")
    dgrad_x = GEMM.format("PoolRowsA, TransposedB<256>, RowTileScheduler, "
                          "RowStoreEpilogue<256, false, (fusemoe::sm90::RowDestination)1>")
    assert label_of(recompute) == "z recompute"
    assert label_of(dgrad_x) == "dgrad-2"
    assert label_of(FORWARD[2][0]) == "down"
