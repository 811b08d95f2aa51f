#!/usr/bin/env python3
"""Backward time of fusemoe's op when the experts are frozen (w13 and w2 do not require grad, as
in router-only or attention-only fine-tuning) against the same backward with trainable experts,
in one process on one GPU. Frozen weights' gradient GEMMs are skipped by the library, so the
frozen backward is the dgrad half: dx and d_topk_weights only.

Each case times `y.backward(dy)` of a kept graph (the forward outside the timing) with CUDA
events, the two variants interleaved call by call, L2 flushed before each call; the median of
--iters calls. TFLOP/s count each variant's own useful FLOPs per routed row: trainable 12·H·I
(the two dgrad GEMMs 6·H·I, the two weight-gradient GEMMs 6·H·I), frozen 6·H·I (z is saved by the
forward, the op's default, so neither recomputes it).
Usage: python3 benchmarks/frozen_experts.py [--preset qwen3-30b-a3b] [--tokens 4096,16384]
                                            [--iters 20] [--json PATH]
"""
import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import fusemoe  # noqa: E402
from torch_baseline import PRESETS, make_routing  # noqa: E402


def time_backward(make_graph, dy, flush, iters):
    """Per-call ms of backward() on fresh graphs (make_graph() runs the forward, untimed)."""
    times = []
    for _ in range(iters):
        y, leaves = make_graph()
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.backward(dy)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        del y, leaves
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("frozen_experts: no CUDA device", file=sys.stderr)
        return 3
    _, H, I, E, K = PRESETS[args.preset]
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # > the H200's 50 MB L2
    w13 = (torch.randn(E, 2 * I, H, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) * I ** -0.5).bfloat16()
    print(f"frozen_experts: {args.preset} H={H} I={I} E={E} K={K}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, {fusemoe.native_binding_status()}", flush=True)
    print(f"{'T':>6} {'experts':>9} {'backward ms':>12} {'TFLOP/s':>8} {'vs trainable':>13}")
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, H, device=dev).bfloat16()
        dy = torch.randn(T, H, device=dev).bfloat16()
        idx, w = make_routing(T, E, K, "uniform", 1234, dev)
        idx = idx.int()
        rows = T * K
        flops = {"trainable": 12.0 * H * I * rows, "frozen": 6.0 * H * I * rows}

        def graph(trainable):
            leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(),
                      w13.clone().requires_grad_(trainable), w2.clone().requires_grad_(trainable)]
            return fusemoe.moe_experts(leaves[0], idx, leaves[1], *leaves[2:]), leaves

        times = {"trainable": [], "frozen": []}
        for name in times:  # warm-up: allocator, caches
            time_backward(lambda: graph(name == "trainable"), dy, flush, 3)
        for _ in range(args.iters):
            for name in times:
                times[name] += time_backward(lambda: graph(name == "trainable"), dy, flush, 1)
        base = statistics.median(times["trainable"])
        for name, ts in times.items():
            ms = statistics.median(ts)
            tflops = flops[name] / (ms * 1e-3) / 1e12
            print(f"{T:>6} {name:>9} {ms:>12.3f} {tflops:>8.1f} {ms / base:>12.3f}x", flush=True)
            results.append(dict(tokens=T, experts=name, backward_ms=ms, tflops=tflops,
                                ratio_to_trainable=ms / base, all_ms=ts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, device=torch.cuda.get_device_name(),
                           torch=torch.__version__, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
