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

Like fusemoe.ops' ops, each has two definitions: the native binding's C++ kernel
(src/torch_binding/ops.cpp, the same schema and messages) when it is loaded, else the Python
function below over ctypes; the fake kernels and the autograd formula are registered on the name.
Not yet here: grad_in_place, precision="fp8" (the library takes w1/w3 for quantize_weights_fp8;
fusemoe.fp8's cache does not).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _capi
from .ops import (DEFAULT_IMPL, _call, _check_cuda, _check_impl, _check_routing, _check_save_z,
                  _check_saved_z, _check_swiglu_clamp, _check_tensor, _empty_saved_z,
                  _expert_id_report, _fail, _op, _register_autograd, _workspace)

API = "fusemoe.moe_experts_w1w3"


def _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH=None,
                       api=API):
    """fusemoe.ops._check_inputs for w1, w3 [E, I, H]: returns the dims (H, I, E, K, T)."""
    _check_tensor(x_TH, "x (hidden_states)", 2, torch.bfloat16, api=api)
    _check_tensor(topk_idx_TK, "topk_idx", 2, torch.int32, api=api)
    _check_tensor(topk_weights_TK, "topk_weights", 2, torch.float32, api=api)
    _check_tensor(w1_EIH, "w1 (gate)", 3, torch.bfloat16, api=api)
    _check_tensor(w3_EIH, "w3 (up)", 3, torch.bfloat16, api=api)
    _check_tensor(w2_EHI, "w2 (down)", 3, torch.bfloat16, api=api)
    num_tokens, hidden = x_TH.shape
    num_experts, intermediate, w1_hidden = w1_EIH.shape
    if w1_hidden != hidden:
        _fail(f"w1 (gate) must be [E, I, H] with H = x.shape[1] = {hidden}, "
              f"got {tuple(w1_EIH.shape)}", api)
    if w3_EIH.shape != w1_EIH.shape:
        _fail(f"w3 (up) must have the shape of w1 (gate) {tuple(w1_EIH.shape)}, "
              f"got {tuple(w3_EIH.shape)}", api)
    expected = (num_experts, hidden, intermediate)
    if tuple(w2_EHI.shape) != expected:
        _fail(f"w2 (down) must be [E, H, I] = {expected} to match w1 {tuple(w1_EIH.shape)}, "
              f"got {tuple(w2_EHI.shape)}", api)
    _check_routing(x_TH, topk_idx_TK, topk_weights_TK, dy_TH,
                   [("w1 (gate)", w1_EIH), ("w3 (up)", w3_EIH), ("w2 (down)", w2_EHI)], api)
    return (hidden, intermediate, num_experts, topk_idx_TK.shape[1], num_tokens)


@_op("moe_experts_w1w3_forward")
def moe_experts_w1w3_forward(x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
                             w1_EIH: Tensor, w3_EIH: Tensor, w2_EHI: Tensor, impl: str,
                             save_z: bool = False,
                             swiglu_clamp: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Returns (y, z): z is the saved pre-activations when save_z ("fused" only), else empty."""
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
    _check_cuda(x_TH, API)
    _check_save_z(save_z, impl)
    _check_swiglu_clamp(swiglu_clamp)
    layer = _capi.layer(*dims, impl, swiglu_clamp, "bf16")
    y_TH = torch.empty_like(x_TH)
    z_SF = _empty_saved_z(x_TH, dims, save_z)
    with torch.cuda.device(x_TH.device):
        report = _expert_id_report(x_TH.device, dims[2], dims[3])
        workspace, num_bytes = _workspace(layer, x_TH.device, "forward")
        _capi.forward(layer, x_TH.data_ptr(), topk_idx_TK.data_ptr(), topk_weights_TK.data_ptr(),
                      None, w2_EHI.data_ptr(), y_TH.data_ptr(), dims[-1], workspace.data_ptr(),
                      num_bytes, report, z_SF.data_ptr() if save_z and z_SF.numel() else None,
                      torch.cuda.current_stream(x_TH.device).cuda_stream,
                      caller_checked_pointers=True, w1=w1_EIH.data_ptr(), w3=w3_EIH.data_ptr())
    return y_TH, z_SF


@torch.library.register_fake("fusemoe::moe_experts_w1w3_forward")
def _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl, save_z=False,
                  swiglu_clamp=None):
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
    _check_impl(impl)
    _check_save_z(save_z, impl)
    _check_swiglu_clamp(swiglu_clamp)
    return torch.empty_like(x_TH), _empty_saved_z(x_TH, dims, save_z)


@_op("moe_experts_w1w3_backward")
def moe_experts_w1w3_backward(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                              topk_weights_TK: Tensor, w1_EIH: Tensor, w3_EIH: Tensor,
                              w2_EHI: Tensor, impl: str, saved_z_SF: Optional[Tensor] = None,
                              swiglu_clamp: Optional[float] = None
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx [T, H] bf16, d_topk_weights [T, K] fp32, dw1, dw3 [E, I, H], dw2 [E, H, I]),
    the weight gradients in the weights' dtype, written apart (no concatenated buffer)."""
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH)
    _check_cuda(x_TH, API)
    saved_z_SF = _check_saved_z(saved_z_SF, dims, x_TH, impl)
    _check_swiglu_clamp(swiglu_clamp)
    layer = _capi.layer(*dims, impl, swiglu_clamp, "bf16")
    dx_TH = torch.empty_like(x_TH)
    d_topk_weights_TK = torch.empty_like(topk_weights_TK)
    dw1_EIH, dw3_EIH, dw2_EHI = (torch.empty_like(w) for w in (w1_EIH, w3_EIH, w2_EHI))
    with torch.cuda.device(x_TH.device):
        report = _expert_id_report(x_TH.device, dims[2], dims[3])
        use = "backward" if saved_z_SF is None else "backward_saved_z"
        workspace, num_bytes = _workspace(layer, x_TH.device, use)
        _capi.backward(layer, x_TH.data_ptr(), topk_idx_TK.data_ptr(), topk_weights_TK.data_ptr(),
                       None, w2_EHI.data_ptr(), dy_TH.data_ptr(), dx_TH.data_ptr(),
                       d_topk_weights_TK.data_ptr(), None, dw2_EHI.data_ptr(),
                       _capi.WEIGHT_GRAD_BFLOAT16, False, dims[-1], workspace.data_ptr(),
                       num_bytes, report,
                       saved_z_SF.data_ptr() if saved_z_SF is not None else None,
                       torch.cuda.current_stream(x_TH.device).cuda_stream,
                       caller_checked_pointers=True, w1=w1_EIH.data_ptr(), w3=w3_EIH.data_ptr(),
                       dw1=dw1_EIH.data_ptr(), dw3=dw3_EIH.data_ptr())
    return dx_TH, d_topk_weights_TK, dw1_EIH, dw3_EIH, dw2_EHI


@torch.library.register_fake("fusemoe::moe_experts_w1w3_backward")
def _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                   saved_z_SF=None, swiglu_clamp=None):
    dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH)
    _check_impl(impl)
    _check_saved_z(saved_z_SF, dims, x_TH, impl)
    _check_swiglu_clamp(swiglu_clamp)
    return (torch.empty_like(x_TH), torch.empty_like(topk_weights_TK), torch.empty_like(w1_EIH),
            torch.empty_like(w3_EIH), torch.empty_like(w2_EHI))


def _setup_context(ctx, inputs, output):
    x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl, *rest = inputs
    swiglu_clamp = rest[1] if len(rest) > 1 else None
    z_SF = output[1]
    ctx.mark_non_differentiable(z_SF)
    ctx.set_materialize_grads(False)  # no zero gradient of z per backward (fusemoe.ops says why)
    ctx.save_for_backward(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, z_SF)
    ctx.impl = impl
    ctx.swiglu_clamp = swiglu_clamp


def _backward(ctx, dy_TH, _dz_unused):
    x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, z_SF = ctx.saved_tensors
    saved_z_SF = z_SF if z_SF.numel() else None
    dx_TH, d_topk_weights_TK, dw1_EIH, dw3_EIH, dw2_EHI = _call(
        moe_experts_w1w3_backward, dy_TH.contiguous(), x_TH, topk_idx_TK, topk_weights_TK, w1_EIH,
        w3_EIH, w2_EHI, ctx.impl, saved_z_SF, ctx.swiglu_clamp)
    return dx_TH, None, d_topk_weights_TK, dw1_EIH, dw3_EIH, dw2_EHI, None, None, None


_forward_call = _register_autograd("moe_experts_w1w3_forward", _backward, _setup_context)


def moe_experts_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                     impl=DEFAULT_IMPL, recompute_z=False, swiglu_clamp=None):
    """fusemoe.moe_experts on separate gate and up weights w1, w3 [E, I, H] (torchtitan's
    GroupedExperts.w1 / w3) and w2 [E, H, I]: strict inputs (bf16, contiguous, one CUDA device),
    impl "fused" (the library refuses the others for this form). recompute_z and swiglu_clamp as
    in fusemoe.moe_experts."""
    _check_swiglu_clamp(swiglu_clamp)
    save_z = (impl == "fused" and not recompute_z and torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad
        for t in (x_TH, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)))
    return _call(_forward_call, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                 save_z, swiglu_clamp)[0]
