#!/usr/bin/env python3
"""Trains the Qwen3-MoE of train_qwen3_moe.py with expert parallelism over the R ranks torchrun
starts: each rank holds E / R of every layer's experts (fusemoe.ExpertParallelMoEExperts) and a
copy of everything else.

    torchrun --nproc_per_node R examples/train_qwen3_moe_ep.py --steps 20

The training is train_qwen3_moe.py's single-GPU run, split data-parallel over the ranks, so the
two loss curves are comparable step by step: the same model and initialisation (every rank builds
the whole model from --seed, then keeps its experts), the same sequences in every step (each
micro-batch's --batch-size sequences are split into R blocks, rank r taking block r, so the
expert layers see the concatenation of the ranks' tokens, which is the single-GPU micro-batch),
the same loss (each rank's mean loss / R: their sum is the micro-batch's mean, token counts
being equal), the same optimizer, schedule and clipping. The expert weight gradients come out of
the expert-parallel backward already summed over every rank's tokens; the other gradients are
summed over the ranks here (one fp32 all-reduce per step); the clipping norm is the global one
over both. So the loss differs from the single-GPU fusemoe run by bf16 rounding only (other
batch shapes in the dense layers, the all-reduce's summation order).
Devices: one GPU per rank when the node has as many as the ranks on it (NCCL for the dense
all-reduce); otherwise every rank on GPU 0 with a gloo group and
TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (correctness only: the GPU time-slices between the
processes, so the step times say nothing about expert parallelism).
Writes OUT/train_qwen3_moe_ep.json (rank 0): the per-step loss (global mean) and gradient norm
(before clipping), step times, peak memory of every rank.
Exit: 0 done; 1 a loss was not finite; 2 bad arguments or missing transformers / fusemoe library.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import train_qwen3_moe as single  # this folder: the model, data and schedule of the single-GPU run

import fusemoe  # noqa: E402  (train_qwen3_moe put python/ on the path)
from fusemoe import expert_parallel  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    single.add_common_arguments(p)
    p.add_argument("--out", default="train_qwen3_moe_ep_out", help="output folder")
    p.add_argument("--recompute-z", action="store_true",
                   help="recompute the experts' pre-activations in the backward instead of saving "
                        "them (the saved state is sized for the worst case: R times the "
                        "single-GPU op's)")
    args = p.parse_args(argv)
    single.check_common_arguments(p, args)
    return args


def log(message):
    """Rank 0 prints (the ranks' losses and norms are global, so the same on every rank)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train-ep {datetime.datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def setup(args):
    """Initialises the default process group from torchrun's environment; returns
    (device, backend, whether the ranks share one GPU)."""
    if torch.device(args.device).type == "cpu":
        dist.init_process_group("gloo")
        return torch.device("cpu"), "gloo", False
    device, shared = expert_parallel.local_device()
    backend = "gloo" if shared else "nccl"
    dist.init_process_group(backend)
    return device, backend, shared


def swap_experts(model, args, tokens_per_rank):
    """Every Qwen3MoeExperts becomes this rank's ExpertParallelMoEExperts share of it."""
    names = [n for n, m in model.named_modules() if type(m).__name__ == "Qwen3MoeExperts"]
    for name in names:
        parent, _, child = name.rpartition(".")
        experts = model.get_submodule(name)
        setattr(model.get_submodule(parent), child, fusemoe.ExpertParallelMoEExperts.from_experts(
            experts, max_tokens_per_rank=tokens_per_rank, top_k=args.top_k,
            recompute_z=args.recompute_z))
    return names


def all_reduce_dense_grads(params):
    """Sums the replicated parameters' gradients over the ranks, in fp32 (one flat buffer)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(dense, experts, max_norm, device):
    """torch.nn.utils.clip_grad_norm_ over the whole model: the dense gradients are the same on
    every rank, the experts' are each rank's own, so their squares are summed over the ranks.
    Returns the norm before clipping (fp32)."""
    def sum_of_squares(params):
        norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                 for p in params if p.grad is not None]
        return torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)

    experts_sq = sum_of_squares(experts)
    dist.all_reduce(experts_sq)
    total = (sum_of_squares(dense) + experts_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in dense + experts if p.grad is not None]
    torch._foreach_mul_(grads, coef)
    return total


def train(model, corpus_N, offsets_SMB, dense, experts, args, device):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    block = args.batch_size // world_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=device.type == "cuda")
    model.train()
    losses, grad_norms, step_ms = [], [], []
    finite = True
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = single.lr_at(step, args)
        single.synchronize(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for m in range(args.micro_batches):
            offsets_B = offsets_SMB[step, m, rank * block:(rank + 1) * block]
            ids = single.sequences(corpus_N, offsets_B, args.seq_len)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss = loss / (args.micro_batches * world_size)
            loss.backward()
            total += loss.detach()
        all_reduce_dense_grads(dense)
        grad_norm = clip_grad_norm(dense, experts, 1.0, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        loss_value, grad_norm_value = total.item(), grad_norm.item()
        single.synchronize(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        if device.type == "cuda":
            fusemoe.check_expert_ids(synchronize=False)  # the step already synchronised
        losses.append(loss_value)
        grad_norms.append(grad_norm_value)
        finite = single.report_step(log, "", step, loss_value, f" grad norm {grad_norm_value:.4f}",
                                    step_ms, args, profile_steps=0)
        if not finite:
            break
    return losses, grad_norms, step_ms, finite


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install 'transformers>=5')", file=sys.stderr)
        return 2
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (the expert-parallel layer runs on sm_90 GPUs)", file=sys.stderr)
        return 2
    if torch.device(args.device).type == "cuda" and not fusemoe.is_available():
        print(f"libfusemoe_c.so not found at {fusemoe.library_path()}: build the CMake target "
              "fusemoe_c or set FUSEMOE_LIBRARY", file=sys.stderr)
        return 2
    device, backend, shared = setup(args)
    try:
        return run(args, transformers, device, backend, shared)
    finally:
        dist.destroy_process_group()


def run(args, transformers, device, backend, shared):
    world_size = dist.get_world_size()
    if args.batch_size % world_size or args.experts % world_size:
        log(f"--batch-size ({args.batch_size}) and --experts ({args.experts}) must be divisible "
            f"by the number of ranks ({world_size})")
        return 2
    args.device = str(device)
    corpus_N, offsets_SMB = single.load_data(args)
    if corpus_N is None:
        return 2
    tokens_per_rank = args.batch_size // world_size * args.seq_len
    log(f"{world_size} ranks ({backend}; " +
        ("every rank on GPU 0, time-sliced: step times mean nothing" if shared else
         f"one {device.type} device each") + f"), EP={world_size}: {args.experts // world_size} "
        f"experts per rank, {args.micro_batches} micro-batches x {args.batch_size} sequences x "
        f"{args.seq_len} tokens per step, {tokens_per_rank} tokens per rank per micro-batch")
    model = single.build_model(args, transformers)  # the same weights on every rank (--seed)
    names = swap_experts(model, args, tokens_per_rank)
    if not names:
        log("the model has no Qwen3MoeExperts module")
        return 2
    experts = [p for m in model.modules() if isinstance(m, fusemoe.ExpertParallelMoEExperts)
               for p in m.parameters()]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    log(f"expert-parallel experts in {len(names)} layers; "
        f"{sum(p.numel() for p in dense) / 1e6:.1f} M replicated parameters, {sum(p.numel() for p in experts) / 1e6:.1f} M expert "
        "parameters per rank")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    losses, grad_norms, step_ms, finite = train(model, corpus_N, offsets_SMB, dense, experts,
                                                args, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak)
    timed = single.timed_steps(step_ms, args, profile_steps=0)
    log(f"median step {statistics.median(timed):.1f} ms, final loss {losses[-1]:.4f}" +
        (f", peak memory per rank {', '.join(f'{g:.2f}' for g in peaks)} GiB" if peak else ""))
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        result = {
            "config": vars(args),
            "environment": single.environment(args),
            "world_size": world_size,
            "backend": backend,
            "ranks_share_one_gpu": shared,
            "losses": losses,
            "grad_norms": grad_norms,  # before clipping
            "step_ms": step_ms,
            "median_step_ms": statistics.median(timed),
            "peak_memory_gib_per_rank": peaks,
            "finite": finite,
        }
        path = os.path.join(args.out, "train_qwen3_moe_ep.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {path}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
