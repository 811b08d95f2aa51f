"""fusemoe.moe_experts: the experts block as one differentiable function over the bf16 ops
(fusemoe.ops) or, with precision="fp8", the blockwise FP8 ones (fusemoe.fp8, built on fusemoe.ops).
It sits above both so that fusemoe.ops never imports fusemoe.fp8."""
from ._checks import _check_fp8_weight_grads, _fail
from .fp8 import moe_experts_fp8
from .ops import DEFAULT_IMPL, _call, _check_swiglu_clamp, _forward_call, _wants_saved_z


def moe_experts(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl=DEFAULT_IMPL,
                grad_in_place=False, recompute_z=False, swiglu_clamp=None, precision="bf16",
                fp8_weights=None, fp8_weight_grads=False):
    """The experts block as a differentiable function (strict inputs: see fusemoe.ops's docstring;
    fusemoe.MoEExperts converts dtypes and layouts for you).

    grad_in_place=True (eager mode, leaf w13/w2 such as Parameters): the backward kernels add the
    weight gradients straight into w13.grad / w2.grad (gradient accumulation over micro-batches
    without a separate elementwise add; .grad in the Parameters' dtype), and autograd sees no
    gradient for w13/w2, so their hooks (register_post_accumulate_grad_hook, DDP's reducer) do
    not fire; FSDP2 reduces the .grad it finds and works (docs/design.md). Like Megatron's
    gradient_accumulation_fusion. Not traceable by torch.compile. Only a backward pass that
    accumulates every weight's gradient (loss.backward()) writes .grad: torch.autograd.grad and
    backward(inputs=...) without all the weights leave .grad alone and return what they asked for.
    Under compiled autograd (eager forward, compiled backward) the weight gradients are returned
    to autograd as without it, with a warning: the compiled graph owns .grad.

    recompute_z: with impl="fused" and gradients required, the forward by default also saves the
    pre-activations z (2·I·K bf16 per token: 24 KiB for Qwen3-30B-A3B) and the backward skips
    recomputing them (one grouped GEMM of 4·H·I FLOPs per routed row); recompute_z=True trades
    that time for the memory.

    swiglu_clamp: None, or c > 0 (DeepSeek-V4 / gpt-oss style): g <- min(g, c) and
    u <- clamp(u, -c, c) before silu(g) * u; gradients pass where the bounds are not active
    (inclusive), as torch.clamp's do.

    precision="fp8": blockwise FP8 GEMMs (impl "fused"; fusemoe.fp8). fp8_weights: the buffer of
    fusemoe.fp8.quantize_weights_fp8(w13, w2), or None for one cached on w13 per weight version.
    fp8_weight_grads=True (precision "fp8" only): the weight gradients' GEMMs in FP8 too (faster
    at many tokens per expert, less accurate; docs/numerics.md), else from bf16 operands."""
    _check_swiglu_clamp(swiglu_clamp)
    _check_fp8_weight_grads(fp8_weight_grads, precision)
    if precision != "bf16":
        if precision != "fp8":
            _fail(f"precision must be \"bf16\" or \"fp8\", got {precision!r}")
        return moe_experts_fp8(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                               grad_in_place, recompute_z, fp8_weights, swiglu_clamp,
                               fp8_weight_grads)
    save_z = _wants_saved_z(impl, recompute_z, x_TH, topk_weights_TK, w13_EFH, w2_EHI)
    return _call(_forward_call, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                 grad_in_place, save_z, swiglu_clamp)[0]
