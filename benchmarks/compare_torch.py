#!/usr/bin/env python3
"""The main job with its comparison: runs build/fusemoe_bench with the given options, then
benchmarks/torch_baseline.py (the PyTorch grouped_mm path) with the options they share, on the
same GPU in the same run, and prints every fusemoe timing with the PyTorch time of the same
pass and token count beside it ("vs PyTorch": PyTorch's median / fusemoe's, > 1 is faster).

    python3 benchmarks/compare_torch.py --bench build/fusemoe_bench [fusemoe_bench options]
scripts/run_main.sh calls this where PyTorch with CUDA is installed. PyTorch's backward makes
bf16 weight gradients (bf16 parameters); fusemoe's lines say which dtype they write. PyTorch runs
the E fusemoe_bench ran (--num-experts: fewer than the preset's where the GPU could not hold them).
Exit: fusemoe_bench's code when it fails (3: no Hopper GPU, ...); else 5 when the PyTorch run
failed (the fusemoe figures above stand, the comparison is missing); else 0.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_timings import baseline_by_pass  # noqa: E402  (benchmarks/torch_timings.py)

# fusemoe_bench options torch_baseline also takes (each with a value).
SHARED_OPTIONS = ("--preset", "--tokens", "--routing", "--iters", "--warmup", "--seed")
EXIT_TORCH_FAILED = 5


def split_options(bench_args):
    """(the options to forward to torch_baseline, the --json path the user gave or None)."""
    shared, json_path = [], None
    i = 0
    while i < len(bench_args):
        arg = bench_args[i]
        name, has_value, value = arg.partition("=")
        if name in SHARED_OPTIONS + ("--json",):
            if not has_value:
                if i + 1 >= len(bench_args):
                    break  # fusemoe_bench has already said what is missing
                value = bench_args[i + 1]
                i += 1
            if name == "--json":
                json_path = value
            else:
                shared += [name, value]
        i += 1
    return shared, json_path


def experts_option(fusemoe):
    """["--num-experts", E] with the E fusemoe_bench ran (fewer than the preset's where the GPU
    could not hold them), so that PyTorch runs the same layer; [] if its JSON does not say."""
    num_experts = fusemoe.get("meta", {}).get("num_experts")
    return ["--num-experts", str(num_experts)] if num_experts else []


def ratio_line(line, torch_line):
    base = (f"  {line['impl']:<14} {line['pass']:<17} {line['weight_grad_dtype']:<5} "
            f"{line['ms_median']:9.3f} {line['tflops']:8.1f}")
    if torch_line is None:
        return base + f"  {'-':>10} {'-':>8}  {'(no PyTorch figure)':>11}"
    speedup = torch_line["ms_median"] / line["ms_median"] if line["ms_median"] else float("nan")
    return (base + f"  {torch_line['ms_median']:10.3f} {torch_line['tflops']:8.1f}"
            f"  {speedup:9.2f}x")


def print_comparison(fusemoe, torch_result):
    meta, tmeta = fusemoe["meta"], torch_result["meta"]
    path = tmeta.get("path")
    label = "torch._grouped_mm" if path == "grouped_mm" else \
        f"FALLBACK per-expert loop ({tmeta.get('fallback_reason')})"
    print(f"\n== fusemoe vs PyTorch ({label}, torch {tmeta.get('torch')}), same GPU, same run; "
          "vs PyTorch = PyTorch ms / fusemoe ms ==")
    torch_cases = {c["tokens"]: c for c in torch_result.get("cases", [])}
    for case in fusemoe.get("cases", []):
        tcase = torch_cases.get(case["tokens"])
        print(f"{meta['preset']} T={case['tokens']} routing={meta['routing']} "
              f"(fusemoe check: {case.get('check_status')})")
        print(f"  {'impl':<14} {'pass':<17} {'wgrad':<5} {'ms':>9} {'TFLOP/s':>8}  "
              f"{'PyTorch ms':>10} {'TFLOP/s':>8}  {'vs PyTorch':>10}")
        torch_by_pass = baseline_by_pass(tmeta, (tcase or {}).get("timings"))
        for line in case.get("timings", []):
            if line["impl"] == "unfused":
                continue  # the cuBLAS baseline: in fusemoe_bench's own table above
            print(ratio_line(line, torch_by_pass.get(line["pass"])))


def load_json(path):
    """The JSON a benchmark wrote, or None after saying why there is no comparison."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        print(f"[main] no PyTorch comparison: {error}", file=sys.stderr)
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    parser.add_argument("--bench", required=True, help="path of fusemoe_bench")
    args, bench_args = parser.parse_known_args()
    if bench_args[:1] == ["--"]:
        bench_args = bench_args[1:]
    if any(a in ("-h", "--help") for a in bench_args):
        return subprocess.call([args.bench, *bench_args])
    shared, user_json = split_options(bench_args)
    with tempfile.TemporaryDirectory(prefix="fusemoe_main.") as scratch:
        bench_json = user_json or os.path.join(scratch, "fusemoe.json")
        extra = [] if user_json else ["--json", bench_json]
        code = subprocess.call([args.bench, *bench_args, *extra])
        if code != 0:
            return code
        fusemoe = load_json(bench_json)
        if fusemoe is None:
            return EXIT_TORCH_FAILED
        shared += experts_option(fusemoe)
        torch_json = (os.path.splitext(user_json)[0] + "_torch.json" if user_json
                      else os.path.join(scratch, "torch.json"))
        print("\n[main] the PyTorch path on the same GPU: benchmarks/torch_baseline.py "
              + " ".join(shared), flush=True)
        torch_code = subprocess.call([sys.executable, os.path.join(HERE, "torch_baseline.py"),
                                      *shared, "--json", torch_json])
        torch_result = load_json(torch_json)
        if torch_result is None:
            return EXIT_TORCH_FAILED
        if torch_code != 0:
            print(f"[main] torch_baseline.py exited {torch_code}: no PyTorch comparison "
                  "(see its output above)", file=sys.stderr)
            return EXIT_TORCH_FAILED
        print_comparison(fusemoe, torch_result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
