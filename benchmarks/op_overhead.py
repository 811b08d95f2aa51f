#!/usr/bin/env python3
"""Host (CPU) time per call of fusemoe's PyTorch ops, layer by layer of the call path, at a size
where the GPU finishes first (T=256, Qwen3-30B-A3B dims), so wall time per call is CPU time:
  C ABI           _capi.forward / _capi.backward with a ready workspace (C++ checks + launches)
  op, no grad     torch.ops.fusemoe.moe_experts_forward under no_grad (+ Python checks, outputs,
                  workspace, dispatcher)
  op + autograd   forward with autograd, then backward (+ custom-op autograd machinery)
Usage: python3 benchmarks/op_overhead.py [--impl fused] [--calls 30]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import fusemoe  # noqa: E402
from fusemoe import _capi, ops  # noqa: E402


def per_call_us(fn, calls, repeats=5):
    """Best of `repeats` bursts of `calls` calls, each queued behind a ~50 ms GPU sleep and short
    enough (calls x ~25 launches) that the launch queue never fills: the host never waits for
    the GPU, so the time is host time only."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # cycles: tens of ms at H200 clocks
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="fused")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    T, H, I, E, K = args.tokens, 2048, 768, 128, 8
    dev = torch.device("cuda")
    x = (torch.randn(T, H, device=dev) * 0.5).bfloat16()
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).int()
    w = torch.softmax(torch.randn(T, K, device=dev), -1)
    w13 = torch.nn.Parameter((torch.randn(E, 2 * I, H, device=dev) * 0.02).bfloat16())
    w2 = torch.nn.Parameter((torch.randn(E, H, I, device=dev) * 0.02).bfloat16())
    dy = torch.randn(T, H, device=dev).bfloat16()
    layer = _capi.layer(H, I, E, K, T, args.impl)  # the FusemoeCLayer struct, built once
    ws, nbytes = ops._workspace(layer, dev, None)
    y = torch.empty_like(x)
    dx, dtw = torch.empty_like(x), torch.empty_like(w)
    g13, g2 = torch.zeros_like(w13), torch.zeros_like(w2)
    stream = torch.cuda.current_stream().cuda_stream
    report = ops._expert_id_report(dev, E, K)
    rows = []

    def c_forward():
        _capi.forward(layer, x.data_ptr(), idx.data_ptr(), w.data_ptr(), w13.data_ptr(),
                      w2.data_ptr(), y.data_ptr(), T, ws.data_ptr(), nbytes, report, None, stream)

    def c_backward():
        _capi.backward(layer, x.data_ptr(), idx.data_ptr(), w.data_ptr(),
                       w13.data_ptr(), w2.data_ptr(), dy.data_ptr(), dx.data_ptr(), dtw.data_ptr(),
                       g13.data_ptr(), g2.data_ptr(), _capi.WEIGHT_GRAD_BFLOAT16, True, T,
                       ws.data_ptr(), nbytes, report, None, stream)

    def op_forward():
        with torch.no_grad():
            fusemoe.moe_experts(x, idx, w, w13, w2, impl=args.impl)

    def op_backward_into():
        ops.moe_experts_backward_into(dy, x, idx, w, w13, w2, g13, g2, True, args.impl)

    xg = x.clone().requires_grad_()

    def autograd_step(grad_in_place):
        def step():
            out = fusemoe.moe_experts(xg, idx, w, w13, w2, impl=args.impl,
                                      grad_in_place=grad_in_place)
            out.backward(dy)
        return step

    def cuda_device_context():
        with torch.cuda.device(dev):
            pass

    for name, fn in (("  piece: with torch.cuda.device", cuda_device_context),
                     ("  piece: current_stream().cuda_stream",
                      lambda: torch.cuda.current_stream(dev).cuda_stream),
                     ("  piece: _expert_id_report", lambda: ops._expert_id_report(dev, E, K)),
                     ("  piece: _check_inputs", lambda: ops._check_inputs(x, idx, w, w13, w2)),
                     ("  piece: _workspace", lambda: ops._workspace(layer, dev, None)),
                     ("  piece: empty_like(x)", lambda: torch.empty_like(x))):
        rows.append((name, per_call_us(fn, 200)))
    rows.append(("C ABI forward", per_call_us(c_forward, args.calls)))
    rows.append(("C ABI backward", per_call_us(c_backward, args.calls)))
    rows.append(("op forward, no grad", per_call_us(op_forward, args.calls)))
    rows.append(("op backward_into", per_call_us(op_backward_into, args.calls)))
    def forward_autograd():
        fusemoe.moe_experts(xg, idx, w, w13, w2, impl=args.impl)

    out_keep = fusemoe.moe_experts(xg, idx, w, w13, w2, impl=args.impl)

    def backward_only():
        out_keep.backward(dy, retain_graph=True)

    rows.append(("forward with autograd (graph built, no backward)",
                 per_call_us(forward_autograd, args.calls)))
    rows.append(("backward() of a kept graph (engine + _backward + op + AccumulateGrad)",
                 per_call_us(backward_only, args.calls)))
    rows.append(("forward + backward, autograd", per_call_us(autograd_step(False), args.calls)))

    class ViaFunction(torch.autograd.Function):  # the same ops under a plain autograd.Function
        @staticmethod
        def forward(ctx, x_, idx_, w_, w13_, w2_):
            ctx.save_for_backward(x_, idx_, w_, w13_, w2_)
            return torch.ops.fusemoe.moe_experts_forward(x_, idx_, w_, w13_, w2_, args.impl)[0]

        @staticmethod
        def backward(ctx, dy_):
            dx_, dtw_, d13, d2 = torch.ops.fusemoe.moe_experts_backward(
                dy_.contiguous(), *ctx.saved_tensors, args.impl)
            return dx_, None, dtw_, d13, d2

    def function_step():
        ViaFunction.apply(xg, idx, w, w13, w2).backward(dy)

    rows.append(("forward + backward, autograd.Function variant",
                 per_call_us(function_step, args.calls)))
    rows.append(("forward + backward, grad_in_place",
                 per_call_us(autograd_step(True), args.calls)))
    print(f"host time per call, impl={args.impl}, T={T} (GPU {torch.cuda.get_device_name()}):")
    for name, us in rows:
        print(f"  {us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
