"""Argument checks shared by fusemoe's ops (fusemoe.ops, fusemoe.fp8, fusemoe.separate,
fusemoe.expert_parallel) and modules (the library's verdict on a layer shape), and the size of the
FP8 weight buffer the ops check: the bottom of the package, importing only the C library's
wrapper, so the bf16 and FP8 op modules can both use it."""
import torch
from torch import Tensor

from . import _capi

API = "fusemoe.moe_experts"  # what the ops' argument errors start with


def _fail(message, api=API):
    """api: the function the user called, which the message names (fusemoe.expert_parallel passes
    its own)."""
    raise ValueError(f"{api}: {message}")


def _check_tensor(t, name, ndim, dtype, api=API):
    if not isinstance(t, Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", api)
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}", api)
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}", api)
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}", api)


def _check_fp8_weight_grads(fp8_weight_grads, precision, api=API):
    """The fp8_weight_grads option of the public functions: a bool, set only with precision
    "fp8" (the library refuses it otherwise too, later and in C's words)."""
    if not isinstance(fp8_weight_grads, bool):
        _fail(f"fp8_weight_grads must be a bool, got {fp8_weight_grads!r}", api)
    if fp8_weight_grads and precision != "fp8":
        _fail(f"fp8_weight_grads=True needs precision=\"fp8\" (got {precision!r})", api)


def library_refusal(hidden, intermediate, num_experts, top_k, impl, precision):
    """Why the library refuses a layer of this shape, implementation and precision (its own
    validation: the workspace query checks the LayerConfig with both), or None when it takes it
    or is not loaded (its first call checks then)."""
    if not _capi.is_available():
        return None
    try:
        _capi.layer(hidden, intermediate, num_experts, top_k, 0, impl, None,
                    precision).workspace_bytes()
    except _capi.FusemoeError as e:
        return str(e).split(": ", 1)[-1].rsplit(" [", 1)[0]  # drop file:line and [status]
    return None


# ------------------------------------------------------------------------------ FP8 weight buffer

_BLOCK = 128       # E4M3 scale block: 1 x 128 for activations, 128 x 128 for weights
_ALIGNMENT = 256   # each array of the weight buffer starts 256-byte aligned


def _align(num_bytes):
    return (num_bytes + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def fp8_weights_bytes(num_experts, hidden, intermediate):
    """Bytes of the FP8 weight buffer (fusemoe::fp8_weights_bytes): w13, w13^T, their scales, w2,
    w2^T, their scales. The library's formula redone in Python for where there is no layer (the
    fake kernels, which need no library); calls with a layer ask the library
    (_capi.fp8_weights_bytes). A CPU test checks that the two agree."""
    w13 = num_experts * 2 * intermediate * hidden
    w2 = num_experts * hidden * intermediate
    s13 = num_experts * (2 * intermediate // _BLOCK) * (hidden // _BLOCK) * 4
    s2 = num_experts * (hidden // _BLOCK) * (intermediate // _BLOCK) * 4
    return 2 * _align(w13) + _align(s13) + 2 * _align(w2) + _align(s2)


def _check_fp8_shapes(w13_EFH, w2_EHI):
    num_experts, two_intermediate, hidden = w13_EFH.shape
    return _check_fp8_dims(num_experts, hidden, two_intermediate // 2)


def _check_fp8_dims(num_experts, hidden, intermediate, api=API):
    """(E, H, I) with H and I multiples of the scale block; api: the entry point named."""
    if hidden % _BLOCK or intermediate % _BLOCK:
        _fail(f"precision=\"fp8\" needs hidden and intermediate to be multiples of {_BLOCK}, got "
              f"H={hidden}, I={intermediate}", api)
    return num_experts, hidden, intermediate


def _check_fp8_weights(fp8_weights, w13_EFH, w2_EHI, layer=None):
    """layer: the call's _capi.Layer (precision "fp8"), whose buffer size the library gives; None
    in the fake kernels (the Python formula)."""
    _check_fp8_buffer_bytes(fp8_weights, _check_fp8_shapes(w13_EFH, w2_EHI), w13_EFH.device,
                            layer, "fusemoe.fp8.quantize_weights_fp8(w13, w2)")


def _check_fp8_buffer_bytes(fp8_weights, dims, device, layer, made_by, api=API):
    """The buffer check of _check_fp8_weights for a layer of dims (E, H, I) on device; layer: a
    _capi.Layer, or an expert-parallel _capi.EpConfig of precision "fp8" (dims: its local
    experts'), whose buffer size the library gives, or None (the Python formula); made_by: the
    call that makes the buffer, which the message names."""
    if layer is None:
        expected = fp8_weights_bytes(*dims)
    elif isinstance(layer, _capi.EpConfig):
        expected = layer.fp8_weights_bytes  # queried when the config was built
    else:
        expected = _capi.fp8_weights_bytes(layer)
    if (not isinstance(fp8_weights, Tensor) or fp8_weights.dtype != torch.uint8
            or fp8_weights.dim() != 1 or fp8_weights.numel() != expected
            or not fp8_weights.is_contiguous() or fp8_weights.device != device):
        _fail(f"fp8_weights must be the buffer {made_by} returned: "
              f"contiguous uint8 [{expected}] on {device}, got "
              f"{getattr(fp8_weights, 'dtype', type(fp8_weights).__name__)} "
              f"{tuple(getattr(fp8_weights, 'shape', ()))}", api)
