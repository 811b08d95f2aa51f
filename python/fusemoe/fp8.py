"""Blockwise FP8 for fusemoe's PyTorch op (precision="fp8"; the C++ Precision::kFp8Blockwise, impl
"fused" only, intermediate a multiple of 128). docs/design.md, "Blockwise FP8"; docs/numerics.md.

The GEMMs run on E4M3 operands (x, h, dy, dz scaled per 1 x 128 block, the weights per 128 x 128),
accumulate in fp32 and return what the bf16 op returns, in the same dtypes; the weight gradients
are computed from bf16 operands, or with fp8_weight_grads=True from FP8 ones too (the activations
x and w*h in 128 x 128 blocks, the gradients dy and dz in 1 x 128 blocks along the tokens; the
C++ LayerConfig::fp8_weight_grads, docs/numerics.md). The master weights stay the caller's bf16
(or fp32) parameters: their FP8 copy (both weights, their per-expert transposes and the block
scales, one uint8 buffer) comes from fusemoe::quantize_weights_fp8 and is kept by Fp8WeightCache
until a weight changes (tensor._version: an optimizer step, load_state_dict, any in-place
update), so it is built once per optimizer step, not once per micro-batch. Wrappers that
rewrite the weights in place while keeping their version (FSDP2 all-gathers into the same
unsharded Parameter with its version counter preserved, often at the same address) are covered
by a process-wide generation that every optimizer step (a global torch.optim step hook),
MoEExperts.load_state_dict and MoEExperts.reset_parameters bump; any other rewrite of that kind
(e.g. an in-place load into FSDP2's sharded weights that bypasses load_state_dict) must call
invalidate_fp8_caches().

Ops: fusemoe::quantize_weights_fp8, fusemoe::moe_experts_fp8_forward / _backward /
_backward_into (the bf16 ops' signatures plus the FP8 weight buffer, which gets no gradient, and
the option fp8_weight_grads last, which the forward hands to the backward ops). The C calls take
a FusemoeCLayer of precision "fp8" (and its fp8_weight_grads, C ABI 9) and the buffer in the args'
fp8_weights (C ABI 6).
Expert parallelism (fusemoe.ExpertParallelMoEExperts, precision="fp8") uses the same buffer of
each rank's local experts and the same cache; fp8_weight_grads is refused there.
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
"""
from typing import Optional

import torch
from torch import Tensor

from . import _capi
from ._checks import _check_fp8_shapes, _check_tensor, _fail, fp8_weights_bytes
from .ops import (_backward_fake, _call, _check_cuda, _check_w2_matches_w13, _forward_fake,
                  _fresh_weight_grads, _gradients, _launch_backward, _launch_forward, _op,
                  _register_autograd, _returned_weight_grads, _save_for_backward, _wants_saved_z)

# ------------------------------------------------------------------------------ weight buffer

@_op("quantize_weights_fp8")
def quantize_weights_fp8(w13_EFH: Tensor, w2_EHI: Tensor) -> Tensor:
    """The FP8 weight buffer of bf16 w13 [E, 2I, H] and w2 [E, H, I] (uint8, fp8_weights_bytes)."""
    _check_tensor(w13_EFH, "w13 (gate_up_proj)", 3, torch.bfloat16)
    _check_tensor(w2_EHI, "w2 (down_proj)", 3, torch.bfloat16)
    num_experts, hidden, intermediate = _check_fp8_shapes(w13_EFH, w2_EHI)
    _check_w2_matches_w13(w13_EFH, w2_EHI)  # the library takes every size from w13
    _check_cuda(w13_EFH)
    # The buffer depends on the weights' shape only (top_k, max_tokens: any valid values).
    layer = _capi.layer(hidden, intermediate, num_experts, 1, 0, "fused", None, "fp8")
    num_bytes = _capi.fp8_weights_bytes(layer)
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=w13_EFH.device)
    with torch.cuda.device(w13_EFH.device):
        _capi.quantize_weights_fp8(layer, w13_EFH.data_ptr(), w2_EHI.data_ptr(), buffer.data_ptr(),
                                   num_bytes, torch.cuda.current_stream(w13_EFH.device).cuda_stream)
    return buffer


@torch.library.register_fake("fusemoe::quantize_weights_fp8")
def _quantize_weights_fp8_fake(w13_EFH, w2_EHI):
    num_experts, hidden, intermediate = _check_fp8_shapes(w13_EFH, w2_EHI)
    _check_w2_matches_w13(w13_EFH, w2_EHI)
    return w13_EFH.new_empty(fp8_weights_bytes(num_experts, hidden, intermediate),
                             dtype=torch.uint8)


# Bumped by invalidate_fp8_caches(): part of every cache key, so a bump rebuilds every buffer at
# its next use. See the module docstring.
_generation = 0
_step_hook = None


def invalidate_fp8_caches():
    """Makes every FP8 weight cache rebuild its buffer at its next use. Called after every
    optimizer step and by MoEExperts.load_state_dict; call it yourself after changing the weights
    in a way that keeps their version counter (e.g. writing FSDP2's sharded weights in place
    outside an optimizer step and load_state_dict)."""
    global _generation
    _generation += 1


def _on_optimizer_step(optimizer, args, kwargs):
    invalidate_fp8_caches()


def _register_step_hook():
    """A global post-step hook on every torch.optim optimizer (once per process): the signal of
    a weight update that does not show in the weights' own versions (FSDP2)."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _step_hook = register_optimizer_step_post_hook(_on_optimizer_step)


class Fp8WeightCache:
    """The FP8 buffer of one set of weight tensors (w13, w2, or fusemoe.separate's w1, w3, w2),
    rebuilt only when any changes: a new tensor object or storage, an in-place update
    (tensor._version), or a new generation (any optimizer step, invalidate_fp8_caches()).
    quantizations counts the rebuilds."""

    def __init__(self):
        self._key = None
        self._buffer = None
        self.quantizations = 0

    # Pickled and copied empty (torch.save of a module, copy.deepcopy): the buffer is derived
    # from the weights and rebuilt at the next call, and the key holds the quantize op, which
    # does not pickle.
    def __getstate__(self):
        return {"quantizations": self.quantizations}

    def __setstate__(self, state):
        self.__init__()
        self.quantizations = state["quantizations"]

    def get(self, w13_source, w2_source, w13_EFH=None, w2_EHI=None):
        """w13_source, w2_source: the tensors whose versions decide (e.g. fp32 Parameters);
        w13_EFH, w2_EHI: their bf16 values if not the sources themselves."""
        return self.get_of(quantize_weights_fp8, (w13_source, w2_source), (w13_EFH, w2_EHI))

    def get_of(self, quantize, sources, values):
        """The buffer quantize(*bf16 weights) of the weights values (None: the source itself),
        keyed on sources."""
        key = (_generation, quantize, *(id(s) for s in sources), *(s.data_ptr() for s in sources),
               *(s._version for s in sources), *(tuple(s.shape) for s in sources),
               sources[0].dtype, sources[0].device)
        if self._buffer is None or key != self._key:
            _register_step_hook()
            with torch.no_grad():
                weights = (v if v is not None else s for s, v in zip(sources, values))
                self._buffer = _call(quantize, *(w.detach().to(torch.bfloat16).contiguous()
                                                 for w in weights))
            self._key = key
            self.quantizations += 1
        return self._buffer


def traced(t):
    """True under torch.compile or for a fake tensor: no storage or version to key a cache on."""
    from torch._subclasses.fake_tensor import FakeTensor
    return torch.compiler.is_compiling() or isinstance(t, FakeTensor)


def cached_fp8_weights(w13_EFH, w2_EHI, cache=None, sources=None):
    """The FP8 buffer of bf16 w13/w2 (the one entry point of the FP8 weight caches). cache: an
    Fp8WeightCache (MoEExperts keeps one), or None for one kept on the w13 tensor itself (so it
    lives as long as the weights); sources: the tensors whose versions decide, (w13, w2) when
    None (MoEExperts passes its Parameters: an fp32 master's bf16 copy is new each call).
    Traced (torch.compile, fake tensors: no storage or version to key on) the buffer is rebuilt
    on every call."""
    return cached_buffer(quantize_weights_fp8, (w13_EFH, w2_EHI), cache, sources,
                         "_fusemoe_fp8_cache")


def cached_buffer(quantize, weights, cache, sources, attribute):
    """cached_fp8_weights for the weights of any form (fusemoe.separate: w1, w3, w2) and their
    quantize op; attribute: the name of the cache kept on weights[0] when cache is None."""
    if traced(weights[0] if sources is None else sources[0]):
        return _call(quantize, *(w.detach() for w in weights))
    if cache is None:
        cache = getattr(weights[0], attribute, None)
        if cache is None:
            cache = Fp8WeightCache()
            setattr(weights[0], attribute, cache)
    if sources is None:
        return cache.get_of(quantize, weights, (None,) * len(weights))
    return cache.get_of(quantize, sources, weights)


# ---------------------------------------------------------------------------------------- ops

@_op("moe_experts_fp8_forward")
def moe_experts_fp8_forward(x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
                            w13_EFH: Tensor, w2_EHI: Tensor, fp8_weights: Tensor, impl: str,
                            grad_in_place: bool = False, save_z: bool = False,
                            swiglu_clamp: Optional[float] = None,
                            fp8_weight_grads: bool = False) -> tuple[Tensor, Tensor]:
    """fusemoe::moe_experts_forward on the FP8 weights (w13/w2 give the shapes and receive the
    gradients; their values are not read: the library gets null pointers for them).
    fp8_weight_grads: the backward's option, kept for it by autograd."""
    return _launch_forward(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, save_z,
                           swiglu_clamp, fp8_weights, fp8_weight_grads)


@torch.library.register_fake("fusemoe::moe_experts_fp8_forward")
def _moe_experts_fp8_forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, fp8_weights,
                                  impl, grad_in_place=False, save_z=False, swiglu_clamp=None,
                                  fp8_weight_grads=False):
    return _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, save_z,
                         swiglu_clamp, fp8_weights=fp8_weights)


@_op("moe_experts_fp8_backward")
def moe_experts_fp8_backward(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                             topk_weights_TK: Tensor, w13_EFH: Tensor, w2_EHI: Tensor,
                             fp8_weights: Tensor, impl: str, saved_z_SF: Optional[Tensor] = None,
                             swiglu_clamp: Optional[float] = None, gate_up_grad: bool = True,
                             down_grad: bool = True, fp8_weight_grads: bool = False
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_weights, dw13, dw2) as fusemoe::moe_experts_backward, at FP8 (fp8_weight_grads:
    the weight gradients too)."""
    grads = _fresh_weight_grads((w13_EFH, w2_EHI), gate_up_grad, down_grad)
    dx_TH, d_topk_weights_TK = _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH,
                                                w2_EHI, *grads, False, impl, saved_z_SF,
                                                swiglu_clamp, fp8_weights, fp8_weight_grads)
    return (dx_TH, d_topk_weights_TK, *_returned_weight_grads(grads, (w13_EFH, w2_EHI)))


@torch.library.register_fake("fusemoe::moe_experts_fp8_backward")
def _moe_experts_fp8_backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI,
                                   fp8_weights, impl, saved_z_SF=None, swiglu_clamp=None,
                                   gate_up_grad=True, down_grad=True, fp8_weight_grads=False):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, fp8_weights=fp8_weights,
                          gate_up_grad=gate_up_grad, down_grad=down_grad)


@_op("moe_experts_fp8_backward_into", mutates_args=("dw13_EFH", "dw2_EHI"))
def moe_experts_fp8_backward_into(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                                  topk_weights_TK: Tensor, w13_EFH: Tensor, w2_EHI: Tensor,
                                  fp8_weights: Tensor, dw13_EFH: Tensor, dw2_EHI: Tensor,
                                  accumulate: bool, impl: str,
                                  saved_z_SF: Optional[Tensor] = None,
                                  swiglu_clamp: Optional[float] = None,
                                  fp8_weight_grads: bool = False) -> tuple[Tensor, Tensor]:
    """fusemoe::moe_experts_backward_into at FP8."""
    return _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dw13_EFH,
                            dw2_EHI, accumulate, impl, saved_z_SF, swiglu_clamp, fp8_weights,
                            fp8_weight_grads)


@torch.library.register_fake("fusemoe::moe_experts_fp8_backward_into")
def _moe_experts_fp8_backward_into_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI,
                                        fp8_weights, dw13_EFH, dw2_EHI, accumulate, impl,
                                        saved_z_SF=None, swiglu_clamp=None,
                                        fp8_weight_grads=False):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, weight_grads=(dw13_EFH, dw2_EHI),
                          fp8_weights=fp8_weights)


def _setup_context(ctx, inputs, output):
    _save_for_backward(ctx, inputs[:6], *inputs[6:10], output[1], options=inputs[10:])


def _backward(ctx, dy_TH, _dz_unused):
    return _gradients(ctx, dy_TH, moe_experts_fp8_backward, moe_experts_fp8_backward_into)


_forward_call = _register_autograd("moe_experts_fp8_forward", _backward, _setup_context)


def moe_experts_fp8(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl="fused",
                    grad_in_place=False, recompute_z=False, fp8_weights=None, swiglu_clamp=None,
                    fp8_weight_grads=False):
    """fusemoe.moe_experts at precision="fp8". fp8_weights: the buffer of quantize_weights_fp8(w13,
    w2), or None for the one cached on w13 (rebuilt when w13 or w2 change); fp8_weight_grads: the
    weight gradients from FP8 operands too."""
    if impl != "fused":
        _fail(f"precision=\"fp8\" needs impl=\"fused\" (got {impl!r})")
    if fp8_weights is None:
        fp8_weights = cached_fp8_weights(w13_EFH, w2_EHI)
    save_z = _wants_saved_z(impl, recompute_z, x_TH, topk_weights_TK, w13_EFH, w2_EHI)
    return _call(_forward_call, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI,
                 fp8_weights, impl, grad_in_place, save_z, swiglu_clamp, fp8_weight_grads)[0]
