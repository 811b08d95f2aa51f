"""ctypes binding of libfusemoe_c.so (include/fusemoe/fusemoe_c.h): loading, structs, errors.

The library is found, in this order, at the path in the environment variable FUSEMOE_LIBRARY,
beside this file (the copy `pip install .` bundles), or at build/libfusemoe_c.so of the
repository this package sits in (python/fusemoe/ -> ../../build, for `pip install -e python`
or python/ on PYTHONPATH). It is loaded on first use, so `import fusemoe` works without it.
Every C function returns a status; a non-zero one becomes FusemoeError carrying
fusemoe_c_last_error(). Calls pass one struct each (FusemoeCLayer, built once per layer,
implementation and precision by layer(); FusemoeCForwardArgs / FusemoeCBackwardArgs /
FusemoeCFp8QuantizeArgs, filled per call), whose struct_size lets the library refuse a binding
written for another layout. Expert parallelism has its own three (FusemoeCEpConfig, built once
per rank, layer and precision by ep_config(); FusemoeCEpForwardArgs / FusemoeCEpBackwardArgs,
whose fp8_weights carries the rank's FP8 weight buffer at precision "fp8", C ABI 10).
"""
import ctypes
import functools
import os
import threading

ABI_VERSION = 10  # FUSEMOE_C_ABI_VERSION this binding is written for
WEIGHT_GRAD_FLOAT32 = 0
WEIGHT_GRAD_BFLOAT16 = 1
EXPERT_ID_REPORT_INTS = 3  # fusemoe::kExpertIdReportInts
WORKSPACE_USES = {"forward": 0, "backward": 1, "backward_saved_z": 2}  # FUSEMOE_C_WORKSPACE_*
PRECISIONS = {"bf16": 0, "fp8": 1}  # FUSEMOE_C_PRECISION_BF16, FUSEMOE_C_PRECISION_FP8_BLOCKWISE
LIBRARY_NAME = "libfusemoe_c.so"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_BUNDLED_PATH = os.path.join(_PACKAGE_DIR, LIBRARY_NAME)
_BUILD_TREE_PATH = os.path.normpath(os.path.join(_PACKAGE_DIR, "..", "..", "build", LIBRARY_NAME))
_STATUS_NAMES = {1: "error", 2: "out of memory", 3: "internal error"}

_i32, _i64, _u32, _u64, _ptr = (ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64,
                                ctypes.c_void_p)


class FusemoeError(RuntimeError):
    """A fusemoe failure: bad input caught by the library, a CUDA error, or a missing library."""


class Layer(ctypes.Structure):
    """FusemoeCLayer. Build it with layer(): that resolves the implementation and caches it."""
    _fields_ = [("struct_size", _u32), ("impl_code", _i32), ("hidden", _i64),
                ("intermediate", _i64), ("num_experts", _i64), ("top_k", _i64),
                ("max_tokens", _i64), ("use_swiglu_clamp", _i32), ("swiglu_clamp", ctypes.c_float),
                ("precision", _i32), ("fp8_weight_grads", _i32)]

    def workspace_bytes(self, use=None):
        """Bytes of workspace: use None (what every call accepts) or one of WORKSPACE_USES
        ("forward", "backward", "backward_saved_z"): what that kind of call needs. Cached."""
        sizes = self.__dict__.setdefault("_workspace_sizes", {})
        num_bytes = sizes.get(use)
        if num_bytes is None:
            num_bytes = sizes.setdefault(use, _workspace_bytes(self, use))
        return num_bytes


class ForwardArgs(ctypes.Structure):
    """FusemoeCForwardArgs: pointers are ints (data_ptr()) or None."""
    _fields_ = [("struct_size", _u32), ("x", _ptr), ("topk_idx", _ptr), ("topk_weights", _ptr),
                ("w13", _ptr), ("w2", _ptr), ("w1", _ptr), ("w3", _ptr), ("fp8_weights", _ptr),
                ("y", _ptr),
                ("num_tokens", _i64), ("workspace", _ptr), ("workspace_bytes", _u64),
                ("expert_id_report", _ptr), ("saved_z", _ptr), ("stream", _ptr),
                ("caller_checked_pointers", _i32)]


class BackwardArgs(ctypes.Structure):
    """FusemoeCBackwardArgs: pointers are ints (data_ptr()) or None."""
    _fields_ = [("struct_size", _u32), ("weight_grad_dtype", _i32), ("x", _ptr),
                ("topk_idx", _ptr), ("topk_weights", _ptr), ("w13", _ptr), ("w2", _ptr),
                ("w1", _ptr), ("w3", _ptr), ("fp8_weights", _ptr), ("dy", _ptr), ("dx", _ptr),
                ("d_topk_weights", _ptr), ("dw13", _ptr), ("dw2", _ptr), ("dw1", _ptr),
                ("dw3", _ptr), ("accumulate_weight_grads", _i32),
                ("num_tokens", _i64), ("workspace", _ptr), ("workspace_bytes", _u64),
                ("expert_id_report", _ptr), ("saved_z", _ptr), ("stream", _ptr),
                ("caller_checked_pointers", _i32)]


class Fp8QuantizeArgs(ctypes.Structure):
    """FusemoeCFp8QuantizeArgs: pointers are ints (data_ptr())."""
    _fields_ = [("struct_size", _u32), ("w13", _ptr), ("w2", _ptr), ("w1", _ptr), ("w3", _ptr),
                ("buffer", _ptr), ("buffer_bytes", _u64), ("stream", _ptr)]


class EpConfig(ctypes.Structure):
    """FusemoeCEpConfig: one rank's view of an expert-parallel layer. Build it with ep_config()."""
    _fields_ = [("struct_size", _u32), ("world_size", _i32), ("rank", _i32), ("layer", Layer)]

    def workspace_bytes(self, use=None):
        """As Layer.workspace_bytes, for this rank's private workspace. Cached."""
        sizes = self.__dict__.setdefault("_workspace_sizes", {})
        num_bytes = sizes.get(use)
        if num_bytes is None:
            num_bytes = sizes.setdefault(use, _ep_workspace_bytes(self, use))
        return num_bytes

    def __getattr__(self, name):
        # The layer's dims (hidden, ..., max_tokens) read through, for the workspace messages.
        if name in ("hidden", "intermediate", "num_experts", "top_k", "max_tokens"):
            return getattr(self.layer, name)
        raise AttributeError(name)


class EpForwardArgs(ctypes.Structure):
    """FusemoeCEpForwardArgs: pointers are ints (data_ptr()) or None; peer_symmetric is the
    address of a host array of R pointers."""
    _fields_ = [("struct_size", _u32), ("num_sms", _i32), ("x", _ptr), ("topk_idx", _ptr),
                ("topk_weights", _ptr), ("w13", _ptr), ("w2", _ptr), ("fp8_weights", _ptr),
                ("y", _ptr),
                ("num_tokens", _i64), ("peer_symmetric", _ptr), ("workspace", _ptr),
                ("workspace_bytes", _u64), ("expert_id_report", _ptr), ("saved_state", _ptr),
                ("stream", _ptr)]


class EpBackwardArgs(ctypes.Structure):
    """FusemoeCEpBackwardArgs: as EpForwardArgs."""
    _fields_ = [("struct_size", _u32), ("weight_grad_dtype", _i32), ("x", _ptr),
                ("topk_idx", _ptr), ("topk_weights", _ptr), ("w13", _ptr), ("w2", _ptr),
                ("fp8_weights", _ptr), ("dy", _ptr), ("dx", _ptr), ("d_topk_weights", _ptr),
                ("dw13", _ptr),
                ("dw2", _ptr), ("accumulate_weight_grads", _i32), ("num_sms", _i32),
                ("num_tokens", _i64), ("peer_symmetric", _ptr), ("workspace", _ptr),
                ("workspace_bytes", _u64), ("expert_id_report", _ptr), ("saved_state", _ptr),
                ("stream", _ptr)]


STRUCTS = {"FusemoeCLayer": Layer, "FusemoeCForwardArgs": ForwardArgs,
           "FusemoeCBackwardArgs": BackwardArgs, "FusemoeCFp8QuantizeArgs": Fp8QuantizeArgs,
           "FusemoeCEpConfig": EpConfig, "FusemoeCEpForwardArgs": EpForwardArgs,
           "FusemoeCEpBackwardArgs": EpBackwardArgs}
_FORWARD_SIZE = ctypes.sizeof(ForwardArgs)
_BACKWARD_SIZE = ctypes.sizeof(BackwardArgs)
_FP8_QUANTIZE_SIZE = ctypes.sizeof(Fp8QuantizeArgs)
_EP_FORWARD_SIZE = ctypes.sizeof(EpForwardArgs)
_EP_BACKWARD_SIZE = ctypes.sizeof(EpBackwardArgs)

_LAYER_P, _OUT_U64 = ctypes.POINTER(Layer), ctypes.POINTER(_u64)
_EP_CONFIG_P = ctypes.POINTER(EpConfig)
_SIGNATURES = {
    "fusemoe_c_abi_version": ([], _i32),
    "fusemoe_c_last_error": ([], ctypes.c_char_p),
    "fusemoe_c_impl_code": ([ctypes.c_char_p, ctypes.POINTER(_i32)], _i32),
    "fusemoe_c_workspace_bytes": ([_LAYER_P, _OUT_U64], _i32),
    "fusemoe_c_workspace_bytes_for": ([_LAYER_P, _i32, _OUT_U64], _i32),
    "fusemoe_c_saved_z_bytes": ([_LAYER_P, _OUT_U64], _i32),
    "fusemoe_c_fp8_weights_bytes": ([_LAYER_P, _OUT_U64], _i32),
    "fusemoe_c_quantize_weights_fp8": ([_LAYER_P, ctypes.POINTER(Fp8QuantizeArgs)], _i32),
    "fusemoe_c_forward": ([_LAYER_P, ctypes.POINTER(ForwardArgs)], _i32),
    "fusemoe_c_backward": ([_LAYER_P, ctypes.POINTER(BackwardArgs)], _i32),
    "fusemoe_c_ep_symmetric_bytes": ([_EP_CONFIG_P, _OUT_U64], _i32),
    "fusemoe_c_ep_workspace_bytes": ([_EP_CONFIG_P, _OUT_U64], _i32),
    "fusemoe_c_ep_workspace_bytes_for": ([_EP_CONFIG_P, _i32, _OUT_U64], _i32),
    "fusemoe_c_ep_saved_state_bytes": ([_EP_CONFIG_P, _OUT_U64], _i32),
    "fusemoe_c_ep_fp8_weights_bytes": ([_EP_CONFIG_P, _OUT_U64], _i32),
    "fusemoe_c_ep_quantize_weights_fp8": ([_EP_CONFIG_P, ctypes.POINTER(Fp8QuantizeArgs)], _i32),
    "fusemoe_c_ep_forward": ([_EP_CONFIG_P, ctypes.POINTER(EpForwardArgs)], _i32),
    "fusemoe_c_ep_backward": ([_EP_CONFIG_P, ctypes.POINTER(EpBackwardArgs)], _i32),
    # report (host-readable), num_experts, top_k
    "fusemoe_c_check_expert_id_report": ([_ptr, _i64, _i64], _i32),
    "fusemoe_c_struct_layout": ([ctypes.c_char_p, _OUT_U64, ctypes.POINTER(_i32)], _i32),
    "fusemoe_c_struct_field": ([ctypes.c_char_p, _i32, ctypes.POINTER(ctypes.c_char_p),
                                _OUT_U64, _OUT_U64], _i32),
}

_lock = threading.Lock()
_lib = None
_impl_codes = {}


def library_path():
    """The path the library is (or would be) loaded from: FUSEMOE_LIBRARY if set, else the
    bundled copy if present, else the repository's build/."""
    override = os.environ.get("FUSEMOE_LIBRARY")
    if override:
        return os.path.abspath(override)
    return _BUNDLED_PATH if os.path.isfile(_BUNDLED_PATH) else _BUILD_TREE_PATH


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
                f"fusemoe: C library not found at {path}. Install the package with "
                "`pip install .` from the repository (builds and bundles it), or build it with "
                "`bash scripts/setup.sh` (build/libfusemoe_c.so), or set FUSEMOE_LIBRARY to the "
                "path of libfusemoe_c.so.")
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise FusemoeError(f"fusemoe: cannot load {path}: {e}") from e
        try:
            lib.fusemoe_c_abi_version.restype = _i32
            version = lib.fusemoe_c_abi_version()
        except AttributeError as e:
            raise FusemoeError(f"fusemoe: {path} is not a fusemoe C library: {e}") from e
        if version != ABI_VERSION:
            raise FusemoeError(f"fusemoe: {path} has C ABI version {version}, this package needs "
                               f"{ABI_VERSION}; rebuild the library or update the package.")
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
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
    """status: what a call through the loaded library returned (so _lib is set)."""
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


@functools.lru_cache(maxsize=256)
def layer(hidden, intermediate, num_experts, top_k, max_tokens, impl, swiglu_clamp=None,
          precision="bf16", fp8_weight_grads=False):
    """The FusemoeCLayer of a layer, implementation and precision (PRECISIONS), built once and
    cached (the op calls this with max_tokens = T, so a training loop reuses a handful).
    swiglu_clamp: None (off) or c; fp8_weight_grads: the weight gradients' GEMMs in FP8 too
    (precision "fp8" only). Values are checked by the library when a call uses the struct, not
    here."""
    if precision not in PRECISIONS:
        raise FusemoeError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    clamp_on = swiglu_clamp is not None
    built = Layer(ctypes.sizeof(Layer), impl_code(impl), hidden, intermediate, num_experts, top_k,
                  max_tokens, int(clamp_on), float(swiglu_clamp) if clamp_on else 0.0,
                  PRECISIONS[precision], int(bool(fp8_weight_grads)))
    built.impl = impl
    return built


def _workspace_bytes(layer_, use, prefix="fusemoe_c"):
    """The workspace size queries of a Layer (prefix "fusemoe_c") or an EpConfig
    ("fusemoe_c_ep")."""
    lib = load()
    out = _u64()
    if use is None:
        _check(getattr(lib, f"{prefix}_workspace_bytes")(ctypes.byref(layer_), ctypes.byref(out)))
    else:
        if use not in WORKSPACE_USES:
            raise FusemoeError(f"use must be one of {sorted(WORKSPACE_USES)} or None, got {use!r}")
        _check(getattr(lib, f"{prefix}_workspace_bytes_for")(
            ctypes.byref(layer_), WORKSPACE_USES[use], ctypes.byref(out)))
    return out.value


def _ep_workspace_bytes(config, use):
    return _workspace_bytes(config, use, "fusemoe_c_ep")


def saved_z_bytes(layer_):
    """Bytes of the forward's saved pre-activations for a Layer."""
    lib = load()
    out = _u64()
    _check(lib.fusemoe_c_saved_z_bytes(ctypes.byref(layer_), ctypes.byref(out)))
    return out.value


def forward(layer_, x, topk_idx, topk_weights, w13, w2, y, num_tokens, workspace,
            workspace_bytes_, expert_id_report, saved_z, stream, fp8_weights=None,
            caller_checked_pointers=False, w1=None, w3=None):
    """Pointers are ints (data_ptr(); expert_id_report and saved_z may be None); stream is a
    cudaStream_t as an int. A layer of precision "fp8" takes fp8_weights (the buffer of
    quantize_weights_fp8) and w13 = w2 = None. Separate gate and up weights: w13 = None and
    w1, w3 set. caller_checked_pointers: every pointer is known to be device memory of the
    current device (tensors whose devices were checked), so the library skips its CUDA pointer
    queries."""
    args = ForwardArgs(struct_size=_FORWARD_SIZE, x=x, topk_idx=topk_idx,
                       topk_weights=topk_weights, w13=w13, w2=w2, w1=w1, w3=w3,
                       fp8_weights=fp8_weights, y=y, num_tokens=num_tokens, workspace=workspace,
                       workspace_bytes=workspace_bytes_, expert_id_report=expert_id_report,
                       saved_z=saved_z, stream=stream,
                       caller_checked_pointers=int(caller_checked_pointers))
    _check(load().fusemoe_c_forward(layer_, args))


def backward(layer_, x, topk_idx, topk_weights, w13, w2, dy, dx, d_topk_weights, dw13, dw2,
             weight_grad_dtype, accumulate, num_tokens, workspace, workspace_bytes_,
             expert_id_report, saved_z, stream, fp8_weights=None, caller_checked_pointers=False,
             w1=None, w3=None, dw1=None, dw3=None):
    """As forward(); separate gate and up gradients: dw13 = None and dw1, dw3 set."""
    args = BackwardArgs(struct_size=_BACKWARD_SIZE, weight_grad_dtype=weight_grad_dtype, x=x,
                        topk_idx=topk_idx, topk_weights=topk_weights, w13=w13, w2=w2, w1=w1,
                        w3=w3, fp8_weights=fp8_weights, dy=dy, dx=dx,
                        d_topk_weights=d_topk_weights, dw13=dw13, dw2=dw2, dw1=dw1, dw3=dw3,
                        accumulate_weight_grads=1 if accumulate else 0, num_tokens=num_tokens,
                        workspace=workspace, workspace_bytes=workspace_bytes_,
                        expert_id_report=expert_id_report, saved_z=saved_z, stream=stream,
                        caller_checked_pointers=int(caller_checked_pointers))
    _check(load().fusemoe_c_backward(layer_, args))


def fp8_weights_bytes(layer_):
    """Bytes of the FP8 weight buffer of a Layer's shape (cached on the struct)."""
    num_bytes = layer_.__dict__.get("_fp8_weights_bytes")
    if num_bytes is None:
        lib = load()
        out = _u64()
        _check(lib.fusemoe_c_fp8_weights_bytes(ctypes.byref(layer_), ctypes.byref(out)))
        num_bytes = layer_.__dict__.setdefault("_fp8_weights_bytes", out.value)
    return num_bytes


def quantize_weights_fp8(layer_, w13, w2, buffer, buffer_bytes, stream, w1=None, w3=None):
    """Quantizes bf16 w13 (or w1 and w3, with w13 None) and w2 into the FP8 weight buffer
    (pointers as ints), on stream."""
    lib = load()
    args = Fp8QuantizeArgs(struct_size=_FP8_QUANTIZE_SIZE, w13=w13, w2=w2, w1=w1, w3=w3,
                           buffer=buffer, buffer_bytes=buffer_bytes, stream=stream)
    _check(lib.fusemoe_c_quantize_weights_fp8(ctypes.byref(layer_), args))


@functools.lru_cache(maxsize=64)
def ep_config(hidden, intermediate, num_experts, top_k, max_tokens, world_size, rank,
              swiglu_clamp=None, precision="bf16"):
    """The FusemoeCEpConfig of one rank of an expert-parallel layer (GLOBAL num_experts;
    max_tokens bounds every rank's T; precision a key of PRECISIONS), built once and cached. The
    library checks the values when a call uses it; symmetric_bytes and saved_state_bytes (and at
    "fp8" fp8_weights_bytes, the rank's FP8 weight buffer) are queried here, so a bad config fails
    now with the library's message."""
    if precision not in PRECISIONS:
        raise FusemoeError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    clamp_on = swiglu_clamp is not None
    built = EpConfig(ctypes.sizeof(EpConfig), world_size, rank,
                     Layer(ctypes.sizeof(Layer), 0, hidden, intermediate, num_experts, top_k,
                           max_tokens, int(clamp_on), float(swiglu_clamp) if clamp_on else 0.0,
                           PRECISIONS[precision]))
    built.precision = precision
    lib = load()
    sizes = ("symmetric_bytes", "saved_state_bytes") + (("fp8_weights_bytes",)
                                                        if precision == "fp8" else ())
    for name in sizes:
        out = _u64()
        _check(getattr(lib, f"fusemoe_c_ep_{name}")(ctypes.byref(built), ctypes.byref(out)))
        setattr(built, name, out.value)
    return built


def ep_fp8_weights_bytes(config):
    """Bytes of the rank's FP8 weight buffer of an EpConfig (of any precision)."""
    lib = load()
    out = _u64()
    _check(lib.fusemoe_c_ep_fp8_weights_bytes(ctypes.byref(config), ctypes.byref(out)))
    return out.value


def ep_quantize_weights_fp8(config, w13, w2, buffer, buffer_bytes, stream):
    """Quantizes the rank's bf16 w13 [L, 2I, H] and w2 [L, H, I] into its FP8 weight buffer
    (pointers as ints), on stream: the buffer quantize_weights_fp8 makes for the L local experts."""
    lib = load()
    args = Fp8QuantizeArgs(struct_size=_FP8_QUANTIZE_SIZE, w13=w13, w2=w2, w1=None, w3=None,
                           buffer=buffer, buffer_bytes=buffer_bytes, stream=stream)
    _check(lib.fusemoe_c_ep_quantize_weights_fp8(ctypes.byref(config), args))


def ep_forward(config, x, topk_idx, topk_weights, w13, w2, y, num_tokens, peer_symmetric,
               workspace, workspace_bytes_, expert_id_report, saved_state, stream, num_sms=0,
               fp8_weights=None):
    """Pointers are ints (data_ptr(); expert_id_report and saved_state may be None);
    peer_symmetric is the address of the host array of the R ranks' symmetric workspaces. A config
    of precision "fp8" takes fp8_weights (the buffer of ep_quantize_weights_fp8) and w13 = w2 =
    None."""
    args = EpForwardArgs(_EP_FORWARD_SIZE, num_sms, x, topk_idx, topk_weights, w13, w2,
                         fp8_weights, y, num_tokens, peer_symmetric, workspace, workspace_bytes_,
                         expert_id_report, saved_state, stream)
    _check(load().fusemoe_c_ep_forward(config, args))


def ep_backward(config, x, topk_idx, topk_weights, w13, w2, dy, dx, d_topk_weights, dw13, dw2,
                weight_grad_dtype, accumulate, num_tokens, peer_symmetric, workspace,
                workspace_bytes_, expert_id_report, saved_state, stream, num_sms=0,
                fp8_weights=None):
    """As ep_forward()."""
    args = EpBackwardArgs(_EP_BACKWARD_SIZE, weight_grad_dtype, x, topk_idx, topk_weights, w13,
                          w2, fp8_weights, dy, dx, d_topk_weights, dw13, dw2,
                          1 if accumulate else 0, num_sms,
                          num_tokens, peer_symmetric, workspace, workspace_bytes_,
                          expert_id_report, saved_state, stream)
    _check(load().fusemoe_c_ep_backward(config, args))


def check_expert_id_report(report, num_experts, top_k):
    """report: address (int) of 3 host-readable int32; FusemoeError naming the bad id if set."""
    lib = load()
    _check(lib.fusemoe_c_check_expert_id_report(report, num_experts, top_k))


def library_struct_layout(struct_name):
    """The library's own layout of a struct: (sizeof, [(field, offset, size), ...])."""
    lib = load()
    name = struct_name.encode("utf-8")
    size, num_fields = _u64(), _i32()
    _check(lib.fusemoe_c_struct_layout(name, ctypes.byref(size), ctypes.byref(num_fields)))
    fields = []
    for index in range(num_fields.value):
        field, offset, field_size = ctypes.c_char_p(), _u64(), _u64()
        _check(lib.fusemoe_c_struct_field(name, index, ctypes.byref(field), ctypes.byref(offset),
                                          ctypes.byref(field_size)))
        fields.append((field.value.decode("utf-8"), offset.value, field_size.value))
    return size.value, fields


def binding_struct_layout(struct_name):
    """This binding's (ctypes) layout of a struct, in library_struct_layout's form."""
    cls = STRUCTS[struct_name]
    return ctypes.sizeof(cls), [(name, getattr(cls, name).offset, getattr(cls, name).size)
                                for name, _ in cls._fields_]
