#!/usr/bin/env python3
"""Peak GPU memory of one forward+backward beyond its inputs, for fusemoe's op and the PyTorch
grouped_mm path (benchmarks/torch_baseline.py), in one process on one GPU (issue 17, item 6).

Inputs (x, routing, w13, w2, dy) are allocated first; the figure is the peak of
torch.cuda.max_memory_allocated during `y = layer(x); y.backward(dy)` minus what was allocated
before, so it counts activations saved for the backward, workspaces, the gradients themselves
(dx, dw13, dw2 in the weights' dtype, the same for every implementation) and temporaries.
Usage: python3 benchmarks/op_memory.py [--preset qwen3-30b-a3b] [--tokens 16384,65536]
                                       [--json PATH]
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import fusemoe  # noqa: E402
from torch_baseline import PRESETS, make_routing, moe_grouped_mm  # noqa: E402

GIB = 1024.0 ** 3


def peak_extra_bytes(step):
    """Runs step() twice (the first warms allocator and caches) and returns the second run's peak
    allocation above the allocation before it."""
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("op_memory: no CUDA device", file=sys.stderr)
        return 3
    _, H, I, E, K = PRESETS[args.preset]
    dev = torch.device("cuda")
    impls = {
        # fusemoe takes int32 expert ids; PyTorch's path the int64 ones make_routing returns.
        "fusemoe fused (saved z)": lambda x, i, w, a, b: fusemoe.moe_experts(x, i.int(), w, a, b),
        "fusemoe fused (recompute z)":
            lambda x, i, w, a, b: fusemoe.moe_experts(x, i.int(), w, a, b, recompute_z=True),
        # torch_baseline.py's default combine is bf16 (the baseline of the GPU round); fp32 beside it.
        "pytorch grouped_mm": lambda x, i, w, a, b: moe_grouped_mm(x, i, w, a, b, torch.bfloat16),
        "pytorch grouped_mm (fp32 combine)":
            lambda x, i, w, a, b: moe_grouped_mm(x, i, w, a, b, torch.float32),
    }
    rows = []
    print(f"op_memory: {args.preset} H={H} I={I} E={E} K={K}, "
          f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    for T in [int(t) for t in args.tokens.split(",")]:
        gen = torch.Generator(device=dev).manual_seed(1234)
        x = (torch.randn(T, H, device=dev, generator=gen) * 0.5).bfloat16().requires_grad_()
        idx, tw = make_routing(T, E, K, "uniform", 1234, dev)
        tw = tw.float().requires_grad_()
        w13 = torch.nn.Parameter((torch.randn(E, 2 * I, H, device=dev, generator=gen) * 0.02).bfloat16())
        w2 = torch.nn.Parameter((torch.randn(E, H, I, device=dev, generator=gen) * 0.02).bfloat16())
        dy = torch.randn(T, H, device=dev, generator=gen).bfloat16()
        for name, fn in impls.items():
            def step():
                for t in (x, tw, w13, w2):
                    t.grad = None
                fn(x, idx, tw, w13, w2).backward(dy)
            extra = peak_extra_bytes(step)
            rows.append({"impl": name, "tokens": T, "peak_extra_bytes": extra,
                         "bytes_per_token": extra / T})
            print(f"  T={T:6d}  {name:28s} {extra / GIB:7.2f} GiB  {extra / T / 1024:8.1f} KiB/token",
                  flush=True)
            for t in (x, tw, w13, w2):
                t.grad = None
            torch.cuda.empty_cache()
        torch_row = next(r for r in rows if r["tokens"] == T and r["impl"] == "pytorch grouped_mm")
        for r in rows:
            if r["tokens"] == T and r["impl"].startswith("fusemoe"):
                r["vs_pytorch"] = r["peak_extra_bytes"] / torch_row["peak_extra_bytes"]
                print(f"  T={T:6d}  {r['impl']:28s} {r['vs_pytorch']:.2f}x PyTorch's peak")
        # Frees them before the next T; rebinding, not del, as step() closes over them.
        x = tw = w13 = w2 = dy = idx = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
