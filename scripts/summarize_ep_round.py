#!/usr/bin/env python3
"""Summary of scripts/ep_multi_gpu_round.sh: the peer copy rate, then per case, routing and pass
the fusemoe EP layer's time and TFLOP/s per GPU beside the torchtitan-style all-to-all baseline
and the single-GPU fused layer at the same tokens per GPU (all from the same run), with the
issue's floors (EP2 >= 90% of the single-GPU layer per GPU; >= 1.8x the baseline's fwd+bwd); then
the Python EP suite's last line. Markdown on stdout; exit 1 when a case failed its check or is
missing, or the suite did not pass.

usage: summarize_ep_round.py OUTDIR R
"""
import glob
import json
import os
import re
import sys

SINGLE_PASS = {"forward": ("forward", "-"), "forward+backward": ("forward+backward", "bf16")}


def single_tflops(outdir, preset, routing, tokens, pass_name):
    """The single-GPU fused layer's TFLOP/s (z saved, bf16 weight gradients) or None."""
    path = os.path.join(outdir, f"single_{preset}_{routing}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    want_pass, want_dtype = SINGLE_PASS[pass_name]
    for case in data.get("cases", []):
        if case["tokens"] != tokens:
            continue
        for t in case["timings"]:
            if t["impl"] == "fused_saved_z" and t["pass"] == want_pass and t["weight_grad_dtype"] == want_dtype:
                return t["tflops"]
    return None


def main():
    outdir, ranks = sys.argv[1], int(sys.argv[2])
    ok = True
    print(f"# Expert-parallel round, R = {ranks} GPUs\n")
    nvlink = os.path.join(outdir, "nvlink.txt")
    if os.path.exists(nvlink):
        with open(nvlink) as f:
            for line in f:
                if line.strip():
                    print(f"- {line.strip()}")
    print("\nPer GPU, from one run; EP and the baseline under torchrun with a GPU per rank, the "
          "single-GPU layer (`fusemoe_bench`, z saved, bf16 weight gradients) on GPU 0 at the same "
          "tokens per GPU. Floors: EP >= 0.90x the single-GPU layer (EP2), >= 1.8x the baseline's "
          "fwd+bwd.\n")
    print("| preset | routing | tokens per GPU | pass | fusemoe EP ms | EP TFLOP/s per GPU | baseline TFLOP/s "
          "per GPU | EP / baseline | single-GPU TFLOP/s | EP / single-GPU | check (worst rel. L2) |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    pattern = re.compile(r"ep_(.+)_(\d+)_(uniform|skewed)\.log$")
    for log in sorted(glob.glob(os.path.join(outdir, "ep_*.log"))):
        m = pattern.search(os.path.basename(log))
        if not m:
            continue
        preset, per_gpu, routing = m.group(1), int(m.group(2)), m.group(3)
        path = log[:-4] + ".json"
        if not os.path.exists(path):
            print(f"| {preset} | {routing} | {per_gpu} | - | failed: see {os.path.basename(log)} | | | | | | |")
            ok = False
            continue
        with open(path) as f:
            result = json.load(f)
        errors = list((result.get("check") or {}).values())
        # NaN if any output's error is (max() would keep a number compared before it).
        worst = float("nan") if not errors or any(e != e for e in errors) else max(errors)
        if not result["timings"]:
            print(f"| {preset} | {routing} | {per_gpu} | - | not timed (check failed) | | | | | | {worst:.2e} |")
            ok = False
            continue
        for pass_name in SINGLE_PASS:
            rows = {t["impl"].split(" (")[0]: t for t in result["timings"] if t["pass"] == pass_name}
            ep, base = rows.get("fusemoe EP"), rows.get("torchtitan-style")
            if ep is None or base is None:
                ok = False
                continue
            single = single_tflops(outdir, preset, routing, per_gpu, pass_name)
            vs_single = f"{ep['tflops_per_rank'] / single:.2f}x" if single else "n/a"
            single_cell = f"{single:.1f}" if single else "n/a"
            print(f"| {preset} | {routing} | {per_gpu} | {pass_name} | {ep['ms']:.3f} | {ep['tflops_per_rank']:.1f} | "
                  f"{base['tflops_per_rank']:.1f} | {base['ms'] / ep['ms']:.2f}x | {single_cell} | {vs_single} | "
                  f"{worst:.2e} |")
    pytest_log = os.path.join(outdir, "pytest_ep.log")
    if os.path.exists(pytest_log):
        with open(pytest_log) as f:
            text = f.read()
        # pytest -v: a line per test; the summary line comes last unless the run was cut short.
        counts = {word: len(re.findall(rf"::\S+ {word}\b", text)) for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
        summary = re.search(r"=+ (.*(passed|failed|error).*) in [0-9.]+s", text)
        done = summary.group(1) if summary else (
            f"cut short: {counts['PASSED']} passed, {counts['FAILED']} failed, {counts['SKIPPED']} skipped "
            "before the timeout")
        failed = re.findall(r"::(\S+) (?:FAILED|ERROR)\b", text)
        print(f"\nPython EP suite on the GPUs (`tests/python/test_expert_parallel.py`): {done}"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
        if not summary or counts["FAILED"] or counts["ERROR"] or "failed" in done or "error" in done:
            ok = False
    else:
        print("\nPython EP suite: not run")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
