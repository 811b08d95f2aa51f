"""ctypes binding of libfusemoe_c.so (src/capi/fusemoe_c.h): loading, signatures, errors.

The library is found through the environment variable FUSEMOE_LIBRARY (a path to the .so) or, by
default, at build/libfusemoe_c.so of the repository this package sits in (python/fusemoe/ ->
../../build). It is loaded on first use, so `import fusemoe` works without it. Every C function
returns a status; a non-zero one becomes FusemoeError carrying fusemoe_c_last_error().
"""
import ctypes
import os
import threading

ABI_VERSION = 5  # FUSEMOE_C_ABI_VERSION this binding is written for
WEIGHT_GRAD_FLOAT32 = 0
WEIGHT_GRAD_BFLOAT16 = 1
EXPERT_ID_REPORT_INTS = 3  # fusemoe::kExpertIdReportInts
WORKSPACE_USES = {"forward": 0, "backward": 1, "backward_saved_z": 2}  # FUSEMOE_C_WORKSPACE_*
PRECISIONS = {"bf16": 0, "fp8": 1}  # FUSEMOE_C_PRECISION_BF16, FUSEMOE_C_PRECISION_FP8_BLOCKWISE

_DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build",
                             "libfusemoe_c.so")
_STATUS_NAMES = {1: "error", 2: "out of memory", 3: "internal error"}

_i32, _i64, _u64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p
_LAYER = [_i64, _i64, _i64, _i64, _i64, _i32]  # hidden, intermediate, experts, top_k, max_tokens, impl
_SIGNATURES = {
    "fusemoe_c_abi_version": ([], _i32),
    "fusemoe_c_last_error": ([], ctypes.c_char_p),
    "fusemoe_c_impl_code": ([ctypes.c_char_p, ctypes.POINTER(_i32)], _i32),
    "fusemoe_c_workspace_bytes": (_LAYER + [ctypes.POINTER(_u64)], _i32),
    "fusemoe_c_workspace_bytes_for": (_LAYER + [_i32, ctypes.POINTER(_u64)], _i32),
    "fusemoe_c_saved_z_bytes": (_LAYER[:-1] + [ctypes.POINTER(_u64)], _i32),
    # x, topk_idx, topk_weights, w13, w2, y, num_tokens, workspace, workspace_bytes,
    # expert_id_report, saved_z, stream
    "fusemoe_c_forward": (_LAYER + [_ptr] * 6 + [_i64, _ptr, _u64, _ptr, _ptr, _ptr], _i32),
    # x, topk_idx, topk_weights, w13, w2, dy, dx, d_topk_weights, dw13, dw2, weight_grad_dtype,
    # accumulate, num_tokens, workspace, workspace_bytes, expert_id_report, saved_z, stream
    "fusemoe_c_backward": (_LAYER + [_ptr] * 10 + [_i32, _i32, _i64, _ptr, _u64, _ptr, _ptr,
                                                    _ptr], _i32),
    # report (host-readable), num_experts, top_k
    "fusemoe_c_check_expert_id_report": ([_ptr, _i64, _i64], _i32),
    # Blockwise FP8 (ABI 5): precision, use
    "fusemoe_c_workspace_bytes_precision": (_LAYER + [_i32, _i32, ctypes.POINTER(_u64)], _i32),
    "fusemoe_c_fp8_weights_bytes": (_LAYER[:-1] + [ctypes.POINTER(_u64)], _i32),
    # w13, w2, buffer, buffer_bytes, stream
    "fusemoe_c_quantize_weights_fp8": (_LAYER[:-1] + [_ptr, _ptr, _ptr, _u64, _ptr], _i32),
    # x, topk_idx, topk_weights, fp8_weights, y, num_tokens, workspace, workspace_bytes,
    # expert_id_report, saved_z, stream
    "fusemoe_c_forward_fp8": (_LAYER + [_ptr] * 5 + [_i64, _ptr, _u64, _ptr, _ptr, _ptr], _i32),
    # x, topk_idx, topk_weights, fp8_weights, dy, dx, d_topk_weights, dw13, dw2, weight_grad_dtype,
    # accumulate, num_tokens, workspace, workspace_bytes, expert_id_report, saved_z, stream
    "fusemoe_c_backward_fp8": (_LAYER + [_ptr] * 9 + [_i32, _i32, _i64, _ptr, _u64, _ptr, _ptr,
                                                       _ptr], _i32),
}


class FusemoeError(RuntimeError):
    """A fusemoe failure: bad input caught by the library, a CUDA error, or a missing library."""


_lock = threading.Lock()
_lib = None
_impl_codes = {}


def library_path():
    """The path the library is (or would be) loaded from."""
    return os.path.abspath(os.environ.get("FUSEMOE_LIBRARY") or _DEFAULT_PATH)


def load():
    """The loaded library; raises FusemoeError saying how to get it when it is missing."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not os.path.isfile(path):
            raise FusemoeError(
                f"fusemoe: C library not found at {path}. Build it with "
                "`cmake -S . -B build -G Ninja && ninja -C build fusemoe_c` in the repository "
                "(bash scripts/setup.sh does this), or set FUSEMOE_LIBRARY to the path of "
                "libfusemoe_c.so.")
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise FusemoeError(f"fusemoe: cannot load {path}: {e}") from e
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        version = lib.fusemoe_c_abi_version()
        if version != ABI_VERSION:
            raise FusemoeError(f"fusemoe: {path} has C ABI version {version}, this package needs "
                               f"{ABI_VERSION}; rebuild the library or update the package.")
        _lib = lib
    return _lib


def is_available():
    """True when the library can be loaded (no GPU needed)."""
    try:
        load()
    except FusemoeError:
        return False
    return True


def _check(status):
    if status != 0:
        message = _lib.fusemoe_c_last_error().decode("utf-8", "replace")
        kind = _STATUS_NAMES.get(status, f"status {status}")
        raise FusemoeError(f"{message} [{kind}]")


def impl_code(name):
    """The library's code for an implementation name ("unfused", ...); FusemoeError if unknown."""
    code = _impl_codes.get(name)
    if code is None:
        if not isinstance(name, str):
            raise FusemoeError(f"impl must be a string such as \"unfused\", got {name!r}")
        lib = load()
        out = _i32()
        _check(lib.fusemoe_c_impl_code(name.encode("utf-8"), ctypes.byref(out)))
        code = _impl_codes.setdefault(name, out.value)
    return code


def workspace_bytes(layer, impl, use=None):
    """layer = (hidden, intermediate, num_experts, top_k, max_tokens). use: None (what every call
    accepts) or one of WORKSPACE_USES ("forward", "backward", "backward_saved_z"): what that
    kind of call needs."""
    lib = load()
    out = _u64()
    if use is None:
        _check(lib.fusemoe_c_workspace_bytes(*layer, impl_code(impl), ctypes.byref(out)))
    else:
        if use not in WORKSPACE_USES:
            raise FusemoeError(f"use must be one of {sorted(WORKSPACE_USES)} or None, got {use!r}")
        _check(lib.fusemoe_c_workspace_bytes_for(*layer, impl_code(impl), WORKSPACE_USES[use],
                                                 ctypes.byref(out)))
    return out.value


def saved_z_bytes(layer):
    """Bytes of the forward's saved pre-activations for layer (H, I, E, K, max_tokens)."""
    lib = load()
    out = _u64()
    _check(lib.fusemoe_c_saved_z_bytes(*layer, ctypes.byref(out)))
    return out.value


def forward(layer, impl, x, topk_idx, topk_weights, w13, w2, y, num_tokens, workspace,
            workspace_bytes_, expert_id_report, saved_z, stream):
    """Pointers are ints (data_ptr(); expert_id_report and saved_z may be None); stream is a
    cudaStream_t as an int."""
    lib = load()
    _check(lib.fusemoe_c_forward(*layer, impl_code(impl), x, topk_idx, topk_weights, w13, w2, y,
                                 num_tokens, workspace, workspace_bytes_, expert_id_report,
                                 saved_z, stream))


def backward(layer, impl, x, topk_idx, topk_weights, w13, w2, dy, dx, d_topk_weights, dw13, dw2,
             weight_grad_dtype, accumulate, num_tokens, workspace, workspace_bytes_,
             expert_id_report, saved_z, stream):
    lib = load()
    _check(lib.fusemoe_c_backward(*layer, impl_code(impl), x, topk_idx, topk_weights, w13, w2, dy,
                                  dx, d_topk_weights, dw13, dw2, weight_grad_dtype,
                                  int(bool(accumulate)), num_tokens, workspace, workspace_bytes_,
                                  expert_id_report, saved_z, stream))


def workspace_bytes_fp8(layer, impl, use):
    """As workspace_bytes(layer, impl, use) at precision "fp8" (use required)."""
    lib = load()
    if use not in WORKSPACE_USES:
        raise FusemoeError(f"use must be one of {sorted(WORKSPACE_USES)}, got {use!r}")
    out = _u64()
    _check(lib.fusemoe_c_workspace_bytes_precision(*layer, impl_code(impl), PRECISIONS["fp8"],
                                                   WORKSPACE_USES[use], ctypes.byref(out)))
    return out.value


def fp8_weights_bytes(layer):
    """Bytes of the FP8 weight buffer of layer (H, I, E, K, max_tokens)."""
    lib = load()
    out = _u64()
    _check(lib.fusemoe_c_fp8_weights_bytes(*layer, ctypes.byref(out)))
    return out.value


def quantize_weights_fp8(layer, w13, w2, buffer, buffer_bytes, stream):
    lib = load()
    _check(lib.fusemoe_c_quantize_weights_fp8(*layer, w13, w2, buffer, buffer_bytes, stream))


def forward_fp8(layer, impl, x, topk_idx, topk_weights, fp8_weights, y, num_tokens, workspace,
                workspace_bytes_, expert_id_report, saved_z, stream):
    lib = load()
    _check(lib.fusemoe_c_forward_fp8(*layer, impl_code(impl), x, topk_idx, topk_weights,
                                     fp8_weights, y, num_tokens, workspace, workspace_bytes_,
                                     expert_id_report, saved_z, stream))


def backward_fp8(layer, impl, x, topk_idx, topk_weights, fp8_weights, dy, dx, d_topk_weights, dw13,
                 dw2, weight_grad_dtype, accumulate, num_tokens, workspace, workspace_bytes_,
                 expert_id_report, saved_z, stream):
    lib = load()
    _check(lib.fusemoe_c_backward_fp8(*layer, impl_code(impl), x, topk_idx, topk_weights,
                                      fp8_weights, dy, dx, d_topk_weights, dw13, dw2,
                                      weight_grad_dtype, int(bool(accumulate)), num_tokens,
                                      workspace, workspace_bytes_, expert_id_report, saved_z,
                                      stream))


def check_expert_id_report(report, num_experts, top_k):
    """report: address (int) of 3 host-readable int32; FusemoeError naming the bad id if set."""
    lib = load()
    _check(lib.fusemoe_c_check_expert_id_report(report, num_experts, top_k))
