#!/usr/bin/env python3
"""What fusemoe's PyTorch op costs beyond its kernels, on the path in use (the native binding, or
ctypes: fusemoe.native_binding_status()) and, for comparison in processes of their own, with the
Python autograd formula (FUSEMOE_NATIVE_AUTOGRAD=0, where the C++ one is in use) and on the
ctypes path (FUSEMOE_NATIVE=0); their figures print in brackets beside the path in use's.

1. Host time per call (Qwen3-30B-A3B dims, T = 256, where the GPU finishes first): each burst of
   calls is queued behind a GPU sleep, so the host never waits and wall time is host time. Rows:
   the C ABI alone (ctypes call, ready workspace), the op through torch.ops, moe_experts with and
   without autograd, backward() of a kept graph, and the backward per layer of 8 layers under
   one backward() (without the fixed cost of a backward() call, as in a model). Targets
   (issue 17): forward with autograd <= 40 us, backward() <= 60 us.
2. GPU time per call at Qwen3-30B-A3B, T = 4096, as fusemoe_bench times it: L2 flushed (a memset
   of 4x L2) before each call, CUDA events around it, no sync between calls, the op and the C ABI
   launch of the same kernels (same workspace sizes, saved z, bf16 weight gradients) interleaved;
   median of --iters. "isolated" repeats it with a sync after the flush, so the GPU also waits for
   the host's work before the first launch. Target: the op within 3% of the C ABI launch. One
   correctness check first: the op's outputs against the C ABI's.
Usage: python3 benchmarks/op_overhead.py [--impl fused] [--no-ctypes] [--no-python-formula]
       [--json OUT]
Exit status 1 when the correctness check fails; the targets are reported, not enforced.
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import fusemoe  # noqa: E402
from host_timing import per_call_us  # noqa: E402
from fusemoe import _capi, ops  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
HOST_TARGETS_US = {"forward with autograd (graph built)": 40.0,
                   "backward() of a kept graph": 60.0}
GPU_TARGET = 1.03


def problem(num_tokens, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x_TH = (torch.randn(num_tokens, HIDDEN, device=device, generator=g) * 0.5).bfloat16()
    idx_TK = torch.rand(num_tokens, EXPERTS, device=device, generator=g).argsort(-1)[:, :TOP_K]
    w_TK = torch.softmax(torch.randn(num_tokens, TOP_K, device=device, generator=g), -1)
    w13_EFH = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device=device, generator=g)
               * HIDDEN ** -0.5).bfloat16()
    w2_EHI = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device=device, generator=g)
              * INTERMEDIATE ** -0.5).bfloat16()
    dy_TH = torch.randn(num_tokens, HIDDEN, device=device, generator=g).bfloat16()
    return x_TH, idx_TK.int().contiguous(), w_TK, w13_EFH, w2_EHI, dy_TH


class CAbi:
    """The C ABI launch of the op's kernels from Python: a ready workspace per call kind, the
    outputs and saved z allocated once, the report the op would pass."""

    def __init__(self, impl, x_TH, idx_TK, w_TK, w13_EFH, w2_EHI, dy_TH, checked_pointers):
        num_tokens = x_TH.shape[0]
        self.layer = _capi.layer(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, num_tokens, impl)
        self.inputs = x_TH, idx_TK, w_TK, w13_EFH, w2_EHI, dy_TH
        self.workspace = torch.empty(self.layer.workspace_bytes(), dtype=torch.uint8, device=x_TH.device)
        self.y_TH, self.dx_TH, self.dw_TK = (torch.empty_like(x_TH), torch.empty_like(x_TH),
                                             torch.empty_like(w_TK))
        self.dw13_EFH, self.dw2_EHI = torch.empty_like(w13_EFH), torch.empty_like(w2_EHI)
        self.z = (torch.empty(_capi.saved_z_bytes(self.layer), dtype=torch.uint8, device=x_TH.device)
                  if impl == "fused" else None)
        self.report = ops._expert_id_report(x_TH.device, EXPERTS, TOP_K)
        self.stream = torch.cuda.current_stream().cuda_stream
        self.checked = checked_pointers

    def forward(self, save_z=False):
        x, idx, w, w13, w2, _ = self.inputs
        _capi.forward(self.layer, x.data_ptr(), idx.data_ptr(), w.data_ptr(), w13.data_ptr(),
                      w2.data_ptr(), self.y_TH.data_ptr(), x.shape[0], self.workspace.data_ptr(),
                      self.workspace.numel(), self.report,
                      self.z.data_ptr() if save_z and self.z is not None else None, self.stream,
                      caller_checked_pointers=self.checked)
        return self.y_TH

    def backward(self, saved_z=False, accumulate=False):
        x, idx, w, w13, w2, dy = self.inputs
        _capi.backward(self.layer, x.data_ptr(), idx.data_ptr(), w.data_ptr(), w13.data_ptr(),
                       w2.data_ptr(), dy.data_ptr(), self.dx_TH.data_ptr(), self.dw_TK.data_ptr(),
                       self.dw13_EFH.data_ptr(), self.dw2_EHI.data_ptr(),
                       _capi.WEIGHT_GRAD_BFLOAT16, accumulate, x.shape[0], self.workspace.data_ptr(),
                       self.workspace.numel(), self.report,
                       self.z.data_ptr() if saved_z and self.z is not None else None, self.stream,
                       caller_checked_pointers=self.checked)
        return self.dx_TH, self.dw_TK, self.dw13_EFH, self.dw2_EHI


# ---- 1. host time ----

CHAIN_LAYERS = 8  # layers under one backward() in the per-layer backward row


def layer_chain(x_TH, idx_TK, w_TK, w13_EFH, w2_EHI, impl, num_layers):
    """The op num_layers times in sequence, each layer with its own copy of the weights as a
    model stacks them; returns the last output (its graph holds every layer)."""
    y_TH = x_TH
    for _ in range(num_layers):
        w13_l, w2_l = (torch.nn.Parameter(w.detach().clone()) for w in (w13_EFH, w2_EHI))
        y_TH = fusemoe.moe_experts(y_TH, idx_TK, w_TK, w13_l, w2_l, impl=impl)
    return y_TH


def host_rows(impl, calls):
    dev = torch.device("cuda")
    x, idx, w, w13, w2, dy = problem(256, dev)
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    c_abi = CAbi(impl, x, idx, w, w13, w2, dy, checked_pointers=True)
    c_abi_queried = CAbi(impl, x, idx, w, w13, w2, dy, checked_pointers=False)
    g13, g2 = torch.zeros_like(w13), torch.zeros_like(w2)
    xg = x.clone().requires_grad_()
    kept = fusemoe.moe_experts(xg, idx, w, w13, w2, impl=impl)
    kept_chain = layer_chain(xg, idx, w, w13, w2, impl, CHAIN_LAYERS)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def step(grad_in_place):
        def run():
            fusemoe.moe_experts(xg, idx, w, w13, w2, impl=impl,
                                grad_in_place=grad_in_place).backward(dy)
        return run

    rows = [
        ("C ABI forward (ctypes; pointers queried by the library)", c_abi_queried.forward),
        ("C ABI forward (ctypes; caller_checked_pointers)", c_abi.forward),
        ("C ABI backward (ctypes; pointers queried by the library)", c_abi_queried.backward),
        ("C ABI backward (ctypes; caller_checked_pointers)", c_abi.backward),
        ("torch.ops forward, no grad", no_grad(
            lambda: torch.ops.fusemoe.moe_experts_forward(x, idx, w, w13, w2, impl))),
        ("torch.ops backward_into", lambda: torch.ops.fusemoe.moe_experts_backward_into(
            dy, x, idx, w, w13, w2, g13, g2, True, impl)),
        ("moe_experts forward, no grad", no_grad(lambda: fusemoe.moe_experts(x, idx, w, w13, w2,
                                                                             impl=impl))),
        ("forward with autograd (graph built)",
         lambda: fusemoe.moe_experts(xg, idx, w, w13, w2, impl=impl)),
        ("backward() of a kept graph", lambda: kept.backward(dy, retain_graph=True)),
        (f"backward per layer, {CHAIN_LAYERS} layers per backward()",
         lambda: kept_chain.backward(dy, retain_graph=True), CHAIN_LAYERS),
        ("forward + backward, autograd", step(False)),
        ("forward + backward, grad_in_place", step(True)),
    ]
    # A row of several layers takes as many fewer calls per burst, so the launch queue never fills.
    return [(name, per_call_us(fn, max(1, calls // layers[0])) / layers[0] if layers
             else per_call_us(fn, calls)) for name, fn, *layers in rows]


# ---- 2. GPU time ----

def gpu_rows(impl, num_tokens, iters, warmup=5):
    dev = torch.device("cuda")
    x, idx, w, w13, w2, dy = problem(num_tokens, dev, seed=1)
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    xg = x.clone().requires_grad_()
    c_abi = CAbi(impl, x, idx, w, w13, w2, dy, checked_pointers=True)
    save_z = impl == "fused"  # what the op does with gradients required

    def op_forward():
        with torch.no_grad():
            return fusemoe.moe_experts(x, idx, w, w13, w2, impl=impl)

    def op_step():
        w13.grad = w2.grad = xg.grad = None  # fresh gradients, as the C ABI writes them
        y = fusemoe.moe_experts(xg, idx, w, w13, w2, impl=impl)
        y.backward(dy)
        return y

    def c_step():
        c_abi.forward(save_z=save_z)
        return c_abi.backward(saved_z=save_z)

    # One correctness check first: the op's outputs are the C ABI's.
    y_op = op_step().detach()
    y_c = c_abi.forward(save_z=save_z).clone()
    grads_c = [t.clone() for t in c_abi.backward(saved_z=save_z)]
    torch.cuda.synchronize()
    checks = []
    for name, got, ref in (("y", y_op, y_c), ("dx", xg.grad, grads_c[0]),
                           ("dw13", w13.grad, grads_c[2]), ("dw2", w2.grad, grads_c[3])):
        err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
        checks.append((name, torch.equal(got, ref), err))

    flush = torch.empty(4 * torch.cuda.get_device_properties(dev).L2_cache_size, dtype=torch.uint8,
                        device=dev)
    pairs = [("forward", op_forward, lambda: c_abi.forward(save_z=False)),
             ("forward + backward", op_step, c_step)]
    rows = []
    for isolated in (False, True):
        for name, op_fn, c_fn in pairs:
            samples = {"op": [], "C ABI": []}
            for i in range(warmup + iters):
                for which, fn in (("op", op_fn), ("C ABI", c_fn)):  # interleaved
                    flush.fill_(i & 0xFF)
                    if isolated:
                        torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    if i >= warmup:
                        samples[which].append((start, end))
            torch.cuda.synchronize()
            medians = {k: statistics.median(s.elapsed_time(e) for s, e in v) for k, v in samples.items()}
            rows.append((f"{name}{', isolated' if isolated else ''}", medians["op"], medians["C ABI"]))
    return checks, rows


def measure(args):
    torch.cuda.init()
    return {"path": fusemoe.native_binding_status(),
            "host_us": host_rows(args.impl, args.calls),
            "gpu": gpu_rows(args.impl, args.tokens, args.iters)}


def comparison(args, label, suffix, env):
    """The measurement in a second process with env set (the other path or formula); its JSON
    result, or None (said) if it failed."""
    out = (args.json or "op_overhead") + f".{suffix}.json"
    if os.path.exists(out):
        os.remove(out)
    command = [sys.executable, os.path.abspath(__file__), "--no-ctypes", "--no-python-formula",
               "--json", out, "--impl", args.impl, "--calls", str(args.calls), "--tokens",
               str(args.tokens), "--iters", str(args.iters)]
    done = subprocess.run(command, env=dict(os.environ, **env), stdout=subprocess.DEVNULL)
    if not os.path.isfile(out):
        print(f"the {label} comparison process failed (exit {done.returncode}): no {out}")
        return None
    with open(out) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", default="fused")
    p.add_argument("--calls", type=int, default=20, help="calls per host-time burst")
    p.add_argument("--tokens", type=int, default=4096, help="T of the GPU-time comparison")
    p.add_argument("--iters", type=int, default=30, help="timed calls per GPU-time median")
    p.add_argument("--no-ctypes", action="store_true", help="skip the ctypes comparison process")
    p.add_argument("--no-python-formula", action="store_true",
                   help="skip the comparison process with the Python autograd formula "
                        "(FUSEMOE_NATIVE_AUTOGRAD=0; run only where the C++ one is in use)")
    p.add_argument("--json", help="write the results here (each comparison process writes its own)")
    args = p.parse_args()

    result = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    others = []  # (label, result) of the comparison processes
    if not args.no_python_formula and "autograd: C++" in result["path"]:
        other = comparison(args, "Python formula", "python_formula", {"FUSEMOE_NATIVE_AUTOGRAD": "0"})
        if other:
            others.append(("Python formula", other))
    if not args.no_ctypes and not result["path"].startswith("ctypes"):
        other = comparison(args, "ctypes", "ctypes", {"FUSEMOE_NATIVE": "0"})
        if other:
            others.append(("ctypes", other))

    print(f"fusemoe op overhead, impl={args.impl}: {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__} (CUDA {torch.version.cuda})")
    print(f"path: {result['path']}")
    columns = "".join(f"  [{label}]" for label, _ in others)
    print(f"\n1. host time per call, T=256 (us){columns}")
    for i, (name, us) in enumerate(result["host_us"]):
        target = HOST_TARGETS_US.get(name)
        verdict = "" if target is None else f"  target <= {target:.0f}: {'met' if us <= target else 'NOT met'}"
        side = "".join(f"  [{other['host_us'][i][1]:8.1f}]" for _, other in others)
        print(f"  {us:8.1f}{side}  {name}{verdict}")
    checks, rows = result["gpu"]
    print(f"\n2. GPU time per call, T={args.tokens}, median of {args.iters} (ms)")
    failed = False
    for name, bitwise, err in checks:
        ok = err == err and err <= 1e-2  # NaN fails
        failed |= not ok
        print(f"  check {name}: op vs C ABI rel err {err:.2e}{' (bitwise equal)' if bitwise else ''}"
              f"{'' if ok else '  FAIL'}")
    for i, (name, op_ms, c_ms) in enumerate(rows):
        ratio = op_ms / c_ms
        verdict = f"within {100 * (GPU_TARGET - 1):.0f}%: {'yes' if ratio <= GPU_TARGET else 'NO'}"
        side = "".join(f"   [{label}: op {other['gpu'][1][i][1]:.3f} = "
                       f"{other['gpu'][1][i][1] / other['gpu'][1][i][2]:.3f}x]"
                       for label, other in others)
        print(f"  {name:28s} op {op_ms:.3f}  C ABI {c_ms:.3f}  = {ratio:.3f}x  {verdict}{side}")
    for label, other in others:
        for name, bitwise, err in other["gpu"][0]:
            if not (err == err and err <= 1e-2):
                failed = True
                print(f"  {label} check {name}: rel err {err:.2e}  FAIL")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
