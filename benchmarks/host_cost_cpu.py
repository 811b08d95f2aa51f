#!/usr/bin/env python3
"""Host time of fusemoe's Python layer per call, measured on the CPU: no GPU, no kernel.

Each fusemoe op gets a CPU kernel that only allocates its outputs (tiny shapes, so allocations
and autograd's gradient adds cost what they cost for any tensor), and the timed calls then run
everything of a real call but the C++ kernel: fusemoe.moe_experts, the dispatcher, the autograd
kernel and formula (python/fusemoe/ops.py), the autograd engine and AccumulateGrad. That is the
host time above the C ABI which does not depend on the device, so changes to the Python layer
can be measured without one (docs/perf.md#host-cost-of-the-op). It misses what only a GPU
shows: the C++ kernel's checks and allocations, CUDA's autograd worker thread, launch latency.

Rows: each stand-in kernel through torch.ops (a Python kernel, where the real one is C++: what
every row pays for it), the op's forward without and with autograd, backward() of a kept
one-layer graph (op_overhead.py's row: .grad accumulated, so AccumulateGrad adds), the backward
per layer of a chain of --layers layers under one backward() (the fixed cost of a backward()
call shared out, as in a model), forward + backward, and the same graph with the least autograd
formula over these ops ("PyTorch floor": what PyTorch charges any Python autograd op of this
signature). Median over --bursts bursts of --calls calls each. --profile ROW prints a cProfile
of that row instead.
Usage: python3 benchmarks/host_cost_cpu.py [--calls 200] [--bursts 40] [--json OUT]
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
"""
import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import fusemoe  # noqa: E402

TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2, 8, 4, 2, 1  # tiny: no row costs compute


def forward_stub(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, grad_in_place=False,
                 save_z=False, swiglu_clamp=None):
    """The forward's outputs (y, z) as the C++ kernel allocates them, without computing them."""
    z_shape = (x_TH.shape[0] * topk_idx_TK.shape[1], 2 * w2_EHI.shape[2]) if save_z else (0,)
    return torch.empty_like(x_TH), x_TH.new_empty(z_shape)


def backward_stub(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                  saved_z_SF=None, swiglu_clamp=None):
    return (torch.empty_like(x_TH), torch.empty_like(topk_weights_TK), torch.empty_like(w13_EFH),
            torch.empty_like(w2_EHI))


def backward_into_stub(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dw13_EFH,
                       dw2_EHI, accumulate, impl, saved_z_SF=None, swiglu_clamp=None):
    return torch.empty_like(x_TH), torch.empty_like(topk_weights_TK)


def register_stubs():
    for name, stub in (("moe_experts_forward", forward_stub),
                       ("moe_experts_backward", backward_stub),
                       ("moe_experts_backward_into", backward_into_stub)):
        torch.library.register_kernel(f"fusemoe::{name}", "cpu")(stub)


class FloorFunction(torch.autograd.Function):
    """The least a Python autograd formula over these ops can do: the forward op below autograd,
    the same tensors saved, the backward op. What PyTorch charges any such op of this signature
    (the engine, Function.apply, the dispatcher, AccumulateGrad) with fusemoe's code taken out."""

    @staticmethod
    def forward(ctx, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, grad_in_place,
                save_z, swiglu_clamp):
        with torch._C._AutoDispatchBelowAutograd():
            y_TH, z_SF = torch.ops.fusemoe.moe_experts_forward.default(
                x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, grad_in_place, save_z,
                swiglu_clamp)
        ctx.mark_non_differentiable(z_SF)
        ctx.save_for_backward(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, z_SF)
        return y_TH, z_SF

    @staticmethod
    def backward(ctx, dy_TH, _dz):
        x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, z_SF = ctx.saved_tensors
        dx_TH, dw_TK, dw13_EFH, dw2_EHI = torch.ops.fusemoe.moe_experts_backward.default(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, "fused", z_SF, None)
        return dx_TH, None, dw_TK, dw13_EFH, dw2_EHI, None, None, None, None


def floor_experts(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI):
    return FloorFunction.apply(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, "fused", False,
                               True, None)[0]


def layer_inputs(generator):
    w13_EFH = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN,
                                             generator=generator).bfloat16())
    w2_EHI = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTERMEDIATE,
                                            generator=generator).bfloat16())
    return w13_EFH, w2_EHI


def rows(num_layers):
    """(name, function) of each timed row."""
    g = torch.Generator().manual_seed(0)
    x_TH = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    idx_TK = torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=g, dtype=torch.int32)
    w_TK = torch.rand(TOKENS, TOP_K, generator=g)
    dy_TH = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    xg_TH = x_TH.clone().requires_grad_()
    w13_EFH, w2_EHI = layer_inputs(g)
    chain = [layer_inputs(g) for _ in range(num_layers)]

    def experts(fn, x, weights, **kwargs):
        return fn(x, idx_TK, w_TK, *weights, **kwargs)

    def chain_of(fn):
        y = xg_TH
        for weights in chain:
            y = experts(fn, y, weights)
        return y

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def below_autograd(fn):
        def run():
            with torch._C._AutoDispatchBelowAutograd():
                fn()
        return run

    def per_layer(fn):
        fn.per_call = num_layers  # the time of one call covers num_layers layers
        return fn

    moe = fusemoe.moe_experts
    forward_op = torch.ops.fusemoe.moe_experts_forward.default
    backward_op = torch.ops.fusemoe.moe_experts_backward.default
    weights = (w13_EFH, w2_EHI)
    kept = experts(moe, xg_TH, weights)
    kept_chain = chain_of(moe)
    floor_kept = experts(floor_experts, xg_TH, weights)
    floor_chain = chain_of(floor_experts)
    return [
        ("stand-in forward kernel through torch.ops, below autograd", below_autograd(
            lambda: forward_op(x_TH, idx_TK, w_TK, w13_EFH, w2_EHI, "fused", False, True, None))),
        ("stand-in backward kernel through torch.ops", lambda: backward_op(
            dy_TH, x_TH, idx_TK, w_TK, w13_EFH, w2_EHI, "fused", None, None)),
        ("moe_experts forward, no grad", no_grad(lambda: experts(moe, x_TH, weights))),
        ("forward with autograd (graph built)", lambda: experts(moe, xg_TH, weights)),
        ("backward() of a kept graph", lambda: kept.backward(dy_TH, retain_graph=True)),
        (f"backward per layer, {num_layers} layers per backward()",
         per_layer(lambda: kept_chain.backward(dy_TH, retain_graph=True))),
        ("forward + backward", lambda: experts(moe, xg_TH, weights).backward(dy_TH)),
        ("forward + backward, grad_in_place",
         lambda: experts(moe, xg_TH, weights, grad_in_place=True).backward(dy_TH)),
        ("PyTorch floor: forward with autograd", lambda: experts(floor_experts, xg_TH, weights)),
        ("PyTorch floor: backward() of a kept graph",
         lambda: floor_kept.backward(dy_TH, retain_graph=True)),
        (f"PyTorch floor: backward per layer, {num_layers} layers",
         per_layer(lambda: floor_chain.backward(dy_TH, retain_graph=True))),
    ]


def per_call_us(fn, calls, bursts):
    """Median over bursts of the mean time per call in a burst (after one burst of warm-up)."""
    for _ in range(calls):
        fn()
    samples = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples) / getattr(fn, "per_call", 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls per burst")
    p.add_argument("--bursts", type=int, default=40, help="bursts per median")
    p.add_argument("--layers", type=int, default=8, help="layers of the chain rows")
    p.add_argument("--profile", metavar="ROW", help="cProfile the row whose name starts so")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    register_stubs()
    table = rows(args.layers)
    if args.profile:
        name, fn = next((r for r in table if r[0].startswith(args.profile)), (None, None))
        if fn is None:
            sys.exit(f"no row starts with {args.profile!r}: {[r[0] for r in table]}")
        profile = cProfile.Profile()
        profile.runcall(lambda: [fn() for _ in range(args.calls * args.bursts)])
        print(f"cProfile of {name!r}, {args.calls * args.bursts} calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    results = [(name, per_call_us(fn, args.calls, args.bursts)) for name, fn in table]
    print(f"fusemoe host time per call on the CPU (stand-in kernels), torch {torch.__version__}")
    print(f"path: {fusemoe.native_binding_status()}")
    print(f"median of {args.bursts} bursts of {args.calls} calls, us per call:")
    for name, us in results:
        print(f"  {us:8.2f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": fusemoe.native_binding_status(), "torch": torch.__version__,
                       "us": dict(results)}, f, indent=1)


if __name__ == "__main__":
    main()
