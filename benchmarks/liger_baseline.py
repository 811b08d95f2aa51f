#!/usr/bin/env python3
"""Liger-Kernel's Triton fused MoE on one GPU, the peer a Hugging Face user would pick instead.

liger_kernel.ops.fused_moe.LigerFusedMoEFunction (PyPI liger-kernel), timed as
benchmarks/torch_baseline.py times the PyTorch path: the same presets and options, routing draws,
weights, timer (CUDA events, median, L2 flushed), FLOP count and JSON layout; impl
"liger_fused_moe". Liger takes fusemoe's layouts (gate_up_proj w13 [E, 2I, H], gate rows then up;
down_proj w2 [E, H, I]), int32 top-k ids (converted inside the timed call, as its Hugging Face
module does) and the fp32 routing weights; its backward makes bf16 weight gradients.
Its Triton kernels autotune on their first call, keyed on (H, I) (and K for the combine): one
untimed forward + backward at the first T listed tunes them (the seconds go into the JSON), and
every T then runs those configs, as one training run would. The check is torch_baseline's
self-check (the fp32 per-expert loop, same tolerance) at the preset's H, I and K, so it runs the
tuned kernels.
Without liger_kernel it prints "liger_baseline: skipped: liger_kernel not installed (pip install
liger-kernel)", writes --json with "skipped" set and nothing timed, and exits 6.
Exit: 0 ok, 1 self-check failed, 2 bad arguments, 3 no Hopper GPU, 4 runtime error,
6 skipped (liger_kernel not importable).
"""
import argparse
import importlib.metadata
import json
import os
import sys
import time
import traceback

import torch

import torch_baseline as tb  # benchmarks/: run as a script, its folder is on sys.path
from torch_timings import LIGER_IMPL, LIGER_SKIPPED_EXIT

TOOL = "liger_baseline"
NOT_INSTALLED = "liger_kernel not installed (pip install liger-kernel)"


def progress(message):
    print(f"[liger] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    tb.add_shared_arguments(parser)
    # Liger sums a token's K rows in its own kernel: time_case's combine dtype never reaches it.
    parser.set_defaults(combine_dtype=None)
    args = parser.parse_args(argv)
    tb.check_shared_arguments(parser, args)
    return args


def import_liger():
    """(LigerFusedMoEFunction, None), or (None, why the run is skipped)."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ModuleNotFoundError as error:
        if error.name == "liger_kernel":
            return None, NOT_INSTALLED
        return None, f"liger_kernel not importable: {error}"
    except Exception as error:  # installed but broken (a dependency, its Triton): said, not timed
        return None, f"liger_kernel not importable: {error!r}"
    return LigerFusedMoEFunction, None


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def liger_layer(function):
    """torch_baseline's layer signature over LigerFusedMoEFunction."""
    def layer(x_TH, topk_idx_TK, topk_w_TK, w13_EFH, w2_EHI, combine_dtype):
        del combine_dtype  # Liger combines in its own kernel
        return function.apply(x_TH, w13_EFH, w2_EHI, topk_idx_TK.to(torch.int32), topk_w_TK)
    return layer


def autotune(layer, args, weights, device):
    """One forward + backward at the first T listed, where Triton tunes Liger's kernels; seconds."""
    _, hidden, _, num_experts, top_k = args.layer
    num_tokens = args.token_list[0]
    topk_idx_TK, topk_w_TK = tb.make_routing(num_tokens, num_experts, top_k, args.routing,
                                             args.seed, device)
    x_TH = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16).requires_grad_()
    start = time.perf_counter()
    y_TH = layer(x_TH, topk_idx_TK, topk_w_TK.requires_grad_(), *weights, None)
    y_TH.backward(torch.randn_like(y_TH))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    for w in weights:
        w.grad = None
    return seconds


def write_json(args, result):
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        progress(f"wrote {args.json}")


def main(argv=None):
    args = parse_args(argv)
    short, hidden, intermediate, num_experts, top_k = args.layer
    result = {"tool": TOOL, "schema": 1, "meta": {}, "skipped": "", "cases": [], "error": ""}
    function, skipped = import_liger()
    if skipped:
        print(f"{TOOL}: skipped: {skipped}", flush=True)
        result["meta"] = tb.run_meta(args, {"gpu": None})
        result["skipped"] = skipped
        write_json(args, result)
        return LIGER_SKIPPED_EXIT

    device, gpu_meta = tb.find_device(args, TOOL)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 self-check oracle stays fp32
    result["meta"] = {**tb.run_meta(args, gpu_meta),
                      "liger_kernel": package_version("liger-kernel"),
                      "triton": getattr(sys.modules.get("triton"), "__version__", None),
                      "liger_autotune_env": os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "")}
    meta = result["meta"]
    print(f"{TOOL}  commit {meta['commit']}  {meta['date']}")
    print(f"GPU: {meta['gpu']}; torch {torch.__version__}, CUDA {torch.version.cuda}; liger-kernel "
          f"{meta['liger_kernel']}, triton {meta['triton']}")
    print(f"layer {args.preset}: H={hidden} I={intermediate} E={num_experts} K={top_k}; tokens "
          f"{args.tokens}; routing {args.routing}", flush=True)

    exit_code = 0
    layer = liger_layer(function)
    try:
        timer = tb.Timer(device)
        progress("measuring the bf16 GEMM ceiling (torch.mm) ...")
        ceiling = tb.measure_ceiling(timer, device)
        result["ceiling"] = ceiling
        print(f"bf16 GEMM ceiling ({ceiling['what']}): {ceiling['tflops']:.1f} TFLOP/s", flush=True)
        progress(f"{short}: generating weights ...")
        weights = tb.make_weights(args.layer, args.seed, device)
        progress(f"{short}: Liger's autotune, forward + backward at T={args.token_list[0]} ...")
        meta["autotune_seconds"] = autotune(layer, args, weights, device)
        meta["tuned_at_tokens"] = args.token_list[0]
        print(f"first call (Triton autotune) at T={args.token_list[0]}: "
              f"{meta['autotune_seconds']:.1f} s", flush=True)

        progress(f"{short}: self-check ...")
        shape = tb.self_check_shape(hidden, intermediate, top_k)
        errors = tb.self_check(layer, None, device, args.seed, hidden, intermediate, top_k)
        passed = all(err <= tb.REL_ERR_TOL for err in errors.values())  # NaN fails
        result["self_check"] = {"shape": shape, "tol": tb.REL_ERR_TOL, "rel_err": errors,
                                "pass": passed}
        print(f"self-check (Liger) vs fp32 loop, {shape}, tol {tb.REL_ERR_TOL:.0e}: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
              + (" -> pass" if passed else " -> FAIL"), flush=True)
        if not passed:
            print(f"{TOOL}: SELF-CHECK FAILED; not timing a wrong layer", flush=True)
            exit_code = 1
        else:
            for num_tokens in args.token_list:
                case = tb.time_case(layer, LIGER_IMPL, args.layer, num_tokens, args, weights,
                                    timer, device, ceiling)
                result["cases"].append(case)
                tb.print_case(case, meta, ceiling)
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        result["error"] = repr(error)
        print(f"{TOOL}: error: {error!r}", file=sys.stderr)
        exit_code = 4
    write_json(args, result)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
