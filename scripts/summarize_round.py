#!/usr/bin/env python3
"""Merges one GPU round's JSON files into OUTDIR/results.json and writes OUTDIR/summary.md.

Input (PARTS, default OUTDIR/parts): the --json files of fusemoe_bench (tool "fusemoe_bench"),
fusemoe_kernel_bench (tool "fusemoe_kernel_bench"), benchmarks/torch_baseline.py (tool
"torch_baseline") and benchmarks/liger_baseline.py (tool "liger_baseline"), and steps.tsv (one
line per step of scripts/gpu_round.sh: name, exit code, seconds, note). Without PARTS, re-renders
summary.md from an existing results.json. summary.md: one table per case (preset, routing, T)
with the fusemoe implementations, the PyTorch path and Liger-Kernel side by side (ms, TFLOP/s, %
of the cuBLAS ceiling measured by fusemoe_bench in the same round, speedup against PyTorch and,
where Liger ran, against Liger), then the correctness lines; then one table per kernel-benchmark
case (each sm90 GEMM instance against cuBLAS grouped and dense GEMMs of the same size).
Optional steps (note "optional ...", the Liger baseline) never fail the round: their exit codes
and a Liger run's skip, error or failed self-check are listed beside the verdict.
Standard library only. Exit: 0 written, 2 nothing to summarise.
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_times_table import grouped_labels, pass_labels  # noqa: E402
from torch_timings import FP8_IMPL, baseline_by_pass, is_baseline  # noqa: E402

PASS_ORDER = ["forward", "backward", "forward+backward"]


def load_parts(parts_dir):
    fusemoe_runs, kernel_runs, torch_runs, ep_runs, liger_runs, steps = [], [], [], [], [], []
    for path in sorted(glob.glob(os.path.join(parts_dir, "*.json"))):
        name = os.path.basename(path)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as error:
            steps.append({"name": f"read {name}", "rc": 1, "seconds": 0, "note": repr(error)})
            continue
        data["source_file"] = name
        tool = data.get("tool")
        (torch_runs if tool == "torch_baseline" else kernel_runs if tool == "fusemoe_kernel_bench"
         else ep_runs if tool == "fusemoe_ep_bench" else liger_runs if tool == "liger_baseline"
         else fusemoe_runs).append(data)
    steps_path = os.path.join(parts_dir, "steps.tsv")
    if os.path.exists(steps_path):
        with open(steps_path) as f:
            for line in f:
                fields = line.rstrip("\n").split("\t")
                if len(fields) < 3:
                    continue
                steps.append({"name": fields[0], "rc": int(fields[1]), "seconds": float(fields[2]),
                              "note": fields[3] if len(fields) > 3 else ""})
    round_meta = {}
    round_path = os.path.join(parts_dir, "round.tsv")
    if os.path.exists(round_path):
        with open(round_path) as f:
            for line in f:
                key, _, value = line.rstrip("\n").partition("\t")
                if key:
                    round_meta[key] = value
    return {"steps": steps, "fusemoe": fusemoe_runs, "kernels": kernel_runs, "torch": torch_runs,
            "ep": ep_runs, "liger": liger_runs, "round": round_meta}


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def case_key(meta, case):
    return (meta.get("preset"), meta.get("routing"), case.get("tokens"))


LIGER_LABEL = "Liger-Kernel (Triton fused MoE)"


def collect_cases(results):
    """{(preset, routing, T): {tool: (meta, case, ceiling)}}, tool "fusemoe", "torch" or "liger"."""
    cases = {}
    for tool in ("fusemoe", "torch", "liger"):
        for run in results.get(tool, []):
            meta = run.get("meta", {})
            ceiling = (run.get("ceiling") or {}).get("tflops")
            for case in run.get("cases", []):
                cases.setdefault(case_key(meta, case), {})[tool] = (meta, case, ceiling)
    return cases


def torch_label(meta, timing=None):
    """The row label of a torch_baseline timing: its bf16 path, or (timing given, not the bf16
    baseline) the other path it names, e.g. the FP8 one of --fp8."""
    if timing is not None:
        impl = timing.get("impl")
        return ("PyTorch FP8 (torch._scaled_grouped_mm, rowwise)" if impl == FP8_IMPL
                else f"PyTorch {impl}")
    if meta.get("path") == "grouped_mm":
        return "PyTorch (torch._grouped_mm)"
    return f"PyTorch FALLBACK per-expert loop ({meta.get('fallback_reason')})"


def describe_clocks(c):
    """'SM 1470 MHz median (1400-1900), power cap in 100% of 50 samples' from a bench clocks dict."""
    return (f"SM {c['sm_mhz_median']:.0f} MHz median ({c['sm_mhz_min']:.0f}-{c['sm_mhz_max']:.0f}), "
            f"power cap in {100 * c['power_capped_fraction']:.0f}% of {c['samples']} samples")


def render_case(key, entry, lines):
    preset, routing, tokens = key
    f_meta, f_case, f_ceiling = entry.get("fusemoe", (None, None, None))
    t_meta, t_case, t_ceiling = entry.get("torch", (None, None, None))
    _, l_case, _ = entry.get("liger", (None, None, None))
    # One ceiling per table: cuBLAS in fusemoe_bench if it ran, else torch.mm in torch_baseline.
    ceiling, ceiling_src = (f_ceiling, "cuBLAS 8192^3 in fusemoe_bench") if f_ceiling \
        else (t_ceiling, "torch.mm 8192^3 in torch_baseline")
    any_case = f_case or t_case or l_case
    lines.append(f"### {preset}, T={tokens}, routing {routing}")
    lines.append("")
    if f_meta and f_meta.get("experts_reduced"):
        lines.append(f"**{f_meta['experts_reduced']}**: fusemoe ran E={f_meta.get('num_experts')}.")
        lines.append("")
    lines.append(f"{any_case.get('valid_rows')} routed rows; rows per expert min "
                 f"{any_case.get('expert_rows_min')}, mean {fmt(any_case.get('expert_rows_mean'), '.0f')}, "
                 f"max {any_case.get('expert_rows_max')}, {any_case.get('experts_empty')} empty"
                 + (" (the PyTorch run draws its own routing from the same distribution: "
                    f"max {t_case.get('expert_rows_max')})" if f_case and t_case else "")
                 + f". Ceiling {fmt(ceiling, '.0f')} TFLOP/s ({ceiling_src}"
                 + (f"; torch.mm {t_ceiling:.0f}" if f_ceiling and t_ceiling else "") + ").")
    # The clock the fusemoe timings ran at (NVML samples; the GEMMs run at the power cap's clock).
    clocks = (f_case or {}).get("clocks") or {}
    if clocks.get("samples", 0) > 0:
        mode = {"per-impl": " Timed implementation after implementation (--timing per-impl):",
                "per-pass": " Timed pass after pass, each (pass, implementation) in a block of its own (--timing per-pass):",
                "interleaved": " Timed interleaved (--timing interleaved): the implementations share one clock."}
        lines.append(f"fusemoe timed at {describe_clocks(clocks)}."
                     + mode.get((f_meta or {}).get("timing"), ""))
    for impl, c in ((f_case or {}).get("clocks_by_impl") or {}).items():
        if c.get("samples", 0) > 0:
            lines.append(f"- {impl} alone: {describe_clocks(c)}")
    lines.append("")
    # The speedups are against the bf16 PyTorch path only (benchmarks/torch_timings.py).
    torch_ms = {pass_name: t.get("ms_median") for pass_name, t in
                baseline_by_pass(t_meta, (t_case or {}).get("timings")).items()}
    # Liger's bf16 weight gradients: fusemoe rows of either dtype compare with them, as with PyTorch.
    liger_ms = {t.get("pass"): t.get("ms_median") for t in (l_case or {}).get("timings", [])}
    rows = []
    if f_case:
        for t in f_case.get("timings", []):
            rows.append((t["impl"], t))
    if t_case:
        for t in t_case.get("timings", []):
            rows.append((torch_label(t_meta) if is_baseline(t_meta, t) else torch_label(t_meta, t),
                         t))
    for t in (l_case or {}).get("timings", []):
        rows.append((LIGER_LABEL, t))
    rows.sort(key=lambda r: PASS_ORDER.index(r[1]["pass"]) if r[1]["pass"] in PASS_ORDER else 99)
    lines.append("| impl | pass | weight grads | ms | TFLOP/s | % ceiling | vs PyTorch |"
                 + (" vs Liger |" if liger_ms else ""))
    lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if liger_ms else ""))
    for label, t in rows:
        ms, tflops = t.get("ms_median"), t.get("tflops")
        pct = 100.0 * tflops / ceiling if tflops is not None and ceiling else None
        cells = ""
        for base_ms in (torch_ms, liger_ms) if liger_ms else (torch_ms,):
            base = base_ms.get(t["pass"])
            speedup = base / ms if base and ms else None
            cells += f" {fmt(speedup, '.2f') + 'x' if speedup else 'n/a'} |"
        lines.append(f"| {label} | {t['pass']} | {t.get('weight_grad_dtype')} | {fmt(ms, '.3f')} | "
                     f"{fmt(tflops, '.1f')} | {fmt(pct, '.1f')} |{cells}")
    if not f_case:
        lines.append("")
        lines.append("**fusemoe_bench produced no figures for this case.**")
    if not t_case:
        lines.append("")
        lines.append("**torch_baseline produced no figures for this case.**")
    lines.append("")
    if f_case:
        lines.append(f"Correctness vs the fp32 GPU reference: **{f_case.get('check_status')}**")
        checks = f_case.get("checks", [])
        if checks:
            lines.append("")
            lines.append("| impl | output | weight grads | rel err | max abs err | calc_diff | non-finite | result |")
            lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
            for c in checks:
                nonfinite = (c.get("nonfinite") or 0) + (c.get("nonfinite_reference") or 0)
                lines.append(f"| {c['impl']} | {c['output']} | {c.get('weight_grad_dtype')} | "
                             f"{fmt(c.get('rel_err'), '.2e')} | {fmt(c.get('max_abs_err'), '.2e')} | "
                             f"{fmt(c.get('calc_diff'), '.2e')} | {nonfinite} | "
                             f"{'pass' if c.get('pass') else '**FAIL**'} |")
        lines.append("")
    # fusemoe_bench --kernel-times (the round's BENCH_KERNEL_TIMES=1): each kernel inside the layer.
    traced = (f_case or {}).get("kernel_times")
    if traced:
        lines.append(f"Kernels inside the layer (fusemoe_bench --kernel-times, median µs over the traced calls): "
                     f"{traced.get('status')}")
        # Their clocks (benches from 865cbab on): the traced calls follow >= 500 ms of untraced ones,
        # and their absolute times depend on the power cap's state (docs/perf.md#kernels-inside-the-layer).
        for impl, c in (traced.get("clocks_by_impl") or {}).items():
            if c.get("samples", 0) > 0:
                lines.append(f"- {impl} traced at {describe_clocks(c)}")
        for p in traced.get("passes", []):
            kernels = p.get("kernels", [])
            if len(kernels) <= 16:
                parts = "; ".join(f"{label} {k['us_median']:.0f}" for label, k in zip(pass_labels(kernels), kernels))
            else:  # hundreds of launches (the unfused path): each role's sum and count
                parts = "; ".join(f"{label} {us:.0f}" + (f" ({count} launches)" if count > 1 else "")
                                  for label, count, us in grouped_labels(kernels))
            lines.append(f"- {p['impl']} {p['pass']} ({p.get('weight_grad_dtype')} weight grads): "
                         f"{p.get('kernels_us_median', 0):.0f} = {parts}")
        lines.append("")


def render_kernels(run, lines):
    meta = run.get("meta", {})
    ceiling = (run.get("ceiling") or {}).get("tflops")
    failed = [c for c in run.get("checks", []) if not c.get("pass")]
    lines.append(f"### Kernels ({run['source_file']}): routing {meta.get('routing')}, ceiling "
                 f"{fmt(ceiling, '.0f')} TFLOP/s; check of every instance: "
                 + (f"**{len(failed)} FAIL**" if failed else f"{len(run.get('checks', []))} pass"))
    lines.append("")
    for check in failed:
        lines.append(f"- FAIL {check.get('case')}: {check.get('what')}: {check.get('detail')}")
    if failed:
        lines.append("")
    for case in run.get("cases", []):
        lines.append(f"#### {case.get('preset')}, T={case.get('tokens')}: {case.get('valid_rows')} rows, per expert "
                     f"{case.get('expert_rows_min')}..{case.get('expert_rows_max')}; dgrad block_n "
                     f"{case.get('dgrad_block_n')} by shape; check {case.get('check_status')}")
        lines.append("")
        lines.append("| GEMM | impl | ms | TFLOP/s | % ceiling | vs cuBLAS grouped | vs cuBLAS dense |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for t in case.get("timings", []):
            lines.append(f"| {t.get('gemm')} | {t.get('impl')} | {fmt(t.get('ms_median'), '.3f')} | "
                         f"{fmt(t.get('tflops'), '.1f')} | {fmt(t.get('pct_ceiling'), '.1f')} | "
                         f"{fmt(t.get('speedup_vs_cublas_grouped'), '.2f')} | "
                         f"{fmt(t.get('speedup_vs_cublas_dense'), '.2f')} |")
        lines.append("")


def is_optional(step):
    return step.get("note", "").startswith("optional")


def is_left_out(step):
    """A part of the round that ROUND_PARTS left out (gpu_round.sh): neither a pass nor a failure."""
    return step.get("note", "").startswith("left out")


def optional_notes(results):
    """What the optional steps and the Liger runs did, where it was not a plain success: listed
    beside the verdict, never counted in it."""
    notes = []
    for step in results["steps"]:
        if is_optional(step) and step["rc"] != 0:
            notes.append(f"{step['name']} exited {step['rc']} ({step['note']})")
    for run in results.get("liger", []):
        source = run.get("source_file")
        if run.get("skipped"):
            notes.append(f"Liger-Kernel baseline skipped: {run['skipped']} ({source})")
            continue
        check = run.get("self_check")
        if check is not None and not check.get("pass"):
            notes.append(f"Liger-Kernel self-check **FAIL**: not timed ({source})")
        if run.get("error"):
            notes.append(f"Liger-Kernel error ({source}): {run['error']}")
    return notes


def verdict(results):
    problems = []
    for step in results["steps"]:
        if step["rc"] != 0 and not is_optional(step) and not is_left_out(step):
            problems.append(f"{step['name']} exited {step['rc']}" +
                            (f" ({step['note']})" if step.get("note") else ""))
    for run in results["fusemoe"]:
        for case in run.get("cases", []):
            if case.get("check_status") == "FAIL":
                problems.append(f"correctness FAIL: {run['meta'].get('preset')} "
                                f"{run['meta'].get('routing')} T={case.get('tokens')}")
        if run.get("error"):
            problems.append(f"fusemoe_bench error ({run['source_file']}): {run['error']}")
    for run in results.get("kernels", []):
        failed = sum(1 for c in run.get("checks", []) if not c.get("pass"))
        if failed:
            problems.append(f"fusemoe_kernel_bench: {failed} correctness check(s) FAIL ({run['source_file']})")
        if run.get("error"):
            problems.append(f"fusemoe_kernel_bench error ({run['source_file']}): {run['error']}")
    for run in results["torch"]:
        if not run.get("self_check", {}).get("pass", False):
            problems.append(f"torch_baseline self-check failed or missing ({run['source_file']})")
        if run.get("error"):
            problems.append(f"torch_baseline error ({run['source_file']}): {run['error']}")
        if run.get("meta", {}).get("path") not in (None, "grouped_mm"):
            problems.append(f"torch_baseline used the per-expert loop FALLBACK ({run['source_file']})")
    return problems


def render(results):
    lines = ["# GPU round summary", ""]
    f_meta = results["fusemoe"][0]["meta"] if results["fusemoe"] else {}
    t_meta = results["torch"][0]["meta"] if results["torch"] else {}
    meta = f_meta or t_meta
    if not meta:
        # No benchmark in this round (e.g. ROUND_PARTS=sanitizers): the round's own record.
        round_meta = results.get("round", {})
        lines.append(f"- date {round_meta.get('date')}, commit `{round_meta.get('commit')}`")
        lines.append(f"- GPU {round_meta.get('gpu')}; no benchmark in this round")
    else:
        lines.append(f"- date {meta.get('date')}, commit `{meta.get('commit')}`")
        lines.append(f"- GPU {meta.get('gpu')} ({meta.get('sm_count')} SMs), CUDA driver "
                     f"{f_meta.get('driver_cuda')}, runtime {f_meta.get('runtime_cuda')}, cuBLAS "
                     f"{f_meta.get('cublas_version')}; torch {t_meta.get('torch')} (CUDA {t_meta.get('cuda')})")
        warmup_ms = meta.get("warmup_ms") or 0
        # --warmup-ms covers each timed block: one per implementation, or the one interleaved block.
        block = "of the interleaved rounds" if meta.get("timing") == "interleaved" else "per implementation"
        warm = f" (at least {warmup_ms:.0f} ms {block})" if warmup_ms > 0 else ""
        lines.append(f"- timing: median of {meta.get('iters')} after {meta.get('warmup')} warm-up{warm}, CUDA "
                     f"events, {(meta.get('l2_flush_bytes') or 0) >> 20} MiB L2 flush before each call; "
                     "TFLOP/s count 6*H*I (forward), 12*H*I (backward), 18*H*I (both) per routed row")
        lines.append("- PyTorch: torchtitan-style grouped_mm layer, bf16, autograd (bf16 weight grads), "
                     f"index_add_ in {t_meta.get('combine_dtype')}")
    problems = verdict(results)
    lines.append("")
    left_out = [step["name"] for step in results["steps"] if is_left_out(step)]
    partial = f" (partial round: {', '.join(left_out)} left out)" if left_out else ""
    lines.append(("**Round: PASS**" if not problems else "**Round: FAIL**") + partial)
    for problem in problems:
        lines.append(f"- {problem}")
    lines.append("")
    notes = optional_notes(results)
    if notes:
        lines.append("Optional baselines (not counted in the verdict):")
        for note in notes:
            lines.append(f"- {note}")
        lines.append("")
    if results["steps"]:
        lines.append("| step | exit | seconds | note |")
        lines.append("| --- | ---: | ---: | --- |")
        for step in results["steps"]:
            rc = "-" if is_left_out(step) else step["rc"]  # not run: no exit code to show
            lines.append(f"| {step['name']} | {rc} | {step['seconds']:.0f} | {step.get('note', '')} |")
        lines.append("")
    for run in results["torch"] + results.get("liger", []):
        check = run.get("self_check")
        if check:
            errs = ", ".join(f"{k} {fmt(v, '.1e')}" for k, v in check.get("rel_err", {}).items())
            what = run["meta"].get("path") if run.get("tool") == "torch_baseline" else \
                f"liger-kernel {run['meta'].get('liger_kernel')}, first call (autotune) " \
                f"{fmt(run['meta'].get('autotune_seconds'), '.0f')} s"
            lines.append(f"- {run.get('tool')} self-check ({run['meta'].get('preset')} "
                         f"{run['meta'].get('routing')}, {what}, {check.get('shape')} "
                         f"vs fp32 loop): {'pass' if check.get('pass') else '**FAIL**'} ({errs})")
    lines.append("")
    cases = collect_cases(results)
    for key, entry in cases.items():  # the round's order: parts are named with a step number
        render_case(key, entry, lines)
    for run in results.get("kernels", []):
        render_kernels(run, lines)
    for run in results.get("ep", []):
        lines.append(f"### Expert parallelism, {run.get('mode')}: {run.get('preset')}, {run.get('tokens')} tokens "
                     f"in all, {run.get('routing')} routing (`fusemoe_ep_bench`)")
        lines.append("")
        lines.append("| ranks | pass | EP ms | single-GPU ms | EP / single | EP TFLOP/s |")
        lines.append("| ---: | --- | ---: | ---: | ---: | ---: |")
        for r in run.get("results", []):
            lines.append(f"| {r['ranks']} | {r['pass']} | {r['ep_ms']:.3f} | {r['single_gpu_ms']:.3f} | "
                         f"{r['ratio']:.3f} | {r['ep_tflops']:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n", problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--parts", help="folder of the round's JSON parts (default OUTDIR/parts)")
    args = parser.parse_args()
    parts_dir = args.parts or os.path.join(args.outdir, "parts")
    results_path = os.path.join(args.outdir, "results.json")
    if os.path.isdir(parts_dir) and glob.glob(os.path.join(parts_dir, "*")):
        results = load_parts(parts_dir)
    elif os.path.exists(results_path):
        with open(results_path) as f:
            results = json.load(f)
    else:
        print(f"summarize_round: nothing in {parts_dir} and no {results_path}", file=sys.stderr)
        return 2
    summary, problems = render(results)
    results["verdict"] = {"pass": not problems, "problems": problems}
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.outdir, "summary.md"), "w") as f:
        f.write(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
