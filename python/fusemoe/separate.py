"""The experts block on separate gate and up weights, torchtitan's GroupedExperts layout: the ops
fusemoe::moe_experts_w1w3_forward / fusemoe::moe_experts_w1w3_backward, their fake kernels and
autograd, and moe_experts_w1w3(). The library reads w1 and w3 in place (C ABI 8: the args' w1, w3
and dw1, dw3; impl "fused" only) and writes their gradients apart: nothing is concatenated, and
autograd gives w1 and w3 their own gradients.

    y_t = sum_j w[t,j] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = topk_idx[t,j]  (-1: masked)

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k. x, y, dy, dx bf16
[T, H]; topk_idx int32 [T, K]; topk_weights fp32 [T, K]; w1 (gate), w3 (up) bf16 [E, I, H];
w2 bf16 [E, H, I]. The rest (z saved for the backward unless recompute_z, the expert-id report,
workspaces from torch's allocator, errors) is fusemoe.ops' (see its docstring).

Options as fusemoe.moe_experts', on its machinery: grad_in_place=True (eager, leaf w1, w3, w2)
goes through fusemoe::moe_experts_w1w3_backward_into, which writes (first micro-batch) or adds
dw1, dw3, dw2 into their .grad (fusemoe.ops._gradients / _backward_into_grads); precision="fp8"
through fusemoe::moe_experts_w1w3_fp8_forward / _backward / _backward_into on the buffer of
fusemoe::quantize_weights_fp8_w1w3 (the library's quantize_weights_fp8 overload for w1, w3: the
bytes quantize_weights_fp8 writes for w13 = [w1; w3]), cached on w1 per version of w1, w3 and w2
as fusemoe.fp8 caches per (w13, w2) version (fusemoe.fp8.cached_buffer, the same rules).

Like fusemoe.ops' ops, each has two definitions: the native binding's C++ kernel
(src/torch_binding/ops.cpp, the same schema and messages) when it is loaded, else the Python
function below over ctypes; the fake kernels and the autograd formula are registered on the name.
"""
from typing import Optional

import torch
from torch import Tensor

from . import _capi
from ._checks import (_check_fp8_buffer_bytes, _check_fp8_dims, _check_fp8_weight_grads,
                      _check_tensor, _fail, fp8_weights_bytes)
from .fp8 import cached_buffer
from .ops import (DEFAULT_IMPL, _call, _call_backward, _call_forward, _check_cuda, _check_dtypes,
                  _check_impl, _check_routing, _check_save_z, _check_saved_z,
                  _check_swiglu_clamp, _empty_saved_z, _fresh_weight_grads, _gradients, _op,
                  _pointer, _register_autograd, _returned_weight_grads, _save_for_backward,
                  _wants_saved_z, _weight_grad_dtype)

API = "fusemoe.moe_experts_w1w3"


def _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH=None,
                       api=API):
    """fusemoe.ops._check_inputs for w1, w3 [E, I, H]: returns the dims (H, I, E, K, T)."""
    weights_named = [("w1 (gate)", w1_EIH), ("w3 (up)", w3_EIH), ("w2 (down)", w2_EHI)]
    _check_dtypes(x_TH, topk_idx_TK, topk_weights_TK, weights_named, api)
    num_tokens, hidden = x_TH.shape
    num_experts, intermediate, w1_hidden = w1_EIH.shape
    if w1_hidden != hidden:
        _fail(f"w1 (gate) must be [E, I, H] with H = x.shape[1] = {hidden}, "
              f"got {tuple(w1_EIH.shape)}", api)
    _check_w3_w2_match_w1(w1_EIH, w3_EIH, w2_EHI, api)
    _check_routing(x_TH, topk_idx_TK, topk_weights_TK, dy_TH, weights_named, api)
    return (hidden, intermediate, num_experts, topk_idx_TK.shape[1], num_tokens)


def _check_w3_w2_match_w1(w1_EIH, w3_EIH, w2_EHI, api=API):
    """w3 [E, I, H] as w1, and w2 [E, H, I] with w1's E, I, H (the layer's and the quantize op's
    checks)."""
    num_experts, intermediate, hidden = w1_EIH.shape
    if w3_EIH.shape != w1_EIH.shape:
        _fail(f"w3 (up) must have the shape of w1 (gate) {tuple(w1_EIH.shape)}, "
              f"got {tuple(w3_EIH.shape)}", api)
    expected = (num_experts, hidden, intermediate)
    if tuple(w2_EHI.shape) != expected:
        _fail(f"w2 (down) must be [E, H, I] = {expected} to match w1 {tuple(w1_EIH.shape)}, "
              f"got {tuple(w2_EHI.shape)}", api)


def _check_weight_grads_w1w3(dw1_EIH, dw3_EIH, dw2_EHI, w1_EIH, w3_EIH, w2_EHI):
    """fusemoe.ops._check_weight_grads for dw1, dw3, dw2: the C weight_grad_dtype code."""
    return _weight_grad_dtype((("dw1", dw1_EIH, w1_EIH), ("dw3", dw3_EIH, w3_EIH),
                               ("dw2", dw2_EHI, w2_EHI)), API)


_FP8_MADE_BY = "fusemoe.separate.quantize_weights_fp8_w1w3(w1, w3, w2)"


def _check_fp8_buffer_w1w3(fp8_weights, dims, device, layer=None):
    """The FP8 weight buffer of a layer of dims (H, I, E, ...) on device: its size is the
    library's (layer) or, in the fake kernels, fusemoe.fp8's formula."""
    hidden, intermediate, num_experts = dims[:3]
    _check_fp8_buffer_bytes(fp8_weights, _check_fp8_dims(num_experts, hidden, intermediate, API),
                            device, layer, _FP8_MADE_BY, API)


def _layer_and_weights(dims, impl, swiglu_clamp, w1_EIH, w3_EIH, w2_EHI, fp8_weights,
                       fp8_weight_grads=False):
    """fusemoe.ops._layer_and_weights for w1, w3: the call's layer and the C args' weight
    pointers by name (w13 null, w1, w3, w2, fp8_weights), null bf16 weights on the FP8 buffer
    (their values are not read)."""
    layer = _capi.layer(*dims, impl, swiglu_clamp, "bf16" if fp8_weights is None else "fp8",
                        fp8_weight_grads)
    if fp8_weights is None:
        return layer, dict(w13=None, w1=w1_EIH.data_ptr(), w3=w3_EIH.data_ptr(),
                           w2=w2_EHI.data_ptr(), fp8_weights=None)
    _check_fp8_buffer_w1w3(fp8_weights, dims, w1_EIH.device, layer)
    return layer, dict(w13=None, w1=None, w3=None, w2=None, fp8_weights=fp8_weights.data_ptr())


def _launch_forward(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl, save_z,
                    swiglu_clamp, fp8_weights=None, fp8_weight_grads=False):
    """The forward ops' call (bf16, or the FP8 buffer when given). Returns (y, z)."""
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
    _check_cuda(x_TH, API)
    _check_save_z(save_z, impl)
    _check_swiglu_clamp(swiglu_clamp)
    layer, weights = _layer_and_weights(dims, impl, swiglu_clamp, w1_EIH, w3_EIH, w2_EHI,
                                        fp8_weights, fp8_weight_grads)
    return _call_forward(layer, dims, x_TH, topk_idx_TK, topk_weights_TK, save_z, weights)


def _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dw1_EIH,
                     dw3_EIH, dw2_EHI, accumulate, impl, saved_z_SF, swiglu_clamp,
                     fp8_weights=None, fp8_weight_grads=False):
    """The backward ops' call: dw1, dw3, dw2 written (accumulate False) or added into the given
    buffers. Returns (dx, d_topk_weights)."""
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH)
    _check_cuda(x_TH, API)
    # A frozen weight stands in for its gradient (None): the checks are those of a call with all.
    grad_dtype = _check_weight_grads_w1w3(
        *(w if g is None else g for g, w in ((dw1_EIH, w1_EIH), (dw3_EIH, w3_EIH), (dw2_EHI, w2_EHI))),
        w1_EIH, w3_EIH, w2_EHI)
    saved_z_SF = _check_saved_z(saved_z_SF, dims, x_TH, impl)
    _check_swiglu_clamp(swiglu_clamp)
    layer, weights = _layer_and_weights(dims, impl, swiglu_clamp, w1_EIH, w3_EIH, w2_EHI,
                                        fp8_weights, fp8_weight_grads)
    return _call_backward(layer, dims, dy_TH, x_TH, topk_idx_TK, topk_weights_TK, saved_z_SF,
                          grad_dtype, accumulate, weights,
                          dict(dw13=None, dw1=_pointer(dw1_EIH), dw3=_pointer(dw3_EIH),
                               dw2=_pointer(dw2_EHI)))


def _launch_backward_fresh(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                           impl, saved_z_SF, swiglu_clamp, gate_up_grad, down_grad,
                           fp8_weights=None, fp8_weight_grads=False):
    """The backward into fresh gradients of the weights' dtype: (dx, d_topk_weights, dw1, dw3,
    dw2); gate_up_grad / down_grad False: dw1 and dw3 / dw2 not computed, 0-element."""
    weights = (w1_EIH, w3_EIH, w2_EHI)
    grads = _fresh_weight_grads(weights, gate_up_grad, down_grad)
    dx_TH, d_topk_weights_TK = _launch_backward(
        dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, *grads, False, impl,
        saved_z_SF, swiglu_clamp, fp8_weights, fp8_weight_grads)
    return (dx_TH, d_topk_weights_TK, *_returned_weight_grads(grads, weights))


def _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl, save_z,
                  swiglu_clamp, fp8_weights=None):
    """The forward ops' fake kernels: the checks that need no device, then empty (y, z)."""
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
    _check_impl(impl)
    _check_save_z(save_z, impl)
    _check_swiglu_clamp(swiglu_clamp)
    if fp8_weights is not None:
        _check_fp8_buffer_w1w3(fp8_weights, dims, w1_EIH.device)
    return torch.empty_like(x_TH), _empty_saved_z(x_TH, dims, save_z)


def _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                   saved_z_SF, swiglu_clamp, weight_grads=None, fp8_weights=None,
                   gate_up_grad=True, down_grad=True):
    """The backward ops' fake kernels: (dx, d_topk_weights) and, unless weight_grads (dw1, dw3,
    dw2) are given as the _into ops take them, empty dw1, dw3, dw2 (0-element when frozen)."""
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH)
    if weight_grads is not None:
        _check_weight_grads_w1w3(*weight_grads, w1_EIH, w3_EIH, w2_EHI)
    _check_impl(impl)
    if fp8_weights is not None:
        _check_fp8_buffer_w1w3(fp8_weights, dims, w1_EIH.device)
    _check_saved_z(saved_z_SF, dims, x_TH, impl)
    _check_swiglu_clamp(swiglu_clamp)
    grads = (torch.empty_like(x_TH), torch.empty_like(topk_weights_TK))
    if weight_grads is None:
        weights = (w1_EIH, w3_EIH, w2_EHI)
        grads += _returned_weight_grads(_fresh_weight_grads(weights, gate_up_grad, down_grad),
                                        weights)
    return grads


# ----------------------------------------------------------------------------------- bf16 ops

@_op("moe_experts_w1w3_forward")
def moe_experts_w1w3_forward(x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
                             w1_EIH: Tensor, w3_EIH: Tensor, w2_EHI: Tensor, impl: str,
                             grad_in_place: bool = False, save_z: bool = False,
                             swiglu_clamp: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Returns (y, z): z is the saved pre-activations when save_z ("fused" only), else empty.
    grad_in_place is autograd's (see moe_experts_w1w3)."""
    return _launch_forward(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                           save_z, swiglu_clamp)


@torch.library.register_fake("fusemoe::moe_experts_w1w3_forward")
def _moe_experts_w1w3_forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                                   impl, grad_in_place=False, save_z=False, swiglu_clamp=None):
    return _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl, save_z,
                         swiglu_clamp)


@_op("moe_experts_w1w3_backward")
def moe_experts_w1w3_backward(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                              topk_weights_TK: Tensor, w1_EIH: Tensor, w3_EIH: Tensor,
                              w2_EHI: Tensor, impl: str, saved_z_SF: Optional[Tensor] = None,
                              swiglu_clamp: Optional[float] = None, gate_up_grad: bool = True,
                              down_grad: bool = True
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx [T, H] bf16, d_topk_weights [T, K] fp32, dw1, dw3 [E, I, H], dw2 [E, H, I]),
    the weight gradients in the weights' dtype, written apart (no concatenated buffer);
    gate_up_grad / down_grad as fusemoe::moe_experts_backward's."""
    return _launch_backward_fresh(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH,
                                  w2_EHI, impl, saved_z_SF, swiglu_clamp, gate_up_grad, down_grad)


@torch.library.register_fake("fusemoe::moe_experts_w1w3_backward")
def _moe_experts_w1w3_backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH,
                                    w2_EHI, impl, saved_z_SF=None, swiglu_clamp=None,
                                    gate_up_grad=True, down_grad=True):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, gate_up_grad=gate_up_grad,
                          down_grad=down_grad)


@_op("moe_experts_w1w3_backward_into", mutates_args=("dw1_EIH", "dw3_EIH", "dw2_EHI"))
def moe_experts_w1w3_backward_into(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                                   topk_weights_TK: Tensor, w1_EIH: Tensor, w3_EIH: Tensor,
                                   w2_EHI: Tensor, dw1_EIH: Tensor, dw3_EIH: Tensor,
                                   dw2_EHI: Tensor, accumulate: bool, impl: str,
                                   saved_z_SF: Optional[Tensor] = None,
                                   swiglu_clamp: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """fusemoe::moe_experts_backward_into for w1, w3: the weight gradients written
    (accumulate=False) or added (True) into dw1, dw3, dw2 (bf16 or fp32, one dtype, the shapes of
    w1, w3, w2); returns (dx, d_topk_weights)."""
    return _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                            dw1_EIH, dw3_EIH, dw2_EHI, accumulate, impl, saved_z_SF, swiglu_clamp)


@torch.library.register_fake("fusemoe::moe_experts_w1w3_backward_into")
def _moe_experts_w1w3_backward_into_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH,
                                         w3_EIH, w2_EHI, dw1_EIH, dw3_EIH, dw2_EHI, accumulate,
                                         impl, saved_z_SF=None, swiglu_clamp=None):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, weight_grads=(dw1_EIH, dw3_EIH, dw2_EHI))


def _setup_context(ctx, inputs, output):
    _save_for_backward(ctx, inputs[:6], *inputs[6:], output[1], num_weights=3)


def _backward(ctx, dy_TH, _dz_unused):
    return _gradients(ctx, dy_TH, moe_experts_w1w3_backward, moe_experts_w1w3_backward_into)


_forward_call = _register_autograd("moe_experts_w1w3_forward", _backward, _setup_context,
                                   num_weights=3)


# ------------------------------------------------------------------------------------ FP8 ops

@_op("quantize_weights_fp8_w1w3")
def quantize_weights_fp8_w1w3(w1_EIH: Tensor, w3_EIH: Tensor, w2_EHI: Tensor) -> Tensor:
    """The FP8 weight buffer of bf16 w1, w3 [E, I, H] and w2 [E, H, I]: the bytes
    fusemoe.fp8.quantize_weights_fp8 writes for w13 = [w1; w3] (the library's overload)."""
    num_experts, hidden, intermediate = _check_quantize_inputs(w1_EIH, w3_EIH, w2_EHI)
    _check_cuda(w1_EIH, API)
    # The buffer depends on the weights' shape only (top_k, max_tokens: any valid values).
    layer = _capi.layer(hidden, intermediate, num_experts, 1, 0, "fused", None, "fp8")
    num_bytes = _capi.fp8_weights_bytes(layer)
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device=w1_EIH.device)
    with torch.cuda.device(w1_EIH.device):
        _capi.quantize_weights_fp8(layer, None, w2_EHI.data_ptr(), buffer.data_ptr(), num_bytes,
                                   torch.cuda.current_stream(w1_EIH.device).cuda_stream,
                                   w1=w1_EIH.data_ptr(), w3=w3_EIH.data_ptr())
    return buffer


def _check_quantize_inputs(w1_EIH, w3_EIH, w2_EHI):
    """The weights of quantize_weights_fp8_w1w3 (bf16, contiguous, matching, FP8 block
    multiples); returns (E, H, I)."""
    for name, weight in (("w1 (gate)", w1_EIH), ("w3 (up)", w3_EIH), ("w2 (down)", w2_EHI)):
        _check_tensor(weight, name, 3, torch.bfloat16, api=API)
    _check_w3_w2_match_w1(w1_EIH, w3_EIH, w2_EHI, API)
    num_experts, intermediate, hidden = w1_EIH.shape
    return _check_fp8_dims(num_experts, hidden, intermediate, API)


@torch.library.register_fake("fusemoe::quantize_weights_fp8_w1w3")
def _quantize_weights_fp8_w1w3_fake(w1_EIH, w3_EIH, w2_EHI):
    return w1_EIH.new_empty(fp8_weights_bytes(*_check_quantize_inputs(w1_EIH, w3_EIH, w2_EHI)),
                            dtype=torch.uint8)


def cached_fp8_weights_w1w3(w1_EIH, w3_EIH, w2_EHI, cache=None, sources=None):
    """fusemoe.fp8.cached_fp8_weights for w1, w3, w2: the buffer of quantize_weights_fp8_w1w3,
    kept by cache (a fusemoe.fp8.Fp8WeightCache) or on w1 and rebuilt when any weight (or
    sources, the tensors whose versions decide) changes, on every call when traced."""
    return cached_buffer(quantize_weights_fp8_w1w3, (w1_EIH, w3_EIH, w2_EHI), cache, sources,
                         "_fusemoe_fp8_cache_w1w3")


@_op("moe_experts_w1w3_fp8_forward")
def moe_experts_w1w3_fp8_forward(x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
                                 w1_EIH: Tensor, w3_EIH: Tensor, w2_EHI: Tensor,
                                 fp8_weights: Tensor, impl: str, grad_in_place: bool = False,
                                 save_z: bool = False, swiglu_clamp: Optional[float] = None,
                                 fp8_weight_grads: bool = False) -> tuple[Tensor, Tensor]:
    """moe_experts_w1w3_forward on the FP8 weights (w1, w3, w2 give the shapes and receive the
    gradients; their values are not read: the library gets null pointers for them);
    fp8_weight_grads as fusemoe::moe_experts_fp8_forward's."""
    return _launch_forward(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                           save_z, swiglu_clamp, fp8_weights, fp8_weight_grads)


@torch.library.register_fake("fusemoe::moe_experts_w1w3_fp8_forward")
def _moe_experts_w1w3_fp8_forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                                       fp8_weights, impl, grad_in_place=False, save_z=False,
                                       swiglu_clamp=None, fp8_weight_grads=False):
    return _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl, save_z,
                         swiglu_clamp, fp8_weights)


@_op("moe_experts_w1w3_fp8_backward")
def moe_experts_w1w3_fp8_backward(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                                  topk_weights_TK: Tensor, w1_EIH: Tensor, w3_EIH: Tensor,
                                  w2_EHI: Tensor, fp8_weights: Tensor, impl: str,
                                  saved_z_SF: Optional[Tensor] = None,
                                  swiglu_clamp: Optional[float] = None, gate_up_grad: bool = True,
                                  down_grad: bool = True, fp8_weight_grads: bool = False
                                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """moe_experts_w1w3_backward at FP8 (fp8_weight_grads: the weight gradients too)."""
    return _launch_backward_fresh(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH,
                                  w2_EHI, impl, saved_z_SF, swiglu_clamp, gate_up_grad, down_grad,
                                  fp8_weights, fp8_weight_grads)


@torch.library.register_fake("fusemoe::moe_experts_w1w3_fp8_backward")
def _moe_experts_w1w3_fp8_backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH,
                                        w3_EIH, w2_EHI, fp8_weights, impl, saved_z_SF=None,
                                        swiglu_clamp=None, gate_up_grad=True, down_grad=True,
                                        fp8_weight_grads=False):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, fp8_weights=fp8_weights,
                          gate_up_grad=gate_up_grad, down_grad=down_grad)


@_op("moe_experts_w1w3_fp8_backward_into", mutates_args=("dw1_EIH", "dw3_EIH", "dw2_EHI"))
def moe_experts_w1w3_fp8_backward_into(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                                       topk_weights_TK: Tensor, w1_EIH: Tensor, w3_EIH: Tensor,
                                       w2_EHI: Tensor, fp8_weights: Tensor, dw1_EIH: Tensor,
                                       dw3_EIH: Tensor, dw2_EHI: Tensor, accumulate: bool,
                                       impl: str, saved_z_SF: Optional[Tensor] = None,
                                       swiglu_clamp: Optional[float] = None,
                                       fp8_weight_grads: bool = False) -> tuple[Tensor, Tensor]:
    """moe_experts_w1w3_backward_into at FP8."""
    return _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                            dw1_EIH, dw3_EIH, dw2_EHI, accumulate, impl, saved_z_SF, swiglu_clamp,
                            fp8_weights, fp8_weight_grads)


@torch.library.register_fake("fusemoe::moe_experts_w1w3_fp8_backward_into")
def _moe_experts_w1w3_fp8_backward_into_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH,
                                             w3_EIH, w2_EHI, fp8_weights, dw1_EIH, dw3_EIH,
                                             dw2_EHI, accumulate, impl, saved_z_SF=None,
                                             swiglu_clamp=None, fp8_weight_grads=False):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, weight_grads=(dw1_EIH, dw3_EIH, dw2_EHI),
                          fp8_weights=fp8_weights)


def _fp8_setup_context(ctx, inputs, output):
    _save_for_backward(ctx, inputs[:7], *inputs[7:11], output[1], num_weights=3,
                       options=inputs[11:])


def _fp8_backward(ctx, dy_TH, _dz_unused):
    return _gradients(ctx, dy_TH, moe_experts_w1w3_fp8_backward,
                      moe_experts_w1w3_fp8_backward_into)


_fp8_forward_call = _register_autograd("moe_experts_w1w3_fp8_forward", _fp8_backward,
                                       _fp8_setup_context, num_weights=3)


def moe_experts_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                     impl=DEFAULT_IMPL, recompute_z=False, swiglu_clamp=None, *,
                     grad_in_place=False, precision="bf16", fp8_weights=None,
                     fp8_weight_grads=False):
    """fusemoe.moe_experts on separate gate and up weights w1, w3 [E, I, H] (torchtitan's
    GroupedExperts.w1 / w3) and w2 [E, H, I]: strict inputs (bf16, contiguous, one CUDA device),
    impl "fused" (the library refuses the others for this form). recompute_z, swiglu_clamp,
    grad_in_place (eager, leaf w1, w3, w2: the kernels write or add dw1, dw3, dw2 into their
    .grad), precision ("bf16" or "fp8") and fp8_weight_grads as in fusemoe.moe_experts.
    fp8_weights: the buffer of quantize_weights_fp8_w1w3(w1, w3, w2), or None for one cached on w1
    per weight version."""
    _check_swiglu_clamp(swiglu_clamp)
    _check_fp8_weight_grads(fp8_weight_grads, precision, API)
    save_z = _wants_saved_z(impl, recompute_z, x_TH, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
    if precision == "bf16":
        return _call(_forward_call, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                     impl, grad_in_place, save_z, swiglu_clamp)[0]
    if precision != "fp8":
        _fail(f"precision must be \"bf16\" or \"fp8\", got {precision!r}", API)
    if impl != "fused":
        _fail(f"precision=\"fp8\" needs impl=\"fused\" (got {impl!r})", API)
    if fp8_weights is None:
        fp8_weights = cached_fp8_weights_w1w3(w1_EIH, w3_EIH, w2_EHI)
    return _call(_fp8_forward_call, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                 fp8_weights, impl, grad_in_place, save_z, swiglu_clamp, fp8_weight_grads)[0]
