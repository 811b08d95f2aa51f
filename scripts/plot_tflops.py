#!/usr/bin/env python3
"""Draws TFLOP/s against tokens per call: fusemoe's fused kernels, the PyTorch grouped_mm path
and the bf16 GEMM ceiling measured in the same run, one panel per (preset, pass).

Input: JSON written by `build/fusemoe_bench --json` and `python3 benchmarks/torch_baseline.py
--json` (any number of files or folders of them, e.g. one per preset), or a GPU round's
results.json (scripts/summarize_round.py), which holds both. Figures are the files' own: useful
TFLOP/s (6·H·I per routed row forward, 12·H·I backward), medians; the ceiling is
fusemoe_bench's cuBLAS 8192^3 (torch.mm's where only torch_baseline ran). A token count whose
correctness check failed is drawn with an x and listed; a figure that is missing or not finite
is left out and listed, never drawn as zero. Only matplotlib is needed beyond the standard
library.

    python3 scripts/plot_tflops.py OUT_DIR/*.json --out docs/img/tflops_vs_tokens.png
Exit: 0 drawn, 2 nothing to draw or bad arguments.
"""
import argparse
import glob
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from torch_timings import is_baseline  # noqa: E402  (benchmarks/torch_timings.py)

PASSES = ("forward", "backward", "forward+backward")
# fusemoe_bench implementation name -> legend label. The op's default path: "fused" forward,
# "fused_saved_z" (the forward saves z) for the backward and forward+backward.
FUSEMOE_LINES = {"fused": "fusemoe fused", "fused_saved_z": "fusemoe fused, z saved"}
PRESET_TITLES = {"qwen3-30b-a3b": "Qwen3-30B-A3B layer", "qwen3-235b-a22b": "Qwen3-235B-A22B layer",
                 "qwen3-next": "Qwen3-Next layer", "deepseek-v3": "DeepSeek-V3 layer"}


def load_runs(paths):
    """(fusemoe runs, torch runs, problems) from files, folders and results.json files."""
    fusemoe_runs, torch_runs, problems = [], [], []
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "*.json")))
        else:
            files.append(path)
    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as error:
            problems.append(f"{path}: not read ({error})")
            continue
        if isinstance(data, dict) and isinstance(data.get("fusemoe"), list):  # results.json
            fusemoe_runs += data["fusemoe"]
            torch_runs += data.get("torch") or []
        elif isinstance(data, dict) and data.get("tool") == "fusemoe_bench":
            fusemoe_runs.append(data)
        elif isinstance(data, dict) and data.get("tool") == "torch_baseline":
            torch_runs.append(data)
        else:
            problems.append(f"{path}: neither fusemoe_bench, torch_baseline nor results.json")
    return fusemoe_runs, torch_runs, problems


def finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def collect(fusemoe_runs, torch_runs, routing, wgrad):
    """series[preset][pass][label] = {T: (tflops, check_ok)}; ceilings[preset] = [tflops];
    meta[preset] = set of (gpu, commit); problems: what was left out and why."""
    series, meta, problems = {}, {}, []
    ceilings = {"fusemoe": {}, "torch": {}}  # tool -> preset -> [tflops]

    def add(preset, pass_name, label, tokens, tflops, check_ok, source):
        if not finite(tflops) or tflops <= 0:
            problems.append(f"{source}: {preset} {pass_name} {label} T={tokens}: no finite "
                            f"TFLOP/s ({tflops!r}), left out")
            return
        series.setdefault(preset, {}).setdefault(pass_name, {}).setdefault(label, {})[tokens] = \
            (float(tflops), check_ok)

    for run, tool in [(r, "fusemoe") for r in fusemoe_runs] + [(r, "torch") for r in torch_runs]:
        run_meta = run.get("meta") or {}
        preset = run_meta.get("preset")
        if run_meta.get("routing", "uniform") != routing or preset is None:
            continue
        meta.setdefault(preset, set()).add((run_meta.get("gpu", "?"), run_meta.get("commit", "?")))
        ceiling = (run.get("ceiling") or {}).get("tflops")
        if finite(ceiling):
            ceilings[tool].setdefault(preset, []).append(float(ceiling))
        if tool == "torch" and run_meta.get("path") not in (None, "grouped_mm"):
            problems.append(f"torch {preset}: path {run_meta.get('path')} "
                            f"({run_meta.get('fallback_reason')}), not grouped_mm")
        for case in run.get("cases") or []:
            tokens = case.get("tokens")
            if not isinstance(tokens, int) or tokens <= 0:
                continue
            status = case.get("check_status", "skipped")
            check_ok = status != "FAIL"
            if not check_ok:
                problems.append(f"{tool} {preset} T={tokens}: correctness check FAILED (drawn x)")
            for timing in case.get("timings") or []:
                pass_name = timing.get("pass")
                if pass_name not in PASSES:
                    continue
                if pass_name != "forward" and timing.get("weight_grad_dtype") != wgrad:
                    continue
                if tool == "torch":
                    if not is_baseline(run_meta, timing):  # e.g. --fp8's timings: not this line
                        continue
                    label = "PyTorch grouped_mm" if run_meta.get("path") == "grouped_mm" \
                        else "PyTorch (fallback loop)"
                else:
                    label = FUSEMOE_LINES.get(timing.get("impl"))
                    if label is None:
                        continue
                add(preset, pass_name, label, tokens, timing.get("tflops"), check_ok,
                    run.get("source_file", tool))
    # One ceiling per preset: fusemoe_bench's cuBLAS one, else torch_baseline's torch.mm one.
    merged = {**ceilings["torch"], **ceilings["fusemoe"]}
    return series, merged, meta, problems


def draw(series, ceilings, meta, out_path, wgrad):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = [p for p in PRESET_TITLES if p in series] + \
        sorted(p for p in series if p not in PRESET_TITLES)
    fig, axes = plt.subplots(len(presets), len(PASSES), figsize=(5.2 * len(PASSES),
                                                                  3.8 * len(presets)),
                             squeeze=False, sharex=True)
    styles = {"fusemoe fused": dict(color="tab:blue", marker="o"),
              "fusemoe fused, z saved": dict(color="tab:green", marker="s"),
              "PyTorch grouped_mm": dict(color="tab:red", marker="^"),
              "PyTorch (fallback loop)": dict(color="tab:red", marker="^", linestyle=":")}
    all_tokens = sorted({t for p in series.values() for lines in p.values()
                         for points in lines.values() for t in points})
    for row, preset in enumerate(presets):
        ceiling = sorted(ceilings.get(preset, []))
        for col, pass_name in enumerate(PASSES):
            ax = axes[row][col]
            lines = series[preset].get(pass_name, {})
            for label in sorted(lines, key=lambda name: list(styles).index(name)
                                if name in styles else 99):
                points = sorted(lines[label].items())
                xs = [t for t, _ in points]
                ys = [v for _, (v, _) in points]
                ax.plot(xs, ys, label=label, **styles.get(label, {}))
                bad = [(t, v) for t, (v, ok) in points if not ok]
                if bad:
                    labelled = "check FAILED" in ax.get_legend_handles_labels()[1]
                    ax.scatter(*zip(*bad), marker="x", s=120, color="black", zorder=5,
                               label=None if labelled else "check FAILED")
            if ceiling:
                median = ceiling[len(ceiling) // 2]
                ax.axhline(median, color="gray", linestyle="--",
                           label=f"bf16 GEMM ceiling ({median:.0f})")
            ax.set_xscale("log", base=2)
            if all_tokens:
                ax.set_xticks(all_tokens)
                ax.set_xticklabels([f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)
                                    for t in all_tokens])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            title = PRESET_TITLES.get(preset, preset)
            ax.set_title(f"{title}: {pass_name}" +
                         ("" if pass_name == "forward" else f" ({wgrad} weight grads)"),
                         fontsize=10)
            if row == len(presets) - 1:
                ax.set_xlabel("tokens per call (T)")
            if col == 0:
                ax.set_ylabel("TFLOP/s (useful FLOPs)")
            if lines or ceiling:
                ax.legend(fontsize=8, loc="best")
    sources = sorted({f"{gpu}, commit {commit}" for p in presets for gpu, commit in meta.get(p, ())})
    fig.suptitle("MoE experts layer, TFLOP/s vs tokens (uniform routing): " + "; ".join(sources),
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="JSON files or folders of them")
    parser.add_argument("--out", default="docs/img/tflops_vs_tokens.png")
    parser.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    parser.add_argument("--wgrad", default="bf16", choices=["bf16", "fp32"],
                        help="weight-gradient dtype of the fusemoe backward lines (PyTorch's "
                             "are bf16, as its bf16 parameters)")
    args = parser.parse_args(argv)
    fusemoe_runs, torch_runs, problems = load_runs(args.inputs)
    series, ceilings, meta, more = collect(fusemoe_runs, torch_runs, args.routing, args.wgrad)
    problems += more
    for line in problems:
        print(f"plot_tflops: {line}", file=sys.stderr)
    if not series:
        print(f"plot_tflops: nothing to draw (routing {args.routing}) in {args.inputs}",
              file=sys.stderr)
        return 2
    draw(series, ceilings, meta, args.out, args.wgrad)
    counts = {preset: sorted({t for lines in passes.values() for points in lines.values()
                              for t in points}) for preset, passes in series.items()}
    print(f"plot_tflops: wrote {args.out} ({'; '.join(f'{p}: T={v}' for p, v in counts.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
