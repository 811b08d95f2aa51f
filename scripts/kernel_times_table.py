#!/usr/bin/env python3
"""Per-kernel times inside the layer, side by side for several fusemoe_bench runs: the
`kernel_times` of each --json written with --kernel-times (bench/kernel_times.h). One row per
kernel of each (case, implementation, pass), labelled by its part of the layer (bound_table.role),
one column per run (median us over the traced calls); with two or more runs, each later run's
ratio to the first. Runs of two builds alternated (A, B, A, B) read as the builds' spread.

Usage: python3 scripts/kernel_times_table.py NAME=RUN.json[,RUN.json...] [NAME=...]  (prints Markdown;
the files of one NAME, e.g. one build's cases, make one column). Exit 2 when a column holds no traced
kernel times."""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bound_table import role  # noqa: E402


def label_of(name, fallback=None):
    """bound_table's role of a kernel name as the C++ ABI demangles it: bool template arguments as
    false/true and enum ones as (fusemoe::sm90::RowDestination)1, where Nsight Compute, which role()
    was written for, prints 0/1 and 1. Kernels of no role (cuBLAS's, in the unfused path) go by
    `fallback` (the bench's short name), else the end of their name."""
    normalized = re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", name))
    normalized = re.sub(r"\([\w:]+\)(\d+)", r"\1", normalized)
    return role(normalized) or fallback or name.split("(")[0][-40:]


def pass_labels(kernels):
    """The labels of one pass's kernels in launch order: a role seen twice is numbered, except the
    bf16 weight gradients, dW2 then dW13 (the backward's order)."""
    labels, seen = [], {}
    for k in kernels:
        label = label_of(k["name"], k.get("short_name"))
        count = seen.get(label, 0)
        seen[label] = count + 1
        if label == "dW bf16":
            label = "dW2" if count == 0 else "dW13"
        elif count:
            label = f"{label} ({count + 1})"
        labels.append(label)
    return labels


def grouped_labels(kernels):
    """[(label, count, us)] of one pass, the kernels of one role summed in order of first launch:
    for the passes of hundreds of launches (the unfused path's per-expert cuBLAS GEMMs)."""
    groups = {}
    for k in kernels:
        label = label_of(k["name"], k.get("short_name"))
        count, us = groups.get(label, (0, 0.0))
        groups[label] = (count + 1, us + k["us_median"])
    return [(label, count, us) for label, (count, us) in groups.items()]


def rows_of(path):
    """{(case, impl, pass, label): us} of one run; a label seen twice in a pass is numbered."""
    with open(path) as f:
        result = json.load(f)
    preset = result.get("meta", {}).get("preset", "?")
    rows = {}
    for case in result.get("cases", []):
        traced = case.get("kernel_times")
        if not traced or traced.get("status") != "traced":
            continue
        for p in traced["passes"]:
            for label, k in zip(pass_labels(p["kernels"]), p["kernels"]):
                rows[(f"{preset} T={case['tokens']}", p["impl"], p["pass"], label)] = k["us_median"]
            rows[(f"{preset} T={case['tokens']}", p["impl"], p["pass"], "(kernels' sum)")] = p["kernels_us_median"]
            # CUDA events around the pass (benches from c7cdb1d on): the sum plus the gaps between
            # the kernels and before and after them.
            if p.get("event_us_median"):
                rows[(f"{preset} T={case['tokens']}", p["impl"], p["pass"], "(events around the pass)")] = \
                    p["event_us_median"]
    return rows


def main():
    runs = []
    for arg in sys.argv[1:]:
        name, _, paths = arg.partition("=")
        if not paths:
            name, paths = os.path.basename(arg), arg
        rows = {}
        for path in paths.split(","):
            rows.update(rows_of(path))
        runs.append((name, rows))
    if not runs or any(not rows for _, rows in runs):
        print("usage: kernel_times_table.py NAME=RUN.json ... (each written by fusemoe_bench --kernel-times "
              "--json)", file=sys.stderr)
        return 2
    keys = []
    for _, rows in runs:
        keys += [k for k in rows if k not in keys]
    header = ["case", "impl", "pass", "kernel"] + [f"{n} us" for n, _ in runs]
    header += [f"{n} / {runs[0][0]}" for n, _ in runs[1:]]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] * 4 + ["---:"] * (len(header) - 4)) + " |")
    for key in keys:
        values = [rows.get(key) for _, rows in runs]
        cells = [f"{v:.1f}" if v is not None else "-" for v in values]
        base = values[0]
        cells += [f"{v / base:.3f}" if v is not None and base else "-" for v in values[1:]]
        print("| " + " | ".join(list(key) + cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
