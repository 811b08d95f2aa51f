#!/usr/bin/env python3
"""Expert parallelism from PyTorch, timed in one run over the R ranks torchrun starts: the
torchtitan-style baseline a PyTorch user runs today, and fusemoe.ExpertParallelMoEExperts, on
the same tokens and experts, forward and forward + backward.

    torchrun --nproc_per_node R benchmarks/ep_torch_baseline.py [--preset qwen3-30b-a3b]
        [--tokens 16384] [--routing uniform|skewed] [--iters 10] [--warmup 3] [--json PATH]

--tokens is the total over the ranks (T / R each). Rank r holds experts [r L, (r+1) L), L = E / R;
the routing is drawn once for all T tokens (torch_baseline.make_routing, the same on every rank)
and each rank takes its T / R tokens.
Baseline (torchtitan's expert parallelism): the per-expert counts of each rank's slots exchanged
with all_to_all_single and read on the host (the split sizes); the slots' token rows sorted by
expert and sent with all_to_all_single (a row per (token, expert) pair); the received rows
regrouped by local expert; torch._grouped_mm gate/up, SwiGLU, torch._grouped_mm down; the rows
sent back with all_to_all_single; the routing weight applied in fp32 and index_add_ into y (bf16,
torch_baseline.combine). Autograd for the backward (torch.distributed._functional_collectives.
all_to_all_single_autograd, as torchtitan); bf16 weights, so bf16 weight gradients. fusemoe: the
module's forward (saving z, as in training) and backward (bf16 weight gradients).
Backends: the baseline's all_to_alls run over NCCL when the ranks are on distinct GPUs. Ranks
that share one GPU cannot use NCCL (it refuses two ranks on one GPU), and gloo's all_to_all stages
every row through host memory: the baseline then runs over gloo and is checked, but its times
measure that host path, not a GPU baseline, and the script says so. On one GPU the R processes
also time-slice the GPU, so no figure here is an expert-parallel figure there
(fusemoe_ep_bench prices the protocol on one GPU with co-resident ranks).
Check first: the baseline's y, dx, d_topk_weights, dw13, dw2 against fusemoe's on the timed
problem (relative L2 <= torch_baseline.REL_ERR_TOL on every rank).
Timing: before every call each rank synchronises its device, fills a 256 MiB buffer (L2 flush)
and meets the others at a gloo barrier; CUDA events around the call; median over --iters after
--warmup; each figure is the slowest rank's median. Useful FLOPs per rank: 6 H I per routed slot
of the rank's tokens forward, 18 H I forward + backward; TFLOP/s per rank divide them by that
time, "all ranks" divides the ranks' sum.
Exit: 0 ok, 1 check failed, 2 bad arguments, 3 no sm_90 GPU or no fusemoe library, 4 runtime
error.
Shape legend: T tokens of a rank, H hidden, I expert intermediate, F = 2I, E experts, L = E / R,
K top-k, S = T K slots, N rows a rank receives.
"""
import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn.functional import silu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import fusemoe  # noqa: E402
from fusemoe import expert_parallel  # noqa: E402
from torch_baseline import (L2_FLUSH_BYTES, PRESETS, REL_ERR_TOL, combine,  # noqa: E402
                            make_routing, project_commit, rel_err)

FLOPS_PER_SLOT_HI = {"forward": 6, "forward+backward": 18}  # x H x I per routed slot


def log(message):
    if dist.get_rank() == 0:
        print(f"[ep-bench] {message}", flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384, help="tokens over all ranks")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="rank 0 writes every figure and the metadata here")
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 0 or args.tokens < 1:
        p.error("--iters and --tokens must be >= 1, --warmup >= 0")
    return args


# ---- the baseline ----

class TorchtitanEP:
    """The torchtitan-style expert-parallel layer over `group` (its all_to_alls' backend)."""

    def __init__(self, group, num_experts):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.num_local = num_experts // self.world_size
        self.num_experts = num_experts

    def __call__(self, x_TH, topk_idx_TK, topk_w_TK, w13_LFH, w2_LHI):
        num_tokens, top_k = topk_idx_TK.shape
        intermediate = w2_LHI.shape[2]
        R, L = self.world_size, self.num_local
        # The counts: what this rank sends to each expert, what each source sends to this
        # rank's experts; the split sizes on the host (a sync, as in torchtitan).
        flat_S = topk_idx_TK.reshape(-1)
        sent_E = torch.bincount(flat_S, minlength=self.num_experts)
        received_RL = torch.empty_like(sent_E)
        dist.all_to_all_single(received_RL, sent_E, group=self.group)
        received_RL = received_RL.view(R, L)
        input_splits = sent_E.view(R, L).sum(1).tolist()
        output_splits = received_RL.sum(1).tolist()
        # Dispatch: this rank's slots sorted by expert (so by destination rank), their rows.
        slot_S = torch.argsort(flat_S, stable=True)
        token_S = slot_S // top_k
        x_SH = x_TH[token_S]
        x_NH = funcol.all_to_all_single_autograd(x_SH, output_splits, input_splits, self.group)
        # Received rows are (source, expert)-ordered: regroup them by local expert.
        expert_N = torch.repeat_interleave(
            torch.arange(L, device=x_TH.device).repeat(R), received_RL.reshape(-1))
        order_N = torch.argsort(expert_N, stable=True)
        offsets_L = received_RL.sum(0).cumsum(0).to(torch.int32)
        xs_NH = x_NH[order_N]
        gu_NF = torch._grouped_mm(xs_NH, w13_LFH.transpose(-2, -1), offs=offsets_L)
        h_NI = silu(gu_NF[:, :intermediate]) * gu_NF[:, intermediate:]
        o_NH = torch._grouped_mm(h_NI, w2_LHI.transpose(-2, -1), offs=offsets_L)
        o_NH = o_NH[torch.argsort(order_N)]  # back to the received order
        # Combine: the rows back to their sources, weighted, summed into their tokens.
        o_SH = funcol.all_to_all_single_autograd(o_NH, input_splits, output_splits, self.group)
        w_S = topk_w_TK.reshape(-1)[slot_S]
        return combine(o_SH, w_S, token_S, num_tokens, torch.bfloat16)


# ---- set-up ----

def setup():
    """The default gloo group from torchrun's environment, this rank's GPU, and the group the
    baseline's all_to_alls use: (device, all_to_all group, its backend, ranks share one GPU)."""
    device, _ = expert_parallel.local_device()
    dist.init_process_group("gloo")
    uuids = [None] * dist.get_world_size()
    dist.all_gather_object(uuids, (socket.gethostname(),
                                   str(torch.cuda.get_device_properties(device).uuid)))
    distinct = len(set(uuids)) == len(uuids)
    if distinct:
        return device, dist.new_group(backend="nccl"), "nccl", False
    return device, dist.group.WORLD, "gloo", True


def make_problem(args, device):
    """This rank's share of the problem: its tokens, their routing (drawn for all T tokens),
    its experts' weights, dy."""
    _, hidden, intermediate, num_experts, top_k = PRESETS[args.preset]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens = args.tokens // world_size
    topk_idx_TK, topk_w_TK = make_routing(args.tokens, num_experts, top_k, args.routing,
                                          args.seed, device)
    rows = slice(rank * tokens, (rank + 1) * tokens)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1009 + rank)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    local = num_experts // world_size
    return dict(x_TH=randn(tokens, hidden), dy_TH=randn(tokens, hidden),
                topk_idx_TK=topk_idx_TK[rows].contiguous(),
                topk_w_TK=topk_w_TK[rows].contiguous(),
                w13_LFH=randn(local, 2 * intermediate, hidden, scale=hidden ** -0.5),
                w2_LHI=randn(local, hidden, intermediate, scale=intermediate ** -0.5))


def layers(args, p, all_to_all_group):
    """name -> (forward(x, w) -> y, its expert weights): the baseline and fusemoe on p."""
    _, hidden, intermediate, num_experts, top_k = PRESETS[args.preset]
    baseline = TorchtitanEP(all_to_all_group, num_experts)
    w13 = p["w13_LFH"].clone().requires_grad_()
    w2 = p["w2_LHI"].clone().requires_grad_()
    module = fusemoe.ExpertParallelMoEExperts(
        num_experts, hidden, intermediate, top_k, p["x_TH"].shape[0],
        device=p["x_TH"].device)
    with torch.no_grad():
        module.gate_up_proj.copy_(p["w13_LFH"])
        module.down_proj.copy_(p["w2_LHI"])
    return {
        "torchtitan-style": (lambda x, w: baseline(x, p["topk_idx_TK"], w, w13, w2), (w13, w2)),
        "fusemoe EP": (lambda x, w: module(x, p["topk_idx_TK"], w),
                       (module.gate_up_proj, module.down_proj)),
    }


def outputs(forward, weights, p):
    """y and the gradients of x, topk_w, w13, w2 for dy."""
    x = p["x_TH"].clone().requires_grad_()
    w = p["topk_w_TK"].clone().requires_grad_()
    for t in weights:
        t.grad = None
    y = forward(x, w)
    y.backward(p["dy_TH"])
    return [y.detach(), x.grad, w.grad] + [t.grad for t in weights]


def worst_error(errors):
    """The largest of the ranks' errors, NaN if any is NaN (max() keeps its first argument when
    compared with NaN, so a NaN on a later rank would vanish)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def check(layer_map, p):
    """Relative L2 of the baseline's outputs against fusemoe's, the worst over the ranks."""
    names = ("y", "dx", "d_topk_weights", "dw13", "dw2")
    got = outputs(*layer_map["torchtitan-style"], p)
    ref = outputs(*layer_map["fusemoe EP"], p)
    errors = {n: rel_err(a, b) for n, a, b in zip(names, got, ref)}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, errors)
    return {n: worst_error([e[n] for e in per_rank]) for n in names}


def time_pass(forward, weights, p, pass_name, args, device, flush_BY):
    """The slowest rank's median ms of one pass (see the module docstring)."""
    x = p["x_TH"].clone().requires_grad_()
    w = p["topk_w_TK"].clone().requires_grad_()
    samples = []
    for i in range(args.warmup + args.iters):
        for t in (x, w, *weights):
            t.grad = None
        flush_BY.fill_(i & 0xFF)
        torch.cuda.synchronize(device)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = forward(x, w)
        if pass_name == "forward+backward":
            y.backward(p["dy_TH"])
        end.record()
        torch.cuda.synchronize(device)
        if i >= args.warmup:
            samples.append(start.elapsed_time(end))
        del y
    medians = [None] * dist.get_world_size()
    dist.all_gather_object(medians, statistics.median(samples))
    return max(medians), medians


def main():
    args = parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("ep_torch_baseline: needs an sm_90 GPU (H100/H200)", file=sys.stderr)
        return 3
    if not fusemoe.is_available():
        print(f"ep_torch_baseline: libfusemoe_c.so not found at {fusemoe.library_path()}",
              file=sys.stderr)
        return 3
    device, a2a_group, backend, shared = setup()
    try:
        return run(args, device, a2a_group, backend, shared)
    except Exception as error:  # report it on every rank, then leave with the code
        traceback.print_exc(file=sys.stderr)
        print(f"ep_torch_baseline: rank {dist.get_rank()} error: {error!r}", file=sys.stderr)
        return 4
    finally:
        dist.destroy_process_group()


def run(args, device, a2a_group, backend, shared):
    short, hidden, intermediate, num_experts, top_k = PRESETS[args.preset]
    world_size = dist.get_world_size()
    if num_experts % world_size or args.tokens % world_size:
        log(f"E={num_experts} and --tokens={args.tokens} must be divisible by R={world_size}")
        return 2
    tokens = args.tokens // world_size
    props = torch.cuda.get_device_properties(device)
    meta = {
        "commit": project_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "preset": args.preset, "hidden": hidden, "intermediate": intermediate,
        "num_experts": num_experts, "top_k": top_k, "world_size": world_size,
        "tokens_total": args.tokens, "tokens_per_rank": tokens, "routing": args.routing,
        "iters": args.iters, "warmup": args.warmup, "baseline_backend": backend,
        "ranks_share_one_gpu": shared,
    }
    log(f"commit {meta['commit']}  {meta['date']}; {props.name}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}")
    log(f"{short}: H={hidden} I={intermediate} E={num_experts} K={top_k}; R={world_size} ranks, "
        f"{tokens} tokens each ({args.tokens} in all), routing {args.routing}")
    log(f"baseline all_to_all backend: {backend}" + (
        " (the ranks share one GPU: NCCL refuses that, and gloo stages every row through host "
        "memory, so the baseline's times measure that host path, not a GPU baseline; the R "
        "processes also time-slice the GPU, so neither side's times are expert-parallel figures)"
        if shared else " (one GPU per rank)"))
    p = make_problem(args, device)
    layer_map = layers(args, p, a2a_group)
    errors = check(layer_map, p)
    log("check, baseline vs fusemoe (relative L2, worst rank): " +
        ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    result = {"meta": meta, "check": errors, "timings": []}
    passed = all(e <= REL_ERR_TOL for e in errors.values())  # NaN and inf fail
    if not passed:
        log(f"CHECK FAILED (tolerance {REL_ERR_TOL}): not timing")
    else:
        flush_BY = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        slots = tokens * top_k
        for pass_name, flops_hi in FLOPS_PER_SLOT_HI.items():
            for name, (forward, weights) in layer_map.items():
                ms, per_rank = time_pass(forward, weights, p, pass_name, args, device, flush_BY)
                flops = flops_hi * hidden * intermediate * slots
                result["timings"].append({
                    "impl": name + (f" ({backend})" if name == "torchtitan-style" else ""),
                    "pass": pass_name, "ms": ms, "ms_per_rank": per_rank,
                    "tflops_per_rank": flops / (ms * 1e-3) / 1e12,
                    "tflops_all_ranks": world_size * flops / (ms * 1e-3) / 1e12})
        log(f"{'impl':<26} {'pass':<17} {'ms':>9} {'TFLOP/s per rank':>17} {'all ranks':>10}")
        for t in result["timings"]:
            log(f"{t['impl']:<26} {t['pass']:<17} {t['ms']:9.3f} {t['tflops_per_rank']:17.1f} "
                f"{t['tflops_all_ranks']:10.1f}")
        for pass_name in FLOPS_PER_SLOT_HI:
            base, ours = (t["ms"] for t in result["timings"] if t["pass"] == pass_name)
            result[f"speedup_{pass_name}"] = base / ours
            log(f"{pass_name}: fusemoe EP {base / ours:.2f}x the torchtitan-style baseline "
                f"({backend})" + (": NOT a GPU comparison (gloo host path, shared GPU)"
                                  if shared else ""))
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        log(f"wrote {args.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
