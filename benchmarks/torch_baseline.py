#!/usr/bin/env python3
"""TorchTitan-style PyTorch MoE experts layer on one GPU: the baseline fusemoe_bench is judged by.

    y_t = sum_j w[t,j] * W2_e (silu(Wg_e x_t) * (Wu_e x_t)),   e = topk_idx[t, j]

The path is torchtitan's MoE with grouped GEMMs and all experts local: stable argsort of the flat
expert ids, gather of the token rows, torch._grouped_mm with per-expert offsets for gate/up
(x @ w13^T) and down (h @ w2^T), SwiGLU silu(g) * u, the routing weight applied in fp32, and
index_add_ into y (bf16 by default, as torchtitan's scatter_add). bf16 everywhere, autograd for the
backward (weights, x and the routing weights require grad, so weight gradients are bf16). Timed
with CUDA events, median over --iters after --warmup, a 256 MiB write flushing L2 before every
timed call. Useful FLOPs: 6*H*I per routed row forward, 12*H*I backward, 18*H*I both.
--fp8 also times the FP8 path a PyTorch user can pick today (torchao-style): both grouped GEMMs as
torch._scaled_grouped_mm on E4M3 operands with rowwise scales (activations per row, weights per
output row; dgrad on E4M3 dy and weights; weight gradients bf16), the activations' and dy's
quantization inside the timed call, the weights' E4M3 copies made once per weight version (as
fusemoe's FP8 path makes its own: once per optimizer step, not per call), expert groups padded to
16 rows. --num-experts runs a preset with fewer experts
(fusemoe_bench's E where it halved it to fit the GPU; benchmarks/compare_torch.py passes it).
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I (gate rows then up rows),
E experts, K top-k, S = T*K flat slots, R routed rows (expert-sorted slots), N rows of one expert.
Exit: 0 ok, 1 self-check failed, 2 bad arguments, 3 no Hopper GPU, 4 runtime error.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
from torch.nn.functional import silu

from torch_timings import FP8_IMPL  # benchmarks/: the name the scripts tell the FP8 timings by

PRESETS = {
    # name: (short name, H, I, E, K)
    "qwen3-30b-a3b": ("30B", 2048, 768, 128, 8),
    "qwen3-235b-a22b": ("235B", 4096, 1536, 128, 8),
    "qwen3-next": ("Next", 2048, 512, 512, 10),
    "deepseek-v3": ("DSv3", 7168, 2048, 256, 8),
}
SKEW_EXPONENT = 1.2  # Zipf exponent of --routing skewed, as in fusemoe_bench
REL_ERR_TOL = 2e-2  # bf16 level: a few roundings of 8 significant bits
L2_FLUSH_BYTES = 256 << 20  # 4x the H200's 60 MB L2
CEILING_DIM = 8192
PATH_GROUPED_MM = "grouped_mm"
PATH_LOOP = "per_expert_loop"


def project_commit():
    """$FUSEMOE_COMMIT, else scripts/project_commit.sh: this checkout's commit or "unknown",
    never the commit of a repository this copy merely sits in."""
    if os.environ.get("FUSEMOE_COMMIT"):
        return os.environ["FUSEMOE_COMMIT"]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts",
                          "project_commit.sh")
    try:
        out = subprocess.run(["bash", script], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def progress(message):
    print(f"[torch] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Routing: Gumbel top-k = K distinct experts drawn without replacement with probability ∝ p(e)
# ------------------------------------------------------------------------------------------------


def make_routing(num_tokens, num_experts, top_k, routing, seed, device):
    """topk_idx_TK (int64) and normalised top-k softmax weights topk_w_TK (fp32).

    logits = log p(e) + Gumbel noise; the top K logits are K distinct experts sampled without
    replacement ∝ p(e) (uniform p: uniformly at random); the weights are the softmax over the top
    K logits, i.e. a softmax router's top-k weights renormalised. Skewed: p(e) ∝ 1/(rank+1)^1.2,
    ranks a random permutation fixed by the seed. Same distributions as fusemoe_bench, other draws.
    """
    log_p_E = torch.zeros(num_experts, dtype=torch.float64, device=device)
    if routing == "skewed":
        rank_gen = torch.Generator(device="cpu").manual_seed(seed)
        rank_E = torch.randperm(num_experts, generator=rank_gen).to(device)
        log_p_E = -SKEW_EXPONENT * torch.log((rank_E + 1).to(torch.float64))
    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + num_tokens)
    u_TE = torch.rand(num_tokens, num_experts, generator=gen, dtype=torch.float64, device=device)
    u_TE = u_TE.clamp_(min=1e-300, max=1.0 - 1e-16)
    logits_TE = log_p_E - torch.log(-torch.log(u_TE))
    top_logits_TK, topk_idx_TK = logits_TE.topk(top_k, dim=-1)
    topk_w_TK = torch.softmax(top_logits_TK, dim=-1).to(torch.float32)
    return topk_idx_TK, topk_w_TK


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


def reorder_tokens(topk_idx_TK, topk_w_TK, num_experts):
    """torchtitan's TokenReorderer: expert-sorted slots, their tokens and weights, row offsets."""
    top_k = topk_idx_TK.shape[1]
    flat_idx_S = topk_idx_TK.reshape(-1)
    rows_per_expert_E = torch.histc(flat_idx_S.float(), bins=num_experts, min=0, max=num_experts)
    offsets_E = rows_per_expert_E.to(torch.int32).cumsum(0, dtype=torch.int32)
    slot_R = torch.argsort(flat_idx_S, stable=True)
    token_R = slot_R // top_k
    w_R = topk_w_TK.reshape(-1)[slot_R]
    return token_R, w_R, offsets_E, rows_per_expert_E


def combine(o_RH, w_R, token_R, num_tokens, combine_dtype):
    """Weight each routed row in fp32, then scatter-add rows into their tokens."""
    hidden = o_RH.shape[1]
    weighted_RH = (o_RH.float() * w_R[:, None]).to(combine_dtype)
    y_TH = torch.zeros(num_tokens, hidden, dtype=combine_dtype, device=o_RH.device)
    return y_TH.index_add_(0, token_R, weighted_RH)


def moe_grouped_mm(x_TH, topk_idx_TK, topk_w_TK, w13_EFH, w2_EHI, combine_dtype):
    num_tokens, hidden = x_TH.shape
    num_experts, _, intermediate = w2_EHI.shape
    token_R, w_R, offsets_E, _ = reorder_tokens(topk_idx_TK, topk_w_TK, num_experts)
    x_RH = torch.gather(x_TH, 0, token_R[:, None].expand(-1, hidden))
    gu_RF = torch._grouped_mm(x_RH, w13_EFH.transpose(-2, -1), offs=offsets_E)
    h_RI = silu(gu_RF[:, :intermediate]) * gu_RF[:, intermediate:]
    o_RH = torch._grouped_mm(h_RI, w2_EHI.transpose(-2, -1), offs=offsets_E)
    return combine(o_RH, w_R, token_R, num_tokens, combine_dtype).to(x_TH.dtype)


def moe_per_expert_loop(x_TH, topk_idx_TK, topk_w_TK, w13_EFH, w2_EHI, combine_dtype):
    """Fallback when torch._grouped_mm is missing or fails: one matmul pair per expert."""
    num_tokens, hidden = x_TH.shape
    num_experts, _, intermediate = w2_EHI.shape
    token_R, w_R, _, rows_per_expert_E = reorder_tokens(topk_idx_TK, topk_w_TK, num_experts)
    x_RH = torch.gather(x_TH, 0, token_R[:, None].expand(-1, hidden))
    o_parts = []
    start = 0
    for e, num_rows in enumerate(rows_per_expert_E.to(torch.int64).tolist()):
        if num_rows == 0:
            continue
        gu_NF = x_RH[start:start + num_rows] @ w13_EFH[e].t()
        h_NI = silu(gu_NF[:, :intermediate]) * gu_NF[:, intermediate:]
        o_parts.append(h_NI @ w2_EHI[e].t())
        start += num_rows
    o_RH = torch.cat(o_parts) if o_parts else x_RH.new_zeros(0, hidden)
    return combine(o_RH, w_R, token_R, num_tokens, combine_dtype).to(x_TH.dtype)


LAYERS = {PATH_GROUPED_MM: moe_grouped_mm, PATH_LOOP: moe_per_expert_loop}


# ------------------------------------------------------------------------------------------------
# FP8 (--fp8): torch._scaled_grouped_mm with rowwise scales, torchao-style, quantization counted
# ------------------------------------------------------------------------------------------------

FP8_GROUP_ALIGN = 16  # rows per expert group padded to this (the FP8 grouped GEMM's alignment)
FP8_REL_ERR_TOL = 1.5e-1  # E4M3 with one scale per row: several percent against fp32
E4M3_MAX = 448.0


def rowwise_fp8(t_MK):
    """E4M3 codes of t along its last dimension and their dequantization factors [..., M] (fp32)."""
    amax = t_MK.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    q = (t_MK.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (amax / E4M3_MAX).squeeze(-1)


_FP8_WEIGHT_CACHE = {}  # (which, data_ptr, _version, shape) -> rowwise E4M3 copy and its scales


def cached_weight_fp8(b_ENK, transposed):
    """rowwise_fp8 of the weight b [E, N, K] (or of b^T [E, K, N] for the dgrad), made once per
    weight version: an optimizer step bumps _version and so makes new copies."""
    key = (transposed, b_ENK.data_ptr(), b_ENK._version, tuple(b_ENK.shape))
    if key not in _FP8_WEIGHT_CACHE:
        if len(_FP8_WEIGHT_CACHE) >= 8:  # stale versions and other layers' shapes
            _FP8_WEIGHT_CACHE.clear()
        source = b_ENK.detach()
        _FP8_WEIGHT_CACHE[key] = rowwise_fp8(source.transpose(-2, -1).contiguous() if transposed else source)
    return _FP8_WEIGHT_CACHE[key]


class Fp8RowwiseGroupedMM(torch.autograd.Function):
    """out[rows of e] = a[rows of e] @ b[e]^T with a [M, K] and b [E, N, K] (bf16) quantized to E4M3
    per row along K (b's copies cached per weight version: cached_weight_fp8); backward: grad_a from E4M3 grad_out (rows) and b^T (per (e, k) along N), grad_b
    as torch._grouped_mm's own bf16 formula."""

    @staticmethod
    def forward(ctx, a_MK, b_ENK, offs_E):
        qa_MK, sa_M = rowwise_fp8(a_MK)
        qb_ENK, sb_EN = cached_weight_fp8(b_ENK, transposed=False)
        ctx.save_for_backward(a_MK, b_ENK, offs_E)
        return torch._scaled_grouped_mm(qa_MK, qb_ENK.transpose(-2, -1), sa_M, sb_EN, offs=offs_E,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, grad_MN):
        a_MK, b_ENK, offs_E = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()
        qg_MN, sg_M = rowwise_fp8(grad_MN)
        qbt_EKN, sbt_EK = cached_weight_fp8(b_ENK, transposed=True)
        grad_a = torch._scaled_grouped_mm(qg_MN, qbt_EKN.transpose(-2, -1), sg_M, sbt_EK,
                                          offs=offs_E, out_dtype=torch.bfloat16, use_fast_accum=True)
        grad_b = torch._grouped_mm(a_MK.t(), grad_MN, offs=offs_E).transpose(-2, -1)
        return grad_a, grad_b, None


def moe_scaled_grouped_mm_fp8(x_TH, topk_idx_TK, topk_w_TK, w13_EFH, w2_EHI, combine_dtype):
    """moe_grouped_mm with both GEMMs as Fp8RowwiseGroupedMM; each expert's rows padded to
    FP8_GROUP_ALIGN (zero rows) in the GEMMs' buffers, without a host sync."""
    num_tokens, hidden = x_TH.shape
    num_experts, _, intermediate = w2_EHI.shape
    token_R, w_R, offsets_E, rows_per_expert_E = reorder_tokens(topk_idx_TK, topk_w_TK, num_experts)
    num_rows = token_R.numel()
    counts_E = rows_per_expert_E.to(torch.int32)
    padded_E = (counts_E + FP8_GROUP_ALIGN - 1) // FP8_GROUP_ALIGN * FP8_GROUP_ALIGN
    padded_offsets_E = padded_E.cumsum(0, dtype=torch.int32)
    row_R = torch.arange(num_rows, device=x_TH.device, dtype=torch.int32)
    expert_R = torch.searchsorted(offsets_E, row_R, right=True)
    position_R = (row_R - (offsets_E - counts_E)[expert_R] + (padded_offsets_E - padded_E)[expert_R]).long()
    padded_rows = num_rows + num_experts * FP8_GROUP_ALIGN  # static upper bound
    x_RH = torch.gather(x_TH, 0, token_R[:, None].expand(-1, hidden))
    x_PH = x_TH.new_zeros(padded_rows, hidden).index_copy(0, position_R, x_RH)
    gu_PF = Fp8RowwiseGroupedMM.apply(x_PH, w13_EFH, padded_offsets_E)
    h_PI = silu(gu_PF[:, :intermediate]) * gu_PF[:, intermediate:]
    o_PH = Fp8RowwiseGroupedMM.apply(h_PI, w2_EHI, padded_offsets_E)
    return combine(o_PH[position_R], w_R, token_R, num_tokens, combine_dtype).to(x_TH.dtype)


def moe_reference_fp32(x_TH, topk_idx_TK, topk_w_TK, w13_EFH, w2_EHI):
    """Plain fp32 loop over experts, token order untouched: the self-check's oracle."""
    num_experts, _, intermediate = w2_EHI.shape
    y_TH = torch.zeros_like(x_TH)
    for e in range(num_experts):
        token_N, slot_N = (topk_idx_TK == e).nonzero(as_tuple=True)
        if token_N.numel() == 0:
            continue
        gu_NF = x_TH[token_N] @ w13_EFH[e].t()
        h_NI = silu(gu_NF[:, :intermediate]) * gu_NF[:, intermediate:]
        o_NH = h_NI @ w2_EHI[e].t()
        y_TH = y_TH.index_add(0, token_N, o_NH * topk_w_TK[token_N, slot_N][:, None])
    return y_TH


# ------------------------------------------------------------------------------------------------
# Self-check on a small shape
# ------------------------------------------------------------------------------------------------


def rel_err(a, b):
    a, b = a.double(), b.double()
    diff = torch.linalg.vector_norm(a - b).item()
    norm = torch.linalg.vector_norm(b).item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


SELF_CHECK_TOKENS = 203  # odd


def self_check_experts(top_k):
    """~50 rows per expert at T=203: every expert gets rows."""
    return max(8, 4 * top_k)


def self_check_shape(hidden=256, intermediate=128, top_k=2):
    return (f"T={SELF_CHECK_TOKENS} H={hidden} I={intermediate} E={self_check_experts(top_k)} "
            f"K={top_k}")


def self_check(layer, combine_dtype, device, seed, hidden=256, intermediate=128, top_k=2):
    """Runs `layer` (bf16) and the fp32 loop on the same bf16-rounded inputs, forward and backward;
    returns {output: relative error}. Shape: self_check_shape(hidden, intermediate, top_k)."""
    num_tokens, num_experts = SELF_CHECK_TOKENS, self_check_experts(top_k)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    x_TH = randn(num_tokens, hidden)
    w13_EFH = randn(num_experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
    w2_EHI = randn(num_experts, hidden, intermediate, scale=intermediate ** -0.5)
    dy_TH = randn(num_tokens, hidden)
    topk_idx_TK, topk_w_TK = make_routing(num_tokens, num_experts, top_k, "uniform", seed, device)

    # Candidate: bf16 activations and weights, fp32 routing weights, as timed below.
    w_cand = topk_w_TK.clone().requires_grad_()
    cand = [t.clone().requires_grad_() for t in (x_TH, w13_EFH, w2_EHI)]
    y_cand = layer(cand[0], topk_idx_TK, w_cand, cand[1], cand[2], combine_dtype)
    y_cand.backward(dy_TH)
    ref = [t.float().requires_grad_() for t in (x_TH, w13_EFH, w2_EHI)]
    w_ref = topk_w_TK.clone().requires_grad_()
    y_ref = moe_reference_fp32(ref[0], topk_idx_TK, w_ref, ref[1], ref[2])
    y_ref.backward(dy_TH.float())
    return {
        "y": rel_err(y_cand, y_ref),
        "dx": rel_err(cand[0].grad, ref[0].grad),
        "d_topk_weights": rel_err(w_cand.grad, w_ref.grad),
        "dw13": rel_err(cand[1].grad, ref[1].grad),
        "dw2": rel_err(cand[2].grad, ref[2].grad),
    }


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


class Timer:
    """CUDA events around each call, median over iters after warmup; L2 flushed before each call.
    On the CPU (--device cpu, for testing this script) it falls back to wall-clock time."""

    def __init__(self, device):
        self.device = device
        self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) \
            if device.type == "cuda" else None

    def run(self, op, iters, warmup, setup=None, flush_l2=True):
        samples_ms = []
        if self.device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(iters)]
            for i in range(warmup + iters):
                state = setup() if setup else None
                if flush_l2:
                    self.flush_buf.fill_(i & 0xFF)
                if i >= warmup:
                    events[i - warmup][0].record()
                op(state)
                if i >= warmup:
                    events[i - warmup][1].record()
            torch.cuda.synchronize()
            samples_ms = [start.elapsed_time(end) for start, end in events]
        else:
            for i in range(warmup + iters):
                state = setup() if setup else None
                start = time.perf_counter()
                op(state)
                if i >= warmup:
                    samples_ms.append(1e3 * (time.perf_counter() - start))
        return {"ms_median": statistics.median(samples_ms), "ms_min": min(samples_ms),
                "ms_max": max(samples_ms)}


def measure_ceiling(timer, device):
    """torch.mm bf16 8192^3 on random data (cuBLAS underneath): this process's GEMM ceiling."""
    n = CEILING_DIM if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    # 10 warm-ups: the SM clock ramps up from idle first.
    stats = timer.run(lambda _: torch.mm(a, b), iters=10, warmup=10, flush_l2=False)
    stats["tflops"] = 2.0 * n ** 3 / (stats["ms_median"] * 1e-3) / 1e12
    stats["what"] = f"torch.mm bf16 {n}^3, random data"
    return stats


def time_case(layer, impl_name, preset, num_tokens, args, weights, timer, device, ceiling):
    short, hidden, intermediate, num_experts, top_k = preset
    w13_EFH, w2_EHI = weights
    label = f"{short} T={num_tokens}"
    topk_idx_TK, topk_w_TK = make_routing(num_tokens, num_experts, top_k, args.routing,
                                          args.seed, device)
    rows_per_expert_E = torch.bincount(topk_idx_TK.reshape(-1), minlength=num_experts)
    valid_rows = int(topk_idx_TK.numel())
    x_TH = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16).requires_grad_()
    dy_TH = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
    topk_w_TK.requires_grad_()
    leaves = (x_TH, topk_w_TK, w13_EFH, w2_EHI)
    combine_dtype = torch.float32 if args.combine_dtype == "fp32" else torch.bfloat16

    def clear_grads():
        for t in leaves:
            t.grad = None

    def forward(_):
        return layer(x_TH, topk_idx_TK, topk_w_TK, w13_EFH, w2_EHI, combine_dtype)

    def forward_backward(_):
        forward(None).backward(dy_TH)

    def setup_backward():
        clear_grads()
        return forward(None)

    measurements = [
        ("forward", 6, forward, clear_grads),
        ("backward", 12, lambda y_TH: y_TH.backward(dy_TH), setup_backward),
        ("forward+backward", 18, forward_backward, clear_grads),
    ]
    timings = []
    for pass_name, flops_per_row_hi, op, setup in measurements:
        progress(f"{label}: timing {impl_name} {pass_name} ...")
        stats = timer.run(op, args.iters, args.warmup, setup=setup)
        flops = flops_per_row_hi * hidden * intermediate * valid_rows
        tflops = flops / (stats["ms_median"] * 1e-3) / 1e12
        wgrad = "-" if pass_name == "forward" else "bf16"  # bf16 parameters: bf16 gradients
        timings.append({"impl": impl_name, "pass": pass_name, "weight_grad_dtype": wgrad,
                        **stats, "flops": flops, "tflops": tflops,
                        "pct_ceiling": 100.0 * tflops / ceiling["tflops"]})
    clear_grads()
    return {
        "tokens": num_tokens,
        "valid_rows": valid_rows,
        "expert_rows_min": int(rows_per_expert_E.min()),
        "expert_rows_max": int(rows_per_expert_E.max()),
        "expert_rows_mean": valid_rows / num_experts,
        "experts_empty": int((rows_per_expert_E == 0).sum()),
        "timings": timings,
    }


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def add_shared_arguments(parser):
    """The options torch_baseline shares with fusemoe_bench (and liger_baseline.py with it)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--num-experts", type=int,
                        help="run the preset with this many experts (fusemoe_bench's E where it "
                             "reduced it to fit the GPU; default the preset's)")
    parser.add_argument("--tokens", default="4096", help="comma-separated token counts")
    parser.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write all figures and metadata to this path")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda",
                        help="'cpu' only to test this script without a GPU (timings meaningless)")


def check_shared_arguments(parser, args):
    """args.token_list and args.layer (short name, H, I, E, K), or parser.error."""
    try:
        args.token_list = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens expects comma-separated integers, got '{args.tokens}'")
    if any(t < 1 for t in args.token_list):
        parser.error("--tokens must all be >= 1")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    short, hidden, intermediate, num_experts, top_k = PRESETS[args.preset]
    if args.num_experts is not None:
        if not top_k <= args.num_experts:
            parser.error(f"--num-experts must be >= the preset's top-k {top_k}")
        num_experts = args.num_experts
    args.layer = (short, hidden, intermediate, num_experts, top_k)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shared_arguments(parser)
    parser.add_argument("--combine-dtype", choices=["bf16", "fp32"], default="bf16",
                        help="dtype of the index_add_ accumulation into y (torchtitan: bf16)")
    parser.add_argument("--force-loop", action="store_true",
                        help="time the per-expert loop instead of torch._grouped_mm")
    parser.add_argument("--fp8", action="store_true",
                        help="also time torch._scaled_grouped_mm with rowwise E4M3 scales (torchao-"
                             "style; quantization inside the timed calls, weight gradients bf16)")
    args = parser.parse_args(argv)
    check_shared_arguments(parser, args)
    return args


def find_device(args, tool="torch_baseline"):
    """The GPU to time on, or exit 3 (no Hopper)."""
    if args.device == "cpu":
        return torch.device("cpu"), {"gpu": "cpu (test mode)", "compute_capability": None}
    reason = None
    if not torch.cuda.is_available():
        reason = "torch.cuda.is_available() is False"
    else:
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            reason = f"{torch.cuda.get_device_name()} is compute capability {major}.{minor}"
    if reason:
        print(f"{tool}: no Hopper (sm_90) GPU found: {reason}; the benchmark needs an "
              "H100/H200", file=sys.stderr)
        sys.exit(3)
    props = torch.cuda.get_device_properties(0)
    return torch.device("cuda"), {
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
    }


def choose_path(args, device, result):
    """grouped_mm if it exists and passes the self-check, else the per-expert loop (loudly)."""
    combine_dtype = torch.float32 if args.combine_dtype == "fp32" else torch.bfloat16
    path, fallback_reason = PATH_GROUPED_MM, None
    if args.force_loop:
        path, fallback_reason = PATH_LOOP, "--force-loop"
    elif not hasattr(torch, "_grouped_mm"):
        path, fallback_reason = PATH_LOOP, f"torch {torch.__version__} has no torch._grouped_mm"
    errors = None
    if path == PATH_GROUPED_MM:
        try:
            errors = self_check(moe_grouped_mm, combine_dtype, device, args.seed)
        except Exception as error:  # any failure of the grouped path means: use the loop
            path, fallback_reason = PATH_LOOP, f"torch._grouped_mm failed: {error!r}"
            traceback.print_exc(file=sys.stderr)
    if path == PATH_LOOP:
        print("!" * 100)
        print(f"!!! torch_baseline: FALLBACK to a per-expert loop: {fallback_reason}")
        print("!!! the PyTorch figures below are NOT the torch._grouped_mm path")
        print("!" * 100, flush=True)
        errors = self_check(moe_per_expert_loop, combine_dtype, device, args.seed)
    passed = all(err <= REL_ERR_TOL for err in errors.values())  # NaN fails
    result["meta"]["path"] = path
    result["meta"]["fallback_reason"] = fallback_reason
    result["self_check"] = {"shape": self_check_shape(), "tol": REL_ERR_TOL,
                            "rel_err": errors, "pass": passed}
    print(f"self-check ({path}) vs fp32 loop, {self_check_shape()}, tol {REL_ERR_TOL:.0e}: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
          + (" -> pass" if passed else " -> FAIL"), flush=True)
    return path, passed


def fp8_self_check(args, device, result):
    """The FP8 path against the fp32 loop (loose: rowwise E4M3); False (reported) if it fails."""
    combine_dtype = torch.float32 if args.combine_dtype == "fp32" else torch.bfloat16
    try:
        errors = self_check(moe_scaled_grouped_mm_fp8, combine_dtype, device, args.seed)
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        result["fp8_self_check"] = {"error": repr(error), "pass": False}
        print(f"torch_baseline: FP8 path unavailable: {error!r}", flush=True)
        return False
    passed = all(err <= FP8_REL_ERR_TOL for err in errors.values())
    result["fp8_self_check"] = {"tol": FP8_REL_ERR_TOL, "rel_err": errors, "pass": passed}
    print(f"FP8 self-check (torch._scaled_grouped_mm rowwise) vs fp32 loop, tol "
          f"{FP8_REL_ERR_TOL:.0e}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
          + (" -> pass" if passed else " -> FAIL: not timed"), flush=True)
    return passed


def print_case(case, meta, ceiling):
    print(f"\n== {meta['preset']} T={case['tokens']} routing={meta['routing']}: "
          f"{case['valid_rows']} valid rows; rows/expert min {case['expert_rows_min']} "
          f"mean {case['expert_rows_mean']:.0f} max {case['expert_rows_max']}, "
          f"{case['experts_empty']} empty ==")
    print(f"  {'impl':<22} {'pass':<17} {'wgrad':<5} {'ms':>9} {'min ms':>9} {'TFLOP/s':>9} "
          f"{'%ceil':>7}  (ceiling {ceiling['tflops']:.0f} TFLOP/s, torch.mm)")
    for t in case["timings"]:
        print(f"  {t['impl']:<22} {t['pass']:<17} {t['weight_grad_dtype']:<5} "
              f"{t['ms_median']:9.3f} {t['ms_min']:9.3f} {t['tflops']:9.1f} "
              f"{t['pct_ceiling']:6.1f}%")
    sys.stdout.flush()


def run_meta(args, gpu_meta):
    """The "meta" fields torch_baseline.py and liger_baseline.py share: the GPU, versions, commit,
    date, the layer run (args.layer) and the timing settings."""
    _, hidden, intermediate, num_experts, top_k = args.layer
    return {
        **gpu_meta,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": project_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "preset": args.preset,
        "hidden": hidden, "intermediate": intermediate,
        "num_experts": num_experts, "top_k": top_k,
        "preset_num_experts": PRESETS[args.preset][3],
        "routing": args.routing,
        "skew_exponent": SKEW_EXPONENT if args.routing == "skewed" else 0.0,
        "seed": args.seed, "iters": args.iters, "warmup": args.warmup,
        "tokens": args.token_list,
        "l2_flush_bytes": L2_FLUSH_BYTES,
        "forward_mode": "autograd recording (as in training)",
    }


def make_weights(layer, seed, device):
    """w13_EFH ~ N(0, 1/H) and w2_EHI ~ N(0, 1/I), bf16, requiring grad; the same for a seed."""
    _, hidden, intermediate, num_experts, _ = layer
    gen = torch.Generator(device=device).manual_seed(seed)
    w13_EFH = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen, device=device,
                          dtype=torch.bfloat16)
    w13_EFH.mul_(hidden ** -0.5).requires_grad_()
    w2_EHI = torch.randn(num_experts, hidden, intermediate, generator=gen, device=device,
                         dtype=torch.bfloat16)
    w2_EHI.mul_(intermediate ** -0.5).requires_grad_()
    return w13_EFH, w2_EHI


def main():
    args = parse_args()
    device, gpu_meta = find_device(args)
    short, hidden, intermediate, num_experts, top_k = args.layer
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 self-check oracle stays fp32
    result = {
        "tool": "torch_baseline",
        "schema": 1,
        "meta": {**run_meta(args, gpu_meta), "combine_dtype": args.combine_dtype},
        "cases": [],
        "error": "",
    }
    meta = result["meta"]
    print(f"torch_baseline  commit {meta['commit']}  {meta['date']}")
    print(f"GPU: {meta['gpu']}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"layer {args.preset}: H={hidden} I={intermediate} E={num_experts} K={top_k}; tokens "
          f"{args.tokens}; routing {args.routing}; combine {args.combine_dtype}", flush=True)

    exit_code = 0
    try:
        progress(f"{short}: self-check on a small shape ...")
        path, passed = choose_path(args, device, result)
        if not passed:
            print("torch_baseline: SELF-CHECK FAILED; not timing a wrong layer", flush=True)
            exit_code = 1
        else:
            timer = Timer(device)
            progress("measuring the bf16 GEMM ceiling (torch.mm) ...")
            ceiling = measure_ceiling(timer, device)
            result["ceiling"] = ceiling
            print(f"bf16 GEMM ceiling ({ceiling['what']}): {ceiling['tflops']:.1f} TFLOP/s",
                  flush=True)
            progress(f"{short}: generating weights ...")
            weights = make_weights(args.layer, args.seed, device)
            impl_name = "torch_" + path
            fp8 = args.fp8 and fp8_self_check(args, device, result)
            for num_tokens in args.token_list:
                case = time_case(LAYERS[path], impl_name, args.layer, num_tokens, args, weights,
                                 timer, device, ceiling)
                if fp8:
                    try:
                        fp8_case = time_case(moe_scaled_grouped_mm_fp8, FP8_IMPL, args.layer,
                                             num_tokens, args, weights, timer, device, ceiling)
                        case["timings"] += fp8_case["timings"]
                    except Exception as error:  # the FP8 path is optional: report, keep going
                        traceback.print_exc(file=sys.stderr)
                        result["fp8_error"] = repr(error)
                        print(f"torch_baseline: FP8 path failed at T={num_tokens}: {error!r}",
                              flush=True)
                        fp8 = False
                result["cases"].append(case)
                print_case(case, meta, ceiling)
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        result["error"] = repr(error)
        print(f"torch_baseline: error: {error!r}", file=sys.stderr)
        exit_code = 4
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        progress(f"wrote {args.json}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
