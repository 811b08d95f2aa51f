#!/usr/bin/env python3
"""The current-figures table of docs/perf.md from a GPU round's results.json (scripts/gpu_round.sh):
one row per (preset, T, routing, fusemoe implementation, pass, weight-gradient dtype) with ms,
TFLOP/s, % of the ceiling measured in the same run and the ratio to the PyTorch path timed in
the same round (its bf16 weight gradients for backward passes).

usage: perf_table.py RESULTS_JSON [--impls fused,fused_saved_z]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from torch_timings import baseline_by_pass  # noqa: E402  (benchmarks/torch_timings.py)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results")
    parser.add_argument("--impls", default="fused,fused_saved_z",
                        help="fusemoe implementations to list (comma separated)")
    args = parser.parse_args()
    with open(args.results) as f:
        results = json.load(f)
    wanted = args.impls.split(",")
    torch_ms = {}
    for run in results.get("torch", []):
        meta = run["meta"]
        for case in run["cases"]:
            for pass_name, t in baseline_by_pass(meta, case["timings"]).items():
                torch_ms[(meta["preset"], meta["routing"], case["tokens"], pass_name)] = t["ms_median"]
    print("| preset | T | routing | impl | pass | weight grads | ms | TFLOP/s | % ceiling | vs PyTorch |")
    print("| --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for run in results.get("fusemoe", []):
        meta = run["meta"]
        for case in run["cases"]:
            for t in case["timings"]:
                if t["impl"] not in wanted:
                    continue
                ref = torch_ms.get((meta["preset"], meta["routing"], case["tokens"], t["pass"]))
                ratio = f"{ref / t['ms_median']:.2f}x" if ref else "n/a"
                print(f"| {meta['preset']} | {case['tokens']} | {meta['routing']} | {t['impl']} | {t['pass']} | "
                      f"{t['weight_grad_dtype']} | {t['ms_median']:.3f} | {t['tflops']:.1f} | "
                      f"{t['pct_ceiling']:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
