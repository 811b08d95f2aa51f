#!/usr/bin/env python3
"""Trains a small Hugging Face Qwen3-MoE twice, from the same initialisation on the same data
order: with the model's own experts (transformers' default experts implementation, "grouped_mm")
and with fusemoe experts (--impl) swapped in by fusemoe.patch_hf_experts, and optionally
(--runs ...,hf_reordered) with Hugging Face experts again on the same batches in another
micro-batch order: mathematically the same training, so its distance from the first run is the
bf16 noise floor the fusemoe curve is judged against. Prints
progress; reports the largest difference between the two loss curves, the median step time and
the peak memory of each; writes OUT/train_qwen3_moe.json and OUT/train_qwen3_moe.png.

Model: the MoE dims of Qwen3-30B-A3B (H=2048, I=768, E=128, top-8, normalised top-k weights),
--layers decoder layers, 32 query / 4 key-value heads of 128, a byte vocabulary (256), sdpa
attention, bf16 parameters, fused AdamW (0.9, 0.95, wd 0.1), gradient clipping at 1.0, linear
warm-up then cosine decay to 10% of --lr. Data: data/corpus.txt read as bytes; every micro-batch is
--batch-size sequences of --seq-len tokens at offsets drawn once from a seeded generator, so every
run sees the same sequences. One step = --micro-batches forward/backward passes (gradients
accumulate in .grad; for the fusemoe experts inside the backward kernels with --grad-in-place,
the default), then clipping and the optimizer. Defaults: 2 micro-batches of 4 x 4096 tokens
(T = 16384 tokens per MoE call, the benchmark's main case; with 4096-token micro-batches the step
is partly bound by the host: Python model code and a per-forward sync inside transformers). Step time: wall clock between CUDA synchronisations,
median over the steps after --timing-warmup and before any --profile-steps. Peak memory:
torch.cuda.max_memory_allocated over the run (weights, gradients, optimizer state, activations,
workspaces).
Exit: 0 done; 1 a loss was not finite; 2 bad arguments or missing transformers / fusemoe library.
"""
import argparse
import bisect
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "python"))
import fusemoe  # noqa: E402

RUN_HF, RUN_FUSEMOE = "hf", "fusemoe"
# The bf16 noise floor: Hugging Face experts again with each step's micro-batches in reverse
# order (the same gradients mathematically, other roundings of the accumulation).
RUN_HF_REORDERED = "hf_reordered"
RUN_NAMES = (RUN_HF, RUN_FUSEMOE, RUN_HF_REORDERED)


def add_common_arguments(p):
    """The model, data, schedule and output arguments this example and train_qwen3_moe_ep.py
    share."""
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="forward/backward passes per optimizer step (gradient accumulation)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument("--timing-warmup", type=int, default=5, help="first steps left out of the median")
    p.add_argument("--grad-checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer (every run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=os.path.join(REPO, "data", "corpus.txt"))
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke tests only


def check_common_arguments(p, args):
    if args.steps < 1 or args.micro_batches < 1 or args.batch_size < 1 or args.seq_len < 2:
        p.error("--steps, --micro-batches and --batch-size must be >= 1, --seq-len >= 2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--impl", default=fusemoe.DEFAULT_IMPL, help="fusemoe implementation")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="fusemoe experts' GEMM precision (fp8: blockwise E4M3, impl fused; the "
                        "model and the other runs stay bf16)")
    p.add_argument("--fp8-weight-grads", action="store_true",
                   help="with --precision fp8: the experts' weight gradients from FP8 operands too "
                        "(fusemoe.MoEExperts fp8_weight_grads)")
    p.add_argument("--out", default="train_qwen3_moe_out", help="output folder")
    p.add_argument("--runs", default=f"{RUN_HF},{RUN_FUSEMOE}",
                   help=f"which runs, in this order, from {', '.join(RUN_NAMES)} ({RUN_HF_REORDERED}: "
                        "the Hugging Face run with reversed micro-batch order, the bf16 noise floor)")
    p.add_argument("--grad-in-place", action=argparse.BooleanOptionalAction, default=True,
                   help="fusemoe run: expert weight gradients accumulate inside the backward kernels "
                        "(fusemoe.MoEExperts grad_in_place; fine here: one GPU, no gradient hooks) "
                        "instead of autograd's separate add")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile the last N steps of each run with torch.profiler: the GPU-busy "
                        "share of the step and the top kernels go to the log and the JSON")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or any(r not in RUN_NAMES for r in args.runs) or len(set(args.runs)) < len(args.runs):
        p.error(f"--runs must list distinct names from {', '.join(RUN_NAMES)}, got {args.runs}")
    check_common_arguments(p, args)
    if not 0 <= args.profile_steps <= args.steps:
        p.error(f"--profile-steps must be in [0, --steps], got {args.profile_steps}")
    if args.fp8_weight_grads and args.precision != "fp8":
        p.error("--fp8-weight-grads needs --precision fp8")
    return args


def log(message):
    print(f"[train {datetime.datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def build_model(args, transformers):
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, max_position_embeddings=max(args.seq_len, 4096),
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are created and initialised in bf16
    try:
        with torch.device(args.device):
            model = transformers.Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    bad = [n for n, prm in model.named_parameters() if prm.dtype != torch.bfloat16]
    if bad:
        raise RuntimeError(f"parameters not in bf16: {bad[:3]}")
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_data(args):
    """The corpus as bytes on args.device and the sequence offsets [steps, micro-batches,
    batch size], drawn from a generator seeded by --seed (every run and every rank draws the
    same); (None, None) with a message when the corpus is shorter than a sequence."""
    with open(args.data, "rb") as f:
        corpus = f.read()
    if len(corpus) <= args.seq_len + 1:
        log(f"{args.data} has {len(corpus)} bytes: fewer than --seq-len + 1")
        return None, None
    corpus_N = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(args.device)
    offsets_SMB = torch.randint(0, len(corpus) - args.seq_len,
                                (args.steps, args.micro_batches, args.batch_size),
                                generator=torch.Generator().manual_seed(args.seed + 1))
    return corpus_N, offsets_SMB


def sequences(corpus_N, offsets_B, seq_len):
    """The token ids [len(offsets_B), seq_len] (int64) of the sequences at offsets_B."""
    return torch.stack([corpus_N[int(o):int(o) + seq_len] for o in offsets_B]).to(torch.int64)


def lr_at(step, args):
    if step < args.lr_warmup:
        return args.lr * (step + 1) / args.lr_warmup
    progress = (step - args.lr_warmup) / max(1, args.steps - args.lr_warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # not gpu_user_annotation (a range)


def innermost_enclosing(spans, starts, ts):
    """Name of the innermost of the nested (start, end, name) spans (sorted by start; `starts`
    their starts) that holds ts: the latest-starting one that has not ended by ts."""
    for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
        if spans[i][1] >= ts:
            return spans[i][2]
    return "(no enclosing op)"


def summarize_profile(prof, num_steps, step_ms, rows=14, gap_us=5.0):
    """Where a step's time goes, from a finished torch.profiler run over num_steps steps: GPU
    time by kernel; idle GPU time (gaps between GPU activities) by the CPU op that launched the
    work after each gap (what the GPU was waiting for); CUDA runtime/driver calls by CPU time
    (synchronisations show up here)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    cpu_ops = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            cpu_ops.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for spans in cpu_ops.values():
        spans.sort()
    starts = {tid: [span[0] for span in spans] for tid, spans in cpu_ops.items()}
    kernels, idle, runtime = {}, {}, {}
    busy_us = idle_us = 0.0
    frontier = None  # end of the GPU work seen so far
    for e in gpu:
        kernels[e["name"]] = kernels.get(e["name"], 0.0) + e["dur"]
        start, end = e["ts"], e["ts"] + e["dur"]
        if frontier is not None and start - frontier > gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            cause = (innermost_enclosing(cpu_ops.get(launch["tid"], []),
                                         starts.get(launch["tid"], []), launch["ts"])
                     if launch else "(launch not traced)")
            idle[cause] = idle.get(cause, 0.0) + start - frontier
            idle_us += start - frontier
        busy_us += max(0.0, end - max(start, frontier or start))
        frontier = end if frontier is None else max(frontier, end)
    syncs, fusemoe_ops = {}, {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]] = runtime.get(e["name"], 0.0) + e["dur"]
            if "Synchronize" in e["name"]:  # who made the CPU wait for the GPU
                cause = innermost_enclosing(cpu_ops.get(e["tid"], []), starts.get(e["tid"], []),
                                            e["ts"])
                count, us = syncs.get(cause, (0, 0.0))
                syncs[cause] = (count + 1, us + e["dur"])
        elif e.get("cat") == "cpu_op" and "fusemoe" in e["name"]:
            count, us = fusemoe_ops.get(e["name"], (0, 0.0))
            fusemoe_ops[e["name"]] = (count + 1, us + e["dur"])
    per_step = 1e3 * num_steps  # us over the run -> ms per step
    wall_ms = statistics.median(step_ms)
    lines = [f"GPU busy {busy_us / per_step:.1f} ms, idle between GPU work {idle_us / per_step:.1f} "
             f"ms (gaps > {gap_us:.0f} us), of a {wall_ms:.1f} ms step (profiled); per step:",
             "GPU time by kernel:"]
    lines += [f"  {us / per_step:8.2f} ms  {name[:110]}"
              for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:rows]]
    lines.append("GPU idle by the CPU op that launched the work after the gap:")
    lines += [f"  {us / per_step:8.2f} ms  {name[:110]}"
              for name, us in sorted(idle.items(), key=lambda kv: -kv[1])[:rows]]
    lines.append("CPU time in CUDA runtime/driver calls:")
    lines += [f"  {us / per_step:8.2f} ms  {name[:110]}"
              for name, us in sorted(runtime.items(), key=lambda kv: -kv[1])[:8]]
    lines.append("Synchronisations (CPU waits) by the CPU op that made them:")
    lines += [f"  {us / per_step:8.2f} ms  {count / num_steps:5.1f} x  {name[:100]}"
              for name, (count, us) in sorted(syncs.items(), key=lambda kv: -kv[1][1])[:8]]
    lines.append("CPU time of the fusemoe ops (host side: checks, allocation, launches):")
    lines += [f"  {us / count:8.1f} us per call  {count / num_steps:5.1f} calls  {name[:90]}"
              for name, (count, us) in sorted(fusemoe_ops.items())]
    return {"gpu_busy_ms_per_step": busy_us / per_step, "gpu_idle_ms_per_step": idle_us / per_step,
            "wall_ms_per_step": wall_ms, "table": lines}


def report_step(log_fn, prefix, step, loss_value, extra, step_ms, args, profile_steps=None):
    """Logs the step (the first, every --print-every, the last) with log_fn; False, logged,
    when the loss is not finite (the caller stops)."""
    if not math.isfinite(loss_value):
        log_fn(f"{prefix}step {step + 1}: loss {loss_value}: stopping this run")
        return False
    if (step + 1) % args.print_every == 0 or step + 1 == args.steps or step == 0:
        timed = timed_steps(step_ms, args, profile_steps)
        log_fn(f"{prefix}step {step + 1}/{args.steps} loss {loss_value:.4f}{extra} "
               f"step {step_ms[-1]:.1f} ms (median {statistics.median(timed):.1f} ms)")
    return True


def timed_steps(step_ms, args, profile_steps=None):
    """The step times the median is taken over: after the warm-up, before the profiled steps
    (args.profile_steps unless given)."""
    profiled = args.profile_steps if profile_steps is None else profile_steps
    end = max(args.timing_warmup + 1, args.steps - profiled)
    return step_ms[args.timing_warmup:end] or step_ms


def train(name, model, corpus_N, offsets_SMB, args):
    """One run from the model's current weights; returns its record."""
    device = torch.device(args.device)
    is_cuda = device.type == "cuda"
    gc.collect()
    if is_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=is_cuda)
    model.train()
    losses, step_ms, grad_norms = [], [], []
    finite = True
    profiler, profile = None, None
    for step in range(args.steps):
        if is_cuda and args.profile_steps and step == args.steps - args.profile_steps:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        synchronize(device)
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        order = range(args.micro_batches)
        for m in (reversed(order) if name == RUN_HF_REORDERED else order):
            ids = sequences(corpus_N, offsets_SMB[step, m], args.seq_len)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss / args.micro_batches
            loss.backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = total.item()
        synchronize(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        grad_norms.append(grad_norm.item())
        if name == RUN_FUSEMOE:
            fusemoe.check_expert_ids(synchronize=False)  # the step already synchronised
        losses.append(loss_value)
        finite = report_step(log, f"[{name}] ", step, loss_value, "", step_ms, args)
        if not finite:
            break
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profile = summarize_profile(profiler, args.profile_steps, step_ms[-args.profile_steps:])
        log(f"[{name}] profile of the last {args.profile_steps} steps:\n" +
            "\n".join(profile["table"]))
    timed = timed_steps(step_ms, args)
    record = {
        "profile": profile,
        "losses": losses,
        "grad_norms": grad_norms,  # before clipping
        "step_ms": step_ms,
        "median_step_ms": statistics.median(timed),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if is_cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if is_cuda else None,
        "final_loss": losses[-1],
        "finite": finite,
    }
    del optimizer
    model.zero_grad(set_to_none=True)
    return record


def loss_diffs(a, b):
    """(max |diff|, its 1-based step, mean |diff|) of two loss curves over their common steps."""
    n = min(len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    worst = max(range(n), key=lambda i: diffs[i])
    return diffs[worst], worst + 1, sum(diffs) / n


def final_window(steps):
    """How many last steps the final-loss comparison averages: one step's loss is one batch's (a
    200-step bf16 rerun in another micro-batch order ended 3.9% from the first run), so the
    mean of the last 10% of the steps, at most 20, is the steadier reading of "final loss"."""
    return max(1, min(20, steps // 10))


def final_readings(reference, other):
    """other's final loss against reference's over their common steps: the last step's relative
    difference, and the mean of the last final_window steps' relative difference."""
    n = min(len(reference), len(other))
    window = final_window(n)
    mean_ref = sum(reference[n - window:n]) / window
    mean_other = sum(other[n - window:n]) / window
    return {"final_loss_rel_diff": (other[n - 1] - reference[n - 1]) / reference[n - 1],
            "final_window_steps": window,
            "final_window_rel_diff": (mean_other - mean_ref) / mean_ref}


def compare(runs):
    hf, fm = runs[RUN_HF], runs[RUN_FUSEMOE]
    n = min(len(hf["losses"]), len(fm["losses"]))
    worst, worst_step, mean = loss_diffs(hf["losses"], fm["losses"])
    result = {
        "max_abs_loss_diff": worst,
        "max_abs_loss_diff_step": worst_step,
        "mean_abs_loss_diff": mean,
        "final_loss_diff": fm["losses"][n - 1] - hf["losses"][n - 1],
        **final_readings(hf["losses"], fm["losses"]),
        "speedup_step_time": hf["median_step_ms"] / fm["median_step_ms"],
        "peak_memory_ratio": (fm["peak_memory_gib"] / hf["peak_memory_gib"]
                              if hf["peak_memory_gib"] else None),
    }
    if RUN_HF_REORDERED in runs:
        reordered = runs[RUN_HF_REORDERED]["losses"]
        noise, noise_step, noise_mean = loss_diffs(hf["losses"], reordered)
        result.update(noise_max_abs_loss_diff=noise, noise_max_abs_loss_diff_step=noise_step,
                      noise_mean_abs_loss_diff=noise_mean,
                      **{f"noise_{key}": value for key, value in final_readings(hf["losses"], reordered).items()})
    return result


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return False
    runs = result["runs"]
    both = RUN_HF in runs and RUN_FUSEMOE in runs
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(12, 4.5), squeeze=False)
    ax = axes[0][0]
    for name, record in runs.items():
        label = f"{name} ({record['experts']}): median step {record['median_step_ms']:.0f} ms"
        ax.plot(range(1, len(record["losses"]) + 1), record["losses"], label=label, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    if both:
        hf = runs[RUN_HF]["losses"]
        for name in (RUN_FUSEMOE, RUN_HF_REORDERED):
            if name in runs:
                other = runs[name]["losses"]
                n = min(len(hf), len(other))
                axes[0][1].plot(range(1, n + 1), [b - a for a, b in zip(hf[:n], other[:n])],
                                linewidth=1, label=f"loss({name}) - loss({RUN_HF})")
        axes[0][1].set_xlabel("optimizer step")
        axes[0][1].set_ylabel("loss difference")
        axes[0][1].legend()
        axes[0][1].grid(alpha=0.3)
        c = result["comparison"]
        fig.suptitle(f"Qwen3-MoE {result['config']['layers']} layers, "
                     f"{result['config']['micro_batches']}x{result['config']['batch_size']}x"
                     f"{result['config']['seq_len']} tokens/step: "
                     f"fusemoe {c['speedup_step_time']:.2f}x step speed, "
                     f"max |loss diff| {c['max_abs_loss_diff']:.3g}" +
                     (f" (noise floor {c['noise_max_abs_loss_diff']:.3g})"
                      if "noise_max_abs_loss_diff" in c else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def environment(args):
    env = {"torch": torch.__version__, "device": args.device}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.device(args.device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    env["commit"] = os.environ.get("FUSEMOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
        text=True).stdout.strip() or "unknown"
    env["fusemoe_library"] = fusemoe.library_path()
    return env


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers
    except ImportError:
        log("transformers is not installed (pip install 'transformers>=5'): nothing to compare with")
        return 2
    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        log(f"transformers {transformers.__version__} has no Qwen3MoeForCausalLM")
        return 2
    if RUN_FUSEMOE in args.runs and torch.device(args.device).type == "cuda":
        if not fusemoe.is_available():
            log(f"libfusemoe_c.so not found at {fusemoe.library_path()}: build the CMake target "
                "fusemoe_c or set FUSEMOE_LIBRARY")
            return 2
    corpus_N, offsets_SMB = load_data(args)
    if corpus_N is None:
        return 2
    os.makedirs(args.out, exist_ok=True)

    log(f"building Qwen3-MoE: {args.layers} layers, H={args.hidden}, I={args.moe_intermediate}, "
        f"E={args.experts}, top-{args.top_k}, {args.micro_batches} micro-batches x {args.batch_size} x "
        f"{args.seq_len} tokens/step")
    model = build_model(args, transformers)
    num_params = sum(prm.numel() for prm in model.parameters())
    hf_experts = model.config._experts_implementation
    log(f"{num_params / 1e9:.2f} B parameters; transformers {transformers.__version__} experts "
        f"implementation: {hf_experts}; corpus {corpus_N.numel()} bytes")
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    # The model's own experts modules, to put back for an "hf" run after a "fusemoe" one.
    hf_modules = {n: m for n, m in model.named_modules() if type(m).__name__ == "Qwen3MoeExperts"}
    runs = {}
    for name in args.runs:
        if name == RUN_FUSEMOE:
            report = fusemoe.patch_hf_experts(model, impl=args.impl,
                                              grad_in_place=args.grad_in_place,
                                              precision=args.precision,
                                              fp8_weight_grads=args.fp8_weight_grads)
            log(f"fusemoe experts (impl={args.impl}, grad_in_place={args.grad_in_place}, "
                f"precision={args.precision}, fp8_weight_grads={args.fp8_weight_grads}) in "
                f"{len(report.replaced)} layers")
        else:
            for module_name, module in hf_modules.items():
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent), child, module)
        model.load_state_dict(initial)  # the same Parameter objects serve both kinds of experts
        log(f"[{name}] training {args.steps} steps")
        record = train(name, model, corpus_N, offsets_SMB, args)
        record["experts"] = (args.impl + ("" if args.precision == "bf16" else f" {args.precision}")
                             + (" fp8 weight grads" if args.fp8_weight_grads else "")
                             if name == RUN_FUSEMOE else hf_experts)
        runs[name] = record
        peak = record["peak_memory_gib"]
        log(f"[{name}] median step {record['median_step_ms']:.1f} ms, final loss "
            f"{record['final_loss']:.4f}" + (f", peak memory {peak:.2f} GiB" if peak else ""))

    result = {
        "config": {k: v for k, v in vars(args).items()},
        "environment": environment(args),
        "num_parameters": num_params,
        "corpus_bytes": corpus_N.numel(),
        "runs": runs,
    }
    if RUN_HF in runs and RUN_FUSEMOE in runs:
        c = result["comparison"] = compare(runs)
        log(f"loss curves: max |diff| {c['max_abs_loss_diff']:.4f} at step "
            f"{c['max_abs_loss_diff_step']}, mean |diff| {c['mean_abs_loss_diff']:.4f}, final "
            f"fusemoe - hf {c['final_loss_diff']:+.4f} ({100 * c['final_loss_rel_diff']:+.2f}%), "
            f"mean of the last {c['final_window_steps']} steps {100 * c['final_window_rel_diff']:+.2f}%")
        if "noise_max_abs_loss_diff" in c:
            log(f"bf16 noise floor ({RUN_HF_REORDERED} vs {RUN_HF}): max |diff| "
                f"{c['noise_max_abs_loss_diff']:.4f} at step {c['noise_max_abs_loss_diff_step']}, "
                f"mean |diff| {c['noise_mean_abs_loss_diff']:.4f}, final "
                f"{100 * c['noise_final_loss_rel_diff']:+.2f}%, mean of the last "
                f"{c['noise_final_window_steps']} steps {100 * c['noise_final_window_rel_diff']:+.2f}%")
        memory = (f"; peak memory {runs[RUN_FUSEMOE]['peak_memory_gib']:.2f} vs "
                  f"{runs[RUN_HF]['peak_memory_gib']:.2f} GiB" if c["peak_memory_ratio"] else "")
        log(f"step time: fusemoe {runs[RUN_FUSEMOE]['median_step_ms']:.1f} ms vs hf "
            f"{runs[RUN_HF]['median_step_ms']:.1f} ms: {c['speedup_step_time']:.3f}x" + memory)
    json_path = os.path.join(args.out, "train_qwen3_moe.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    png_path = os.path.join(args.out, "train_qwen3_moe.png")
    log(f"wrote {json_path}" + (f" and {png_path}" if plot(result, png_path) else ""))
    return 0 if all(r["finite"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
