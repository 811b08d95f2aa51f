#!/usr/bin/env python3
"""Summary of scripts/compare_builds.sh: per (preset, T, impl, pass, weight-grad dtype) the
median over rounds of each build's ms, and its ratio to the first build; then each build's SM
clock while timed (the median over its cases of fusemoe_bench's NVML samples), so a ratio can be
read against the clocks it ran at (the GEMMs run at the power cap's clock).

usage: summarize_compare.py PARTS_DIR OUTDIR BUILD_NAME [BUILD_NAME ...]
"""
import glob
import json
import os
import statistics
import sys


def main():
    parts, outdir, builds = sys.argv[1], sys.argv[2], sys.argv[3:]
    runs, times, clocks = [], {}, {}
    for path in sorted(glob.glob(os.path.join(parts, "*.json"))):
        round_, rest = os.path.basename(path)[:-5].split("_", 1)
        build = next((b for b in builds if rest.endswith("_" + b)), None)
        with open(path) as f:
            data = json.load(f)
        runs.append({"round": int(round_), "build": build, "result": data})
        preset = data["meta"]["preset"]
        for case in data["cases"]:
            sampled = case.get("clocks", {})
            if sampled.get("samples", 0) > 0:
                clocks.setdefault(build, []).append(sampled)
            for t in case["timings"]:
                key = (preset, case["tokens"], t["impl"], t["pass"], t["weight_grad_dtype"])
                times.setdefault(key, {}).setdefault(build, []).append(t["ms_median"])
    with open(os.path.join(outdir, "compare.json"), "w") as f:
        json.dump({"builds": builds, "runs": runs}, f)
    lines = ["| preset | T | impl | pass | wgrad | " + " | ".join(f"{b} ms" for b in builds) + " | " +
             " | ".join(f"{b}/{builds[0]}" for b in builds[1:]) + " |",
             "|" + " --- |" * (5 + 2 * len(builds) - 1)]
    for key in sorted(times):
        medians = [statistics.median(times[key][b]) if times[key].get(b) else None for b in builds]
        cells = [f"{m:.3f}" if m is not None else "missing" for m in medians]
        ratios = [f"{m / medians[0]:.3f}" if m is not None and medians[0] else "-" for m in medians[1:]]
        lines.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " | " +
                     " | ".join(ratios) + " |")
    clock_lines = []
    for b in builds:
        if not clocks.get(b):
            clock_lines.append(f"- {b}: clocks not sampled (no NVML)")
            continue
        mhz = statistics.median(c["sm_mhz_median"] for c in clocks[b])
        capped = statistics.median(c["power_capped_fraction"] for c in clocks[b])
        clock_lines.append(f"- {b}: SM {mhz:.0f} MHz, power cap in {100 * capped:.0f}% of the samples "
                           f"(medians over {len(clocks[b])} timed cases)")
    lines += ["", "SM clock while timed:", *clock_lines]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(outdir, "compare.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
