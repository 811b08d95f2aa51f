"""Which timings of a benchmarks/torch_baseline.py case are the PyTorch baseline that fusemoe's
figures are compared with (speedups, "vs PyTorch", the chart's PyTorch line): the bf16 path the
run chose (meta["path"], timings of impl "torch_<path>"), never the FP8 path that --fp8 adds to
the same case (impl FP8_IMPL). Matching by pass alone let the FP8 timings overwrite the bf16 ones.
Also the names that tell benchmarks/liger_baseline.py's runs apart.
Standard library only: scripts/plot_tflops.py, scripts/perf_table.py, scripts/summarize_round.py
and benchmarks/compare_torch.py import it (the scripts put benchmarks/ on sys.path).
"""
FP8_IMPL = "torch_scaled_grouped_mm_fp8"  # torch_baseline.py --fp8: torch._scaled_grouped_mm
# benchmarks/liger_baseline.py: its impl name, and its exit code when liger_kernel is not
# importable (a skip, which scripts/summarize_round.py reports as one, never as a pass).
LIGER_IMPL = "liger_fused_moe"
LIGER_SKIPPED_EXIT = 6


def baseline_impl(meta):
    """The impl name of a torch_baseline run's bf16 path ("torch_grouped_mm", ...), or None when
    its meta names no path."""
    path = (meta or {}).get("path")
    return f"torch_{path}" if path else None


def is_baseline(meta, timing):
    """Whether a timing of a torch_baseline run (its meta) is the bf16 baseline: impl
    "torch_<path>"; without a path in the meta, any impl but the FP8 one."""
    impl = baseline_impl(meta)
    return timing.get("impl") == impl if impl else timing.get("impl") != FP8_IMPL


def baseline_by_pass(meta, timings):
    """{pass name: timing} of the bf16 baseline among one case's timings."""
    return {t.get("pass"): t for t in timings or [] if is_baseline(meta, t)}
