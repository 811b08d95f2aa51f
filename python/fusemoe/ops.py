"""fusemoe's PyTorch ops over the C library: fusemoe::moe_experts_forward,
fusemoe::moe_experts_backward and fusemoe::moe_experts_backward_into, their fake kernels and the
autograd formula that links them.

Two definitions of the same ops, one per process: the native binding's (fusemoe._native: C++
kernels registered through PyTorch's stable ABI, which check the tensors and call the C library
with no Python per call) when it is built and loads, else the Python functions below as
torch.library custom ops over ctypes (same schemas, same checks and messages). Either way the
fake kernels and the autograd formula below are registered on them by name.
fusemoe.native_binding_status() says which is in use.

    y_t = sum_j w[t,j] * W2_e (silu(g) * u),  g = Wg_e x_t, u = Wu_e x_t,  e = topk_idx[t,j]
    (-1: masked); with swiglu_clamp = c: g <- min(g, c), u <- clamp(u, -c, c) first.

Shape legend: T tokens, H hidden, I expert intermediate, F = 2I (gate rows, then up rows),
E experts, K top-k. x, y, dy, dx bf16 [T, H]; topk_idx int32 [T, K]; topk_weights fp32 [T, K];
w13 bf16 [E, F, H] (Hugging Face gate_up_proj); w2 bf16 [E, H, I] (down_proj).
The forward saves its inputs and, for impl "fused" with gradients required, the pre-activations
z (2I bf16 per routed row; recompute_z=True recomputes them in the backward instead). The
backward returns fresh gradients (weights in their own dtype, d_topk_weights fp32) and autograd
accumulates them, so gradient accumulation and activation checkpointing need nothing special
(grad_in_place is the opt-in exception, see fusemoe.moe_experts). Calls run on
torch.cuda.current_stream(); each call's workspace comes from torch's caching allocator (when it
cannot be had, FusemoeOutOfMemoryError, a FusemoeError and torch.OutOfMemoryError, names the bytes
and nothing has been launched).

Expert ids outside [-1, E) never index memory (the kernels mask them) and are reported without
blocking the stream: every call passes the library a small report in pinned host memory (one
per device and layer shape) that the first call with bad ids fills from the GPU. The next
fusemoe call on that device (forward or backward), or fusemoe.check_expert_ids(), raises
FusemoeError naming the token, slot and value; the report is then cleared. So a bad id surfaces
one call late at most, never as a silent wrong result, and the ops never synchronise for it
("unfused" syncs anyway: it reads per-expert counts on the host).
"""
import sys
import threading
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import _capi, _native
from ._checks import API, _check_fp8_weights, _check_tensor, _fail

DEFAULT_IMPL = "fused"  # sm_90a kernels; "unfused" (cuBLAS grouped GEMMs) is the baseline

_reports_lock = threading.Lock()
# (device index, num_experts, top_k) -> pinned int32 [3] report. One per layer shape, so a
# report is always decoded with the E and K of the calls that can have written it.
_reports = {}


def _expert_id_report(device, num_experts, top_k, raise_pending=True):
    """Raises any bad id reported on this device so far (unless not raise_pending: the
    expert-parallel ops, whose peers would wait for a call this rank then never makes); returns
    the address of the report for a call of this layer shape."""
    key = (device.index, num_experts, top_k)
    with _reports_lock:
        for (index, experts, k), report in _reports.items():
            if raise_pending and index == device.index:
                _raise_if_reported(report, experts, k)
        report = _reports.get(key)
        if report is None:
            report = torch.zeros(_capi.EXPERT_ID_REPORT_INTS, dtype=torch.int32, pin_memory=True)
            _reports[key] = report
        return report.data_ptr()


def _raise_if_reported(report, num_experts, top_k):
    if int(report[0]) == 0:  # a host read of pinned memory: no sync
        return
    try:
        _capi.check_expert_id_report(report.data_ptr(), num_experts, top_k)
    except _capi.FusemoeError as e:
        report.zero_()  # reported once; later calls start clean
        raise _capi.FusemoeError(f"{e} (found by an earlier fusemoe call on this device and "
                                 "reported asynchronously; its outputs are unspecified)") from None


def check_expert_ids(synchronize=True):
    """Raises FusemoeError if an earlier fusemoe call on any device had expert ids outside
    [-1, E). synchronize=True first waits for the devices' queued work, so every call made so far
    is covered; False checks only what has already run (no wait). Covers the native binding's
    reports (fusemoe._native) and those of the ctypes path."""
    with _reports_lock:
        if synchronize:
            for index in sorted({key[0] for key in _reports} | set(_native.report_devices())):
                torch.cuda.synchronize(index)
        for (_, num_experts, top_k), report in _reports.items():
            _raise_if_reported(report, num_experts, top_k)
        message = _native.take_reported_error()
        if message is not None:
            raise _capi.FusemoeError(message)


def _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH=None, api=API):
    """Checks dtypes, ranks, contiguity, shapes and devices; returns the layer's dims
    (H, I, E, K, T) (the C layer takes max_tokens = T: the workspace is sized per call)."""
    _check_dtypes(x_TH, topk_idx_TK, topk_weights_TK,
                  [("w13 (gate_up_proj)", w13_EFH), ("w2 (down_proj)", w2_EHI)], api)
    num_tokens, hidden = x_TH.shape
    num_experts, two_intermediate, w13_hidden = w13_EFH.shape
    intermediate = two_intermediate // 2
    if two_intermediate % 2 != 0 or w13_hidden != hidden:
        _fail(f"w13 (gate_up_proj) must be [E, 2I, H] with H = x.shape[1] = {hidden}, "
              f"got {tuple(w13_EFH.shape)}", api)
    _check_w2_matches_w13(w13_EFH, w2_EHI, api)
    _check_routing(x_TH, topk_idx_TK, topk_weights_TK, dy_TH,
                   [("w13 (gate_up_proj)", w13_EFH), ("w2 (down_proj)", w2_EHI)], api)
    return (hidden, intermediate, num_experts, topk_idx_TK.shape[1], num_tokens)


def _check_dtypes(x_TH, topk_idx_TK, topk_weights_TK, weights_named, api=API):
    """Dtype, rank and contiguity of x, topk_idx, topk_weights and the bf16 weights
    (weights_named: (name, weight) pairs, rank 3), in that order."""
    _check_tensor(x_TH, "x (hidden_states)", 2, torch.bfloat16, api=api)
    _check_tensor(topk_idx_TK, "topk_idx", 2, torch.int32, api=api)
    _check_tensor(topk_weights_TK, "topk_weights", 2, torch.float32, api=api)
    for name, weight in weights_named:
        _check_tensor(weight, name, 3, torch.bfloat16, api=api)


def _check_routing(x_TH, topk_idx_TK, topk_weights_TK, dy_TH, weights_named, api=API):
    """The shapes of topk_idx, topk_weights and dy against x, and every tensor (weights_named:
    (name, weight) pairs) on x's device."""
    num_tokens = x_TH.shape[0]
    if topk_idx_TK.shape[0] != num_tokens:
        _fail(f"topk_idx must be [T, K] with T = x.shape[0] = {num_tokens}, "
              f"got {tuple(topk_idx_TK.shape)}", api)
    if topk_weights_TK.shape != topk_idx_TK.shape:
        _fail(f"topk_weights must have the shape of topk_idx {tuple(topk_idx_TK.shape)}, "
              f"got {tuple(topk_weights_TK.shape)}", api)
    named = [("topk_idx", topk_idx_TK), ("topk_weights", topk_weights_TK), *weights_named]
    if dy_TH is not None:
        _check_tensor(dy_TH, "dy (grad of the output)", 2, torch.bfloat16, api=api)
        if dy_TH.shape != x_TH.shape:
            _fail(f"dy must have the shape of x {tuple(x_TH.shape)}, got {tuple(dy_TH.shape)}",
                  api)
        named.append(("dy", dy_TH))
    for name, t in named:
        if t.device != x_TH.device:
            _fail(f"{name} is on {t.device} but x is on {x_TH.device}: all tensors must be on "
                  "one CUDA device", api)


def _check_w2_matches_w13(w13_EFH, w2_EHI, api=API):
    num_experts, two_intermediate, hidden = w13_EFH.shape
    expected = (num_experts, hidden, two_intermediate // 2)
    if tuple(w2_EHI.shape) != expected:
        _fail(f"w2 (down_proj) must be [E, H, I] = {expected} to match w13 "
              f"{tuple(w13_EFH.shape)}, got {tuple(w2_EHI.shape)}", api)


def _check_cuda(x_TH, api=API):
    if x_TH.device.type != "cuda":
        _fail(f"tensors must be on a CUDA device, got {x_TH.device}", api)


def _check_impl(impl):
    """Unknown names fail here, also while tracing (fake tensors), when the library is present."""
    if not isinstance(impl, str):
        _fail(f"impl must be a string such as \"unfused\", got {impl!r}")
    if _capi.is_available():
        _capi.impl_code(impl)


def _check_swiglu_clamp(swiglu_clamp):
    """Its type only (a bool is no number here, as in fusemoe.hf): the library checks the value
    (finite, > 0) when a call uses it."""
    if swiglu_clamp is not None and (not isinstance(swiglu_clamp, (int, float))
                                     or isinstance(swiglu_clamp, bool)):
        _fail(f"swiglu_clamp must be None or a number, got {swiglu_clamp!r}")


class FusemoeOutOfMemoryError(_capi.FusemoeError, torch.OutOfMemoryError):
    """A call's workspace could not be allocated. Also a torch.OutOfMemoryError, so code that
    handles PyTorch's out-of-memory errors (e.g. by shrinking the batch) still does."""


_NATIVE_ERROR_CLASSES = {1: _capi.FusemoeError, 2: FusemoeOutOfMemoryError, 3: ValueError}
_native.init_autograd(_NATIVE_ERROR_CLASSES)


def _call(op, *args):
    """op(*args) for fusemoe's entry points (moe_experts, the autograd formula, the FP8 weight
    cache). A native op's error may reach Python as RuntimeError whatever it was (fusemoe._native):
    the binding's own (its last error on this thread) is re-raised as the ValueError,
    FusemoeError or FusemoeOutOfMemoryError that the ctypes path raises. A direct
    torch.ops.fusemoe.* call on the native path sees what PyTorch raised."""
    try:
        return op(*args)
    except RuntimeError as e:
        if not _native.LOADED or isinstance(e, _capi.FusemoeError):
            raise
        kind, message = _native.last_error()
        if kind not in _NATIVE_ERROR_CLASSES or message != str(e):
            raise
        raise _NATIVE_ERROR_CLASSES[kind](message) from None


_CTYPES_OPS = {}  # name -> (Python definition, mutates_args): what the ctypes path registers
_AUTOGRAD_LIBRARY = torch.library.Library("fusemoe", "FRAGMENT")  # the native ops' autograd


def _op(name, mutates_args=()):
    """Decorator of an op's Python definition (its schema and the ctypes launch): returns
    torch.ops.fusemoe.<name>, the native binding's op when it is loaded, else the definition
    registered as the custom op fusemoe::<name>. The fake kernel and autograd are registered on
    the name by the caller, for both."""
    def define(fn):
        _CTYPES_OPS[name] = (fn, mutates_args)
        if _native.LOADED:
            return getattr(torch.ops.fusemoe, name)
        return torch.library.custom_op(f"fusemoe::{name}", mutates_args=mutates_args)(fn)
    return define


def _workspace(layer, device, use):
    """A workspace for one call of kind `use` (_capi.WORKSPACE_USES) of a _capi.Layer: each call
    gets only what it needs (a backward given saved z needs no room for z). When torch cannot
    allocate it, nothing has been launched: FusemoeOutOfMemoryError names the bytes."""
    num_bytes = layer.workspace_bytes(use)
    try:
        # The caching allocator returns 512-byte aligned blocks (the library needs 256).
        return torch.empty(max(num_bytes, 1), dtype=torch.uint8, device=device), num_bytes
    except torch.OutOfMemoryError as e:
        torch_says = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
        raise FusemoeOutOfMemoryError(
            f"fusemoe: cannot allocate the {use} workspace of {num_bytes} bytes "
            f"({num_bytes / 2**30:.2f} GiB) on {device} for H={layer.hidden}, "
            f"I={layer.intermediate}, E={layer.num_experts}, K={layer.top_k}, "
            f"T={layer.max_tokens}; nothing was launched. PyTorch: {torch_says}") from e


def _empty_saved_z(x_TH, dims, save_z):
    """The forward's saved pre-activations z [T*K, 2I] bf16 (expert-sorted rows, an opaque
    buffer for the backward), or an empty tensor when z is not saved."""
    hidden, intermediate, _, top_k, num_tokens = dims
    shape = (num_tokens * top_k, 2 * intermediate) if save_z else (0,)
    return x_TH.new_empty(shape)


@_op("moe_experts_forward")
def moe_experts_forward(x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
                        w13_EFH: Tensor, w2_EHI: Tensor, impl: str,
                        grad_in_place: bool = False, save_z: bool = False,
                        swiglu_clamp: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Returns (y, z): z is the saved pre-activations when save_z ("fused" only), else empty.
    grad_in_place, save_z and swiglu_clamp: see fusemoe.moe_experts."""
    return _launch_forward(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, save_z,
                           swiglu_clamp)


def _layer_and_weights(dims, impl, swiglu_clamp, w13_EFH, w2_EHI, fp8_weights,
                       fp8_weight_grads=False):
    """The call's layer (precision "fp8" when the FP8 buffer is given, which is then checked;
    fp8_weight_grads: the FP8 ops' option) and its weight pointers by the C args' names (w13, w2,
    fp8_weights): a call on the FP8 buffer gets null bf16 weights (their values are not read)."""
    layer = _capi.layer(*dims, impl, swiglu_clamp, "bf16" if fp8_weights is None else "fp8",
                        fp8_weight_grads)
    if fp8_weights is None:
        return layer, dict(w13=w13_EFH.data_ptr(), w2=w2_EHI.data_ptr(), fp8_weights=None)
    _check_fp8_weights(fp8_weights, w13_EFH, w2_EHI, layer)
    return layer, dict(w13=None, w2=None, fp8_weights=fp8_weights.data_ptr())


def _call_forward(layer, dims, x_TH, topk_idx_TK, topk_weights_TK, save_z, weights):
    """A forward op's C ABI call once its inputs are checked, for either weight form (weights:
    the C args' weight pointers by name, _layer_and_weights'). Returns (y, z)."""
    y_TH = torch.empty_like(x_TH)
    z_SF = _empty_saved_z(x_TH, dims, save_z)
    with torch.cuda.device(x_TH.device):
        report = _expert_id_report(x_TH.device, dims[2], dims[3])
        workspace, num_bytes = _workspace(layer, x_TH.device, "forward")
        # Every tensor is on x's CUDA device (checked above, or allocated there) and the report is
        # mapped pinned memory: the library need not query each pointer (caller_checked_pointers).
        _capi.forward(layer, x_TH.data_ptr(), topk_idx_TK.data_ptr(), topk_weights_TK.data_ptr(),
                      y=y_TH.data_ptr(), num_tokens=dims[-1], workspace=workspace.data_ptr(),
                      workspace_bytes_=num_bytes, expert_id_report=report,
                      saved_z=z_SF.data_ptr() if save_z and z_SF.numel() else None,
                      stream=torch.cuda.current_stream(x_TH.device).cuda_stream,
                      caller_checked_pointers=True, **weights)
    return y_TH, z_SF


def _call_backward(layer, dims, dy_TH, x_TH, topk_idx_TK, topk_weights_TK, saved_z_SF, grad_dtype,
                   accumulate, weights, weight_grads):
    """A backward op's C ABI call once its inputs are checked, for either weight form (weights
    as _call_forward's; weight_grads: the gradients' pointers by the C args' names, dw13 or dw1
    and dw3, and dw2). Returns (dx, d_topk_weights)."""
    dx_TH = torch.empty_like(x_TH)
    d_topk_weights_TK = torch.empty_like(topk_weights_TK)
    with torch.cuda.device(x_TH.device):
        report = _expert_id_report(x_TH.device, dims[2], dims[3])
        use = "backward" if saved_z_SF is None else "backward_saved_z"
        workspace, num_bytes = _workspace(layer, x_TH.device, use)
        _capi.backward(layer, x_TH.data_ptr(), topk_idx_TK.data_ptr(), topk_weights_TK.data_ptr(),
                       dy=dy_TH.data_ptr(), dx=dx_TH.data_ptr(),
                       d_topk_weights=d_topk_weights_TK.data_ptr(), weight_grad_dtype=grad_dtype,
                       accumulate=accumulate, num_tokens=dims[-1], workspace=workspace.data_ptr(),
                       workspace_bytes_=num_bytes, expert_id_report=report,
                       saved_z=saved_z_SF.data_ptr() if saved_z_SF is not None else None,
                       stream=torch.cuda.current_stream(x_TH.device).cuda_stream,
                       caller_checked_pointers=True, **weights, **weight_grads)
    return dx_TH, d_topk_weights_TK


def _launch_forward(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, save_z,
                    swiglu_clamp, fp8_weights=None, fp8_weight_grads=False):
    """The forward ops' call: on the bf16 weights, or on the FP8 weight buffer when given (a
    layer of precision "fp8"; fp8_weight_grads, which the forward does not use, is checked)."""
    dims = _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI)
    _check_cuda(x_TH)
    _check_save_z(save_z, impl)
    _check_swiglu_clamp(swiglu_clamp)
    layer, weights = _layer_and_weights(dims, impl, swiglu_clamp, w13_EFH, w2_EHI, fp8_weights,
                                        fp8_weight_grads)
    return _call_forward(layer, dims, x_TH, topk_idx_TK, topk_weights_TK, save_z, weights)


def _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, save_z,
                  swiglu_clamp, fp8_weights=None):
    """The forward ops' fake kernels: the launch's checks that need no device, then empty outputs
    (y, z); fp8_weights for the FP8 op."""
    dims = _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI)
    _check_impl(impl)
    _check_save_z(save_z, impl)
    _check_swiglu_clamp(swiglu_clamp)
    if fp8_weights is not None:
        _check_fp8_weights(fp8_weights, w13_EFH, w2_EHI)
    return torch.empty_like(x_TH), _empty_saved_z(x_TH, dims, save_z)


@torch.library.register_fake("fusemoe::moe_experts_forward")
def _moe_experts_forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                              grad_in_place=False, save_z=False, swiglu_clamp=None):
    return _forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, save_z,
                         swiglu_clamp)


def _check_save_z(save_z, impl):
    if save_z and impl != "fused":
        _fail(f"save_z needs impl=\"fused\" (got {impl!r})")


def _check_saved_z(saved_z_SF, dims, x_TH, impl):
    """A backward's saved_z: None, or the (non-empty) z of a "fused" forward of these inputs."""
    if saved_z_SF is None or saved_z_SF.numel() == 0:
        return None
    _check_save_z(True, impl)
    hidden, intermediate, _, top_k, num_tokens = dims
    expected = (num_tokens * top_k, 2 * intermediate)
    if (tuple(saved_z_SF.shape) != expected or saved_z_SF.dtype != torch.bfloat16
            or not saved_z_SF.is_contiguous() or saved_z_SF.device != x_TH.device):
        _fail(f"saved_z must be the forward's z: contiguous bf16 {expected} on {x_TH.device}, got "
              f"{saved_z_SF.dtype} {tuple(saved_z_SF.shape)} on {saved_z_SF.device}")
    return saved_z_SF


@_op("moe_experts_backward")
def moe_experts_backward(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                         topk_weights_TK: Tensor, w13_EFH: Tensor, w2_EHI: Tensor,
                         impl: str, saved_z_SF: Optional[Tensor] = None,
                         swiglu_clamp: Optional[float] = None, gate_up_grad: bool = True,
                         down_grad: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx [T, H] bf16, d_topk_weights [T, K] fp32, dw13 [E, F, H], dw2 [E, H, I]).
    saved_z: the z output of the forward of these inputs (skips recomputing it), or None.
    swiglu_clamp: the forward's. gate_up_grad / down_grad False (frozen weights): dw13 / dw2 is
    not computed and comes back as a 0-element tensor."""
    grads = _fresh_weight_grads((w13_EFH, w2_EHI), gate_up_grad, down_grad)
    dx_TH, d_topk_weights_TK = _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK,
                                                w13_EFH, w2_EHI, *grads, False, impl,
                                                saved_z_SF, swiglu_clamp)
    return (dx_TH, d_topk_weights_TK, *_returned_weight_grads(grads, (w13_EFH, w2_EHI)))


def _wanted_per_weight(num_weights, gate_up_grad, down_grad):
    """The backward ops' gate_up_grad / down_grad per weight (w13, w2, or w1, w3, w2): gate_up_grad
    covers every weight but the last, down_grad the last."""
    return (gate_up_grad,) * (num_weights - 1) + (down_grad,)


def _fresh_weight_grads(weights, gate_up_grad, down_grad):
    """The fresh gradient buffers of a backward op that returns them: per weight one of its dtype,
    or None for a frozen weight's, which the library then skips."""
    wanted = _wanted_per_weight(len(weights), gate_up_grad, down_grad)
    return tuple(torch.empty_like(w) if want else None for w, want in zip(weights, wanted))


def _returned_weight_grads(grads, weights):
    """What a backward op returns for _fresh_weight_grads' buffers: a 0-element tensor for a
    frozen weight's (an op returns tensors)."""
    return tuple(g if g is not None else w.new_empty(0) for g, w in zip(grads, weights))


def _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dw13_EFH,
                     dw2_EHI, accumulate, impl, saved_z_SF, swiglu_clamp, fp8_weights=None,
                     fp8_weight_grads=False):
    """The backward ops' call, on the bf16 weights or the FP8 buffer as _launch_forward. dw13 or
    dw2 None: that gradient is not computed (frozen weights)."""
    dims = _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH)
    _check_cuda(x_TH)
    # A frozen weight stands in for its gradient: the checks are those of a call with both.
    grad_dtype = _check_weight_grads(w13_EFH if dw13_EFH is None else dw13_EFH,
                                     w2_EHI if dw2_EHI is None else dw2_EHI, w13_EFH, w2_EHI)
    saved_z_SF = _check_saved_z(saved_z_SF, dims, x_TH, impl)
    _check_swiglu_clamp(swiglu_clamp)
    layer, weights = _layer_and_weights(dims, impl, swiglu_clamp, w13_EFH, w2_EHI, fp8_weights,
                                        fp8_weight_grads)
    return _call_backward(layer, dims, dy_TH, x_TH, topk_idx_TK, topk_weights_TK, saved_z_SF,
                          grad_dtype, accumulate, weights,
                          dict(dw13=_pointer(dw13_EFH), dw2=_pointer(dw2_EHI)))


def _pointer(t):
    """A tensor's device pointer for the C ABI, or None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl, saved_z_SF,
                   swiglu_clamp, weight_grads=None, fp8_weights=None, gate_up_grad=True,
                   down_grad=True):
    """The backward ops' fake kernels: the launch's checks that need no device, then empty outputs
    (dx, d_topk_weights, and dw13, dw2 unless weight_grads (dw13, dw2) are given, as the _into
    ops take them: 0-element for a frozen weight's); fp8_weights for the FP8 ops."""
    dims = _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH)
    if weight_grads is not None:
        _check_weight_grads(*weight_grads, w13_EFH, w2_EHI)
    _check_impl(impl)
    if fp8_weights is not None:
        _check_fp8_weights(fp8_weights, w13_EFH, w2_EHI)
    _check_saved_z(saved_z_SF, dims, x_TH, impl)
    _check_swiglu_clamp(swiglu_clamp)
    grads = (torch.empty_like(x_TH), torch.empty_like(topk_weights_TK))
    if weight_grads is None:
        weights = (w13_EFH, w2_EHI)
        grads += _returned_weight_grads(_fresh_weight_grads(weights, gate_up_grad, down_grad),
                                        weights)
    return grads


@torch.library.register_fake("fusemoe::moe_experts_backward")
def _moe_experts_backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                               saved_z_SF=None, swiglu_clamp=None, gate_up_grad=True,
                               down_grad=True):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, gate_up_grad=gate_up_grad,
                          down_grad=down_grad)


@_op("moe_experts_backward_into", mutates_args=("dw13_EFH", "dw2_EHI"))
def moe_experts_backward_into(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                              topk_weights_TK: Tensor, w13_EFH: Tensor, w2_EHI: Tensor,
                              dw13_EFH: Tensor, dw2_EHI: Tensor, accumulate: bool,
                              impl: str, saved_z_SF: Optional[Tensor] = None,
                              swiglu_clamp: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """The backward with the weight gradients written (accumulate=False) or added (True) into
    dw13/dw2 (bf16 or fp32, one dtype, the shapes of w13/w2); returns (dx, d_topk_weights)."""
    return _launch_backward(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dw13_EFH,
                            dw2_EHI, accumulate, impl, saved_z_SF, swiglu_clamp)


@torch.library.register_fake("fusemoe::moe_experts_backward_into")
def _moe_experts_backward_into_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI,
                                    dw13_EFH, dw2_EHI, accumulate, impl, saved_z_SF=None,
                                    swiglu_clamp=None):
    return _backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                          saved_z_SF, swiglu_clamp, weight_grads=(dw13_EFH, dw2_EHI))


def _check_weight_grads(dw13_EFH, dw2_EHI, w13_EFH, w2_EHI, api=API):
    """The C library's weight_grad_dtype code for gradient buffers dw13/dw2."""
    return _weight_grad_dtype((("dw13", dw13_EFH, w13_EFH), ("dw2", dw2_EHI, w2_EHI)), api)


def _weight_grad_dtype(named, api=API):
    """The C library's weight_grad_dtype code for the gradient buffers of named: (name, grad,
    weight) triples (fusemoe.separate passes dw1, dw3, dw2). Float32 or bfloat16, one dtype,
    contiguous, of the weight's shape and device."""
    codes = {torch.float32: _capi.WEIGHT_GRAD_FLOAT32, torch.bfloat16: _capi.WEIGHT_GRAD_BFLOAT16}
    for name, grad, weight in named:
        if not isinstance(grad, Tensor) or grad.dtype not in codes:
            _fail(f"{name} must be a float32 or bfloat16 tensor, got "
                  f"{getattr(grad, 'dtype', type(grad).__name__)}", api)
        if grad.shape != weight.shape or not grad.is_contiguous() or grad.device != weight.device:
            _fail(f"{name} must be contiguous, on {weight.device}, of shape {tuple(weight.shape)}; "
                  f"got {tuple(grad.shape)} on {grad.device}, strides {grad.stride()}", api)
    dtypes = [grad.dtype for _, grad, _ in named]
    if len(set(dtypes)) > 1:
        names = [name for name, _, _ in named]
        _fail(f"{', '.join(names[:-1])} and {names[-1]} must have one dtype, got "
              f"{', '.join(str(d) for d in dtypes[:-1])} and {dtypes[-1]}", api)
    return codes[dtypes[0]]


def _save_for_backward(ctx, tensors, impl, grad_in_place, save_z, swiglu_clamp, z_SF,
                       num_weights=2, options=()):
    """setup_context of the forward ops (bf16 and FP8): tensors are the op's tensor inputs, (x,
    topk_idx, topk_weights, then the num_weights weights: w13, w2, or w1, w3, w2 for
    fusemoe.separate) and for the FP8 ops fp8_weights; the rest its other inputs and its z
    output; options: the inputs after swiglu_clamp, which both backward ops take last (the FP8
    ops' fp8_weight_grads)."""
    ctx.mark_non_differentiable(z_SF)
    # Without this autograd hands the backward a zero-filled gradient of z (T K x 2I bf16: 256 MiB
    # at T = 4096, 2I = 4096), allocated and written on every backward for nothing.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, z_SF)
    ctx.num_inputs = len(tensors) + 4 + len(options)
    ctx.num_weights = num_weights
    ctx.options = tuple(options)
    ctx.impl = impl
    ctx.swiglu_clamp = swiglu_clamp
    # In-place gradients need the leaf Parameters themselves (not a converted copy).
    weights = tensors[3:3 + num_weights]
    ctx.params = (weights if grad_in_place and all(w.is_leaf and w.requires_grad for w in weights)
                  else None)
    # Which weight gradients autograd wants (needs_input_grad, read here where the op's inputs are
    # indexed alike in both registrations): a frozen weight's GEMM is skipped in the backward.
    ctx.weights_need_grad = tuple(w.requires_grad for w in weights)


def _gradients(ctx, dy_TH, backward_op, backward_into_op):
    """The backward formula of the forward ops (bf16 and FP8, w13 or w1/w3): backward_op /
    backward_into_op take the saved weights, e.g. (w13, w2) or (w13, w2, fp8_weights), then
    (into) a gradient buffer per weight and accumulate. Returns a gradient (or None) for each
    input of the forward op."""
    x_TH, topk_idx_TK, topk_weights_TK, *weights, z_SF = ctx.saved_tensors
    saved_z_SF = z_SF if z_SF.numel() else None
    # dy may arrive expanded (e.g. from y.sum()) or in another layout: the op needs it dense.
    dy_TH = dy_TH.contiguous()
    _refuse_create_graph()
    if _in_place_path(ctx):
        dx_TH, d_topk_weights_TK = _backward_into_grads(
            ctx, lambda *grads_and_accumulate: _call(
                backward_into_op, dy_TH, x_TH, topk_idx_TK, topk_weights_TK, *weights,
                *grads_and_accumulate, ctx.impl, saved_z_SF, ctx.swiglu_clamp, *ctx.options))
        weight_grads = (None,) * ctx.num_weights
    else:
        wanted = ctx.weights_need_grad
        dx_TH, d_topk_weights_TK, *weight_grads = _call(
            backward_op, dy_TH, x_TH, topk_idx_TK, topk_weights_TK, *weights, ctx.impl,
            saved_z_SF, ctx.swiglu_clamp, any(wanted[:-1]), wanted[-1], *ctx.options)
        weight_grads = [g if want else None for g, want in zip(weight_grads, wanted)]
    return ((dx_TH, None, d_topk_weights_TK, *weight_grads)
            + (None,) * (ctx.num_inputs - 3 - ctx.num_weights))


_in_place_backwards = 0  # backward calls of either formula that took grad_in_place's path


def _refuse_create_graph():
    """Raises under create_graph=True (grad mode on in the backward), eager only (a compiled
    backward is traced with whatever grad mode its tracer sets): the gradients would be constants
    of autograd's graph, and a second-order gradient through them silently wrong or missing. The
    C++ formula raises the same message."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError("fusemoe: the backward of the fusemoe ops is not differentiable, so "
                           "create_graph=True (double backward) through them is not supported")


def _in_place_path(ctx):
    """Whether this backward writes the weight gradients into .grad (grad_in_place): asked for at
    the forward (ctx.params), every existing .grad contiguous (what the kernels write; autograd
    adds into any other), outside compiled autograd, and in a pass that accumulates every
    weight's gradient. Under torch.compile the path is taken so that _backward_into_grads names
    the problem."""
    return (ctx.params is not None
            and all(p.grad is None or p.grad.is_contiguous() for p in ctx.params)
            and not _compiled_autograd_running()
            and (torch.compiler.is_compiling() or _weight_gradients_wanted(ctx)))


def _weight_gradients_wanted(ctx):
    """Whether this backward pass accumulates every weight's gradient: not under
    torch.autograd.grad(y, x) or backward(inputs=[x]), where grad_in_place must leave .grad alone
    (the weights' AccumulateGrad nodes do not run), and the weight gradients are returned, for
    autograd to drop."""
    edges = ctx.next_functions[3:3 + ctx.num_weights]
    try:
        return all(node is not None and torch._C._will_engine_execute_node(node)
                   for node, _ in edges)
    except RuntimeError:  # refused for a leaf's node under autograd.grad, which never writes .grad
        return False


def _compiled_autograd_running():
    """Whether this backward runs inside a compiled autograd graph: the graph accumulates what the
    backward returns into .grad itself and does not see a .grad the backward wrote, so
    grad_in_place returns the weight gradients there (both formulas; warned once). The flag is
    the one torch._dynamo.compiled_autograd sets while its graph runs; that module is imported
    by compiled autograd, so a backward never imports it."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is None or not getattr(module, "in_compiled_autograd_region", False):
        return False
    warnings.warn("fusemoe: grad_in_place=True under compiled autograd returns the weight "
                  "gradients to autograd, which adds them to .grad (the compiled graph owns .grad)",
                  stacklevel=2)
    return True


def _in_place_backward_count():
    """How many backward calls so far wrote the weight gradients into .grad (grad_in_place), by
    the Python formula and the C++ one: what tests check the path by."""
    cpp = _native.AUTOGRAD.in_place_backwards() if _native.AUTOGRAD is not None else 0
    return _in_place_backwards + cpp


def _backward_into_grads(ctx, backward_into):
    """grad_in_place (the bf16 and FP8 ops): backward_into(*grads, accumulate), a gradient buffer
    per Parameter of ctx.params (w13, w2, or w1, w3, w2), adds the weight gradients to the
    Parameters' .grad (or writes a fresh .grad when all are None) and autograd gets None for
    them, so no separate add runs. Returns (dx, d_topk_weights)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("fusemoe: grad_in_place=True sets Parameter.grad inside the backward, "
                           "which a compiled backward cannot trace; use grad_in_place=False "
                           "under torch.compile")
    global _in_place_backwards
    _in_place_backwards += 1
    params = ctx.params
    fresh = all(param.grad is None for param in params)
    if fresh:
        grads = tuple(torch.empty_like(param) for param in params)
    else:
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = tuple(param.grad for param in params)
    dx_TH, d_topk_weights_TK = backward_into(*grads, not fresh)
    if fresh:
        for param, grad in zip(params, grads):
            param.grad = grad
    return dx_TH, d_topk_weights_TK


# The thread's included dispatch keys when no mode, transform or tracer is active (see _direct).
_PLAIN_INCLUDE_SET = torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect).add(
    torch._C.DispatchKey.ADInplaceOrView)


def _direct(args):
    """Whether fusemoe's own call of a forward op may skip the dispatcher above autograd: eager
    (not traced by dynamo), no key above Autograd included for this thread (torch function or
    dispatch modes, functorch transforms, the Python dispatcher, jit tracing), no
    __torch_function__ in the arguments. Then nothing runs there but autocast, which falls through
    for these ops."""
    return not (torch.compiler.is_compiling()
                or torch._C._dispatch_tls_local_include_set() != _PLAIN_INCLUDE_SET
                or torch._C._has_torch_function(args))


def _register_autograd(name, backward, setup_context, num_weights=2):
    """Registers the autograd formula of the forward op fusemoe::<name> and returns the function
    fusemoe's own code calls it by. The ctypes path's custom ops take
    torch.library.register_autograd, and are called as they are. The native ops get the kernel it
    would make (torch._library.autograd.make_autograd_impl: an autograd.Function around a
    redispatch below autograd, registered for the Autograd key) less its per-call fill_defaults,
    which reads the schema's argument list from C++ twice per argument (41 us per forward on the
    CPU machine): the defaults are read once here. The returned function runs that kernel's work
    without entering the dispatcher first where nothing would run above it (_direct): one Python
    kernel call fewer per forward (docs/perf.md#host-cost-of-the-op). There, when the C++ autograd
    module is loaded (fusemoe._native.AUTOGRAD), it runs the forward and links a C++ node whose
    backward calls the backward ops with no Python: the same formula as backward/setup_context
    (num_weights: the weights after topk_weights, 3 for w1, w3, w2)."""
    if not _native.LOADED:
        torch.library.register_autograd(f"fusemoe::{name}", backward, setup_context=setup_context)
        return getattr(torch.ops.fusemoe, name)
    op = getattr(torch.ops.fusemoe, name).default
    defaults = tuple(argument.default_value for argument in op._schema.arguments)
    family = None
    if _native.AUTOGRAD is not None:
        stem = name[:-len("_forward")]
        num_tensors = sum(1 for argument in op._schema.arguments
                          if isinstance(argument.type, torch._C.TensorType))
        family = _native.AUTOGRAD.register_ops(f"fusemoe::{name}", f"fusemoe::{stem}_backward",
                                               f"fusemoe::{stem}_backward_into", num_tensors,
                                               num_weights)
    below_autograd = torch._C._after_autograd_keyset

    class Generated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, *args):
            # keyset None: called from call() below, where the whole call is below autograd.
            with torch._C._AutoDispatchBelowAutograd():
                output = (op(*args) if keyset is None
                          else op.redispatch(keyset & below_autograd, *args))
            setup_context(ctx, args + defaults[len(args):], output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return (None, *backward(ctx, *grads))  # no gradient for the keyset

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Generated.apply(keyset, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    def call(*args):
        if not _direct(args):
            return op(*args)
        # Read per call: _native.AUTOGRAD = None selects the Python formula (the tests do). The C++
        # entry also takes calls that need no gradient (it then calls the op below autograd).
        if family is not None and _native.AUTOGRAD is not None:
            output = _native.AUTOGRAD.forward(family, *args)
            if output is not NotImplemented:  # NotImplemented: an argument the op will refuse
                return output
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Generated.apply(None, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    _AUTOGRAD_LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return call


def _setup_context(ctx, inputs, output):
    _save_for_backward(ctx, inputs[:5], *inputs[5:], output[1])


def _backward(ctx, dy_TH, _dz_unused):
    return _gradients(ctx, dy_TH, moe_experts_backward, moe_experts_backward_into)


_forward_call = _register_autograd("moe_experts_forward", _backward, _setup_context)


def _wants_saved_z(impl, recompute_z, x_TH, topk_weights_TK, *weights):
    """Whether a forward saves z (the bf16 and FP8 ops, w13 or w1/w3): impl "fused", recompute_z
    off and a gradient to compute. A loop rather than any() over a generator, which costs more
    per call than the rest of this function (docs/perf.md#host-cost-of-the-op)."""
    if impl != "fused" or recompute_z or not torch.is_grad_enabled():
        return False
    for t in (x_TH, topk_weights_TK, *weights):
        if isinstance(t, Tensor) and t.requires_grad:
            return True
    return False
