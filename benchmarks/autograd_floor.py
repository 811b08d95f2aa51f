#!/usr/bin/env python3
"""What PyTorch's autograd charges on the host for an op of fusemoe's signature on CUDA, with no
fusemoe code and no kernel: the floor under issue 17's host targets (docs/perf.md#host-cost-of-the-op).

Two torch.autograd.Function ops over the 30B layer's tensors at T = 256 (x, routing, w13, w2):
- "empty": the backward allocates its four gradients with torch.empty_like and launches nothing;
- "pass": the backward hands dy on as x's gradient and returns no other (the engine's round trip).
Rows per op: forward with autograd (graph built), backward() of a kept one-layer graph (x a leaf
that requires grad, w13 and w2 Parameters whose .grad exist, so AccumulateGrad adds as in
op_overhead.py's row), and the backward per layer of a chain of 8 layers under one backward().
The gradient adds into x's and the weights' .grad launch kernels. Method as op_overhead.py: each burst of calls
is queued behind a GPU sleep so the host never waits for the GPU; best of --repeats bursts.
--device cpu runs the same rows on the CPU at tiny shapes (no launches, adds of a few elements).
Usage: python3 benchmarks/autograd_floor.py [--calls 200] [--repeats 7] [--device cuda|cpu]
                                            [--json OUT]
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
"""
import argparse
import json
import sys

import torch

from host_timing import per_call_us

CUDA_SHAPE = (256, 2048, 768, 128, 8)  # T, H, I, E, K: the 30B layer at op_overhead.py's T
CPU_SHAPE = (2, 8, 4, 2, 1)  # tiny: on the CPU the gradient adds would otherwise be the time
CHAIN_LAYERS = 8


class EmptyGradients(torch.autograd.Function):
    """Forward: y and the saved tensors as fusemoe's formula keeps them. Backward: the four
    gradients allocated, nothing computed."""

    @staticmethod
    def forward(ctx, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI):
        ctx.save_for_backward(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI)
        return torch.empty_like(x_TH)

    @staticmethod
    def backward(ctx, dy_TH):
        x_TH, _idx, topk_weights_TK, w13_EFH, w2_EHI = ctx.saved_tensors
        return (torch.empty_like(x_TH), None, torch.empty_like(topk_weights_TK),
                torch.empty_like(w13_EFH), torch.empty_like(w2_EHI))


class PassThrough(torch.autograd.Function):
    """Backward: dy handed on as x's gradient, no weight or routing gradient: no allocation, the
    engine's round trip and the leaf's add alone."""

    @staticmethod
    def forward(ctx, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI):
        return torch.empty_like(x_TH)

    @staticmethod
    def backward(ctx, dy_TH):
        return dy_TH, None, None, None, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be at least 1")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("autograd_floor: no CUDA device (--device cpu runs the rows on the CPU)", file=sys.stderr)
        return 3
    dev = torch.device(args.device)
    TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = CUDA_SHAPE if cuda else CPU_SHAPE
    x_TH = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    idx_TK = torch.randint(0, EXPERTS, (TOKENS, TOP_K), device=dev, dtype=torch.int32)
    w_TK = torch.rand(TOKENS, TOP_K, device=dev, dtype=torch.float32)
    w13_EFH = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device=dev,
                                             dtype=torch.bfloat16))
    w2_EHI = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device=dev,
                                            dtype=torch.bfloat16))
    dy_TH = torch.randn_like(x_TH)
    xg_TH = x_TH.clone().requires_grad_()
    wg_TK = w_TK.clone().requires_grad_()

    rows = []
    for name, fn in (("empty", EmptyGradients), ("pass", PassThrough)):
        def op(inp):
            return fn.apply(inp, idx_TK, wg_TK, w13_EFH, w2_EHI)
        kept = op(xg_TH)
        chain = xg_TH
        for _ in range(CHAIN_LAYERS):
            chain = op(chain)
        kept.backward(dy_TH, retain_graph=True)  # .grad exists from here on: AccumulateGrad adds
        rows += [
            (f"{name}: forward with autograd",
             per_call_us(lambda: op(xg_TH), args.calls, args.repeats, cuda)),
            (f"{name}: backward() of a kept graph",
             per_call_us(lambda: kept.backward(dy_TH, retain_graph=True), args.calls, args.repeats,
                         cuda)),
            (f"{name}: backward per layer, {CHAIN_LAYERS} layers per backward()",
             per_call_us(lambda: chain.backward(dy_TH, retain_graph=True),
                         max(1, args.calls // CHAIN_LAYERS), args.repeats, cuda) / CHAIN_LAYERS),
        ]
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"autograd floor, torch {torch.__version__}, {device_name}, "
          f"T={TOKENS} H={HIDDEN} I={INTERMEDIATE} E={EXPERTS} K={TOP_K}; host µs per call "
          f"(best of {args.repeats} bursts of {args.calls})")
    width = max(len(r[0]) for r in rows)
    for label, us in rows:
        print(f"  {label:<{width}}  {us:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": device_name,
                       "rows": {label: us for label, us in rows}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
