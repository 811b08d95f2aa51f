"""The native binding (libfusemoe_torch.so, src/torch_binding) and its ctypes fallback.

Without a GPU: the binding loads when it was built (FUSEMOE_REQUIRE_NATIVE=1, which
scripts/run_tests.sh sets after building it, turns its absence into a failure); its ops have the
schemas that the ctypes path's Python definitions give; its C++ checks raise the ValueError of
those definitions with the very same message (each case runs through both); a native failure
other than a bad argument reaches fusemoe's entry points as FusemoeError; and in a fresh process
the ctypes fallback defines working ops and says why it is in use. On an sm_90 GPU: the checks
that need CUDA tensors (weight gradients, saved z, the FP8 buffer) agree the same way.
Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k.
"""
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
import fusemoe.fp8  # noqa: E402,F401  (defines the FP8 ops)
from conftest import require_gpu  # noqa: E402
from fusemoe import _capi, _native, ops  # noqa: E402
from moe_reference import make_problem  # noqa: E402

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
# The backend slot the tests call the C++ kernel through: the CPU slot holds the CPU stand-ins
# of moe_reference.py, every other backend the binding's CompositeExplicitAutograd kernel.
NATIVE_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def require_native():
    if _native.LOADED:
        return
    reason = f"skipped: the native binding is not in use ({_native.status()})"
    if os.environ.get("FUSEMOE_REQUIRE_NATIVE") == "1":
        pytest.fail(f"FUSEMOE_REQUIRE_NATIVE=1 but {reason}")
    pytest.skip(reason)


def test_binding_loads_where_it_was_built():
    if os.path.isfile(_native.library_path()) and os.environ.get("FUSEMOE_NATIVE") != "0":
        assert _native.LOADED, _native.status()
    require_native()
    assert fusemoe.native_binding_status().startswith(f"native: {_native.library_path()}")
    for name in ops._CTYPES_OPS:
        qualname = f"fusemoe::{name}"
        assert torch._library.custom_ops._maybe_get_opdef(qualname) is None, name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeExplicitAutograd")


def test_schemas_match_the_ctypes_definitions():
    """The C++ schemas are the ones torch.library.custom_op infers from the Python definitions
    that the ctypes path registers: the same ops on both paths."""
    require_native()
    from torch._library.infer_schema import infer_schema
    assert sorted(ops._CTYPES_OPS) == sorted(
        ["moe_experts_forward", "moe_experts_backward", "moe_experts_backward_into",
         "moe_experts_fp8_forward", "moe_experts_fp8_backward", "moe_experts_fp8_backward_into",
         "quantize_weights_fp8", "moe_experts_w1w3_forward", "moe_experts_w1w3_backward",
         "moe_experts_w1w3_backward_into", "quantize_weights_fp8_w1w3",
         "moe_experts_w1w3_fp8_forward", "moe_experts_w1w3_fp8_backward",
         "moe_experts_w1w3_fp8_backward_into"])
    for name, (definition, mutates_args) in ops._CTYPES_OPS.items():
        native = str(getattr(torch.ops.fusemoe, name).default._schema)
        assert native == f"fusemoe::{name}" + infer_schema(definition, mutates_args=mutates_args)


def both_raise_the_same(name, *args):
    """Runs op `name` on args through the C++ kernel and through its ctypes path's Python
    definition, each as fusemoe's entry points call ops (ops._call): both must raise ValueError
    with the same message, which is returned."""
    messages = []
    for run in (lambda: getattr(torch.ops.fusemoe, name).default.redispatch(NATIVE_KEYS, *args),
                lambda: ops._CTYPES_OPS[name][0](*args)):
        with pytest.raises(ValueError) as raised:
            ops._call(run)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]
    return messages[0]


SHAPE = dict(num_tokens=37, hidden=128, intermediate=64, num_experts=6, top_k=2)


def forward_args(p):
    return [p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], p["w13_EFH"], p["w2_EHI"]]


INPUT_CASES = {  # the inputs [x, topk_idx, topk_weights, w13, w2] -> the start of the message
    "x dtype": (lambda a: a.__setitem__(0, a[0].float()), "x (hidden_states) must be torch.bfloat16"),
    "topk_idx dtype": (lambda a: a.__setitem__(1, a[1].long()), "topk_idx must be torch.int32"),
    "topk_weights dtype": (lambda a: a.__setitem__(2, a[2].bfloat16()),
                           "topk_weights must be torch.float32"),
    "w13 dtype": (lambda a: a.__setitem__(3, a[3].float()), "w13 (gate_up_proj) must be torch.bfloat16"),
    "x strided": (lambda a: a.__setitem__(0, a[0][:, :64]), "x (hidden_states) must be contiguous"),
    "x rank": (lambda a: a.__setitem__(0, a[0][None]), "x (hidden_states) must have 2 dimensions"),
    "w2 rank 1": (lambda a: a.__setitem__(4, a[4].flatten()[:5]), "w2 (down_proj) must have 3 dimensions"),
    "topk_idx rows": (lambda a: a.__setitem__(1, a[1][:5]), "topk_idx must be [T, K] with T = x.shape[0]"),
    "topk_weights shape": (lambda a: a.__setitem__(2, a[2][:, :1].contiguous()),
                           "topk_weights must have the shape"),
    "w13 shape": (lambda a: a.__setitem__(3, a[3][:, :, :64].contiguous()),
                  "w13 (gate_up_proj) must be [E, 2I, H]"),
    "w2 shape": (lambda a: a.__setitem__(4, a[4][:, :, :32].contiguous()), "w2 (down_proj) must be [E, H, I]"),
    "device": (lambda a: a.__setitem__(3, a[3].to("meta")), "w13 (gate_up_proj) is on meta but x is on cpu"),
    "not cuda": (lambda a: None, "tensors must be on a CUDA device, got cpu"),
}


@pytest.mark.parametrize("case", INPUT_CASES, ids=INPUT_CASES)
def test_cpp_checks_raise_the_python_messages(case):
    """Each bad input through the forward, the backward and the backward_into op (bf16 and FP8):
    the C++ kernel and the Python definition raise the same ValueError."""
    require_native()
    mutate, expected = INPUT_CASES[case]
    p = make_problem(**SHAPE, device="cpu")
    args = forward_args(p)
    mutate(args)
    dy = p["dy_TH"]
    fp8_weights = torch.empty(16, dtype=torch.uint8)
    grads = (torch.empty_like(p["w13_EFH"]), torch.empty_like(p["w2_EHI"]))
    calls = [("moe_experts_forward", (*args, "fused", False, False, None)),
             ("moe_experts_fp8_forward", (*args, fp8_weights, "fused", False, False, None)),
             ("moe_experts_backward", (dy, *args, "fused", None, None)),
             ("moe_experts_backward_into", (dy, *args, *grads, False, "fused", None, None)),
             ("moe_experts_fp8_backward", (dy, *args, fp8_weights, "fused", None, None)),
             ("moe_experts_fp8_backward_into", (dy, *args, fp8_weights, *grads, True, "fused", None,
                                                None))]
    for name, call_args in calls:
        message = both_raise_the_same(name, *call_args)
        assert message.startswith(f"fusemoe.moe_experts: {expected}"), (name, message)


W1W3_CASES = {  # the inputs [x, topk_idx, topk_weights, w1, w3, w2, dy] -> the message's start
    "w1 dtype": (lambda a: a.__setitem__(3, a[3].float()), "w1 (gate) must be torch.bfloat16"),
    "w3 strided": (lambda a: a.__setitem__(4, a[4].transpose(1, 2)), "w3 (up) must be contiguous"),
    "w1 hidden": (lambda a: a.__setitem__(3, a[3][:, :, :64].contiguous()),
                  "w1 (gate) must be [E, I, H] with H = x.shape[1] = 128, got (6, 64, 64)"),
    "w3 shape": (lambda a: a.__setitem__(4, a[4][:, :32].contiguous()),
                 "w3 (up) must have the shape of w1 (gate) (6, 64, 128), got (6, 32, 128)"),
    "w2 shape": (lambda a: a.__setitem__(5, a[5][:, :, :32].contiguous()),
                 "w2 (down) must be [E, H, I] = (6, 128, 64) to match w1 (6, 64, 128), got (6, 128, 32)"),
    "topk_idx rows": (lambda a: a.__setitem__(1, a[1][:5]), "topk_idx must be [T, K] with T = x.shape[0]"),
    "device": (lambda a: a.__setitem__(4, a[4].to("meta")), "w3 (up) is on meta but x is on cpu"),
    "dy shape": (lambda a: a.__setitem__(6, a[6][:5].contiguous()), "dy must have the shape of x"),
    "not cuda": (lambda a: None, "tensors must be on a CUDA device, got cpu"),
}


@pytest.mark.parametrize("case", W1W3_CASES, ids=W1W3_CASES)
def test_cpp_checks_of_separate_gate_up(case):
    """fusemoe.separate's ops (bf16 and FP8, backward and backward_into): the C++ kernel and the
    Python definition raise the same ValueError, naming fusemoe.moe_experts_w1w3 (dy's case
    through the backward ops only)."""
    require_native()
    mutate, expected = W1W3_CASES[case]
    p = make_problem(**SHAPE, device="cpu")
    intermediate = SHAPE["intermediate"]
    w1, w3 = (t.contiguous() for t in p["w13_EFH"].split(intermediate, dim=1))
    grads = tuple(torch.empty_like(w) for w in (w1, w3, p["w2_EHI"]))
    fp8_weights = torch.empty(16, dtype=torch.uint8)
    args = [p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], w1, w3, p["w2_EHI"], p["dy_TH"]]
    mutate(args)
    dy, inputs = args[6], args[:6]
    calls = [("moe_experts_w1w3_backward", (dy, *inputs, "fused", None, None)),
             ("moe_experts_w1w3_backward_into", (dy, *inputs, *grads, True, "fused", None, None)),
             ("moe_experts_w1w3_fp8_backward", (dy, *inputs, fp8_weights, "fused", None, None)),
             ("moe_experts_w1w3_fp8_backward_into", (dy, *inputs, fp8_weights, *grads, False,
                                                     "fused", None, None))]
    if case != "dy shape":
        calls += [("moe_experts_w1w3_forward", (*inputs, "fused", False, False, None)),
                  ("moe_experts_w1w3_fp8_forward", (*inputs, fp8_weights, "fused", False, False,
                                                    None))]
    for name, call_args in calls:
        message = both_raise_the_same(name, *call_args)
        assert message.startswith(f"fusemoe.moe_experts_w1w3: {expected}"), (name, message)


@pytest.mark.parametrize("mutate, expected", [
    (lambda a: a.__setitem__(1, a[1].float()), "dy (grad of the output) must be torch.bfloat16, got torch.float32"),
    (lambda a: a.__setitem__(1, a[1][:5].contiguous()), "dy must have the shape of x (37, 128), got (5, 128)"),
])
def test_cpp_checks_of_dy(mutate, expected):
    require_native()
    p = make_problem(**SHAPE, device="cpu")
    args = [None, p["dy_TH"], *forward_args(p)]
    mutate(args)
    message = both_raise_the_same("moe_experts_backward", *args[1:], "unfused", None, None)
    assert message == f"fusemoe.moe_experts: {expected}"


@pytest.mark.parametrize("shape, expected", [
    ((6, 128, 128), "precision=\"fp8\" needs hidden and intermediate to be multiples of 128, got H=128, I=64"),
    ((6, 256, 128), "w2 (down_proj) must be [E, H, I] = (6, 128, 128) to match w13 (6, 256, 128), "
                    "got (6, 128, 64)"),
])
def test_cpp_checks_of_the_weight_quantization(shape, expected):
    require_native()
    w13 = torch.zeros(shape, dtype=torch.bfloat16)
    w2 = torch.zeros(6, 128, 64, dtype=torch.bfloat16)
    assert both_raise_the_same("quantize_weights_fp8", w13, w2) == f"fusemoe.moe_experts: {expected}"


@pytest.mark.parametrize("shapes, expected", [
    (((6, 64, 128), (6, 64, 128), (6, 128, 64)),
     "precision=\"fp8\" needs hidden and intermediate to be multiples of 128, got H=128, I=64"),
    (((6, 128, 128), (6, 64, 128), (6, 128, 128)),
     "w3 (up) must have the shape of w1 (gate) (6, 128, 128), got (6, 64, 128)"),
    (((6, 128, 128), (6, 128, 128), (6, 128, 64)),
     "w2 (down) must be [E, H, I] = (6, 128, 128) to match w1 (6, 128, 128), got (6, 128, 64)"),
    (((6, 128, 128), (6, 128, 128), (6, 128, 128)), "tensors must be on a CUDA device, got cpu"),
])
def test_cpp_checks_of_the_w1w3_weight_quantization(shapes, expected):
    require_native()
    weights = [torch.zeros(shape, dtype=torch.bfloat16) for shape in shapes]
    message = both_raise_the_same("quantize_weights_fp8_w1w3", *weights)
    assert message == f"fusemoe.moe_experts_w1w3: {expected}"


def test_native_failures_reach_the_entry_points_as_fusemoe_errors(monkeypatch):
    """ops._call re-raises the binding's own RuntimeError (its thread's last error) as the
    FusemoeError, FusemoeOutOfMemoryError or ValueError of the ctypes path (PyTorch 2.15 raises
    every error of a stable-ABI kernel as RuntimeError); any other error passes."""
    require_native()

    def failing(message):
        def op(*args):
            raise RuntimeError(message)
        return op

    for kind, error_class in ((1, fusemoe.FusemoeError), (2, ops.FusemoeOutOfMemoryError),
                              (3, ValueError)):
        monkeypatch.setattr(_native, "last_error", lambda kind=kind: (kind, "fusemoe error at x: no"))
        with pytest.raises(error_class, match="^fusemoe error at x: no$") as raised:
            ops._call(failing("fusemoe error at x: no"))
        assert type(raised.value) is error_class
    assert issubclass(ops.FusemoeOutOfMemoryError, torch.OutOfMemoryError)
    with pytest.raises(RuntimeError, match="^another$") as raised:  # not the binding's last error
        ops._call(failing("another"))
    assert not isinstance(raised.value, fusemoe.FusemoeError)


FALLBACK_CHECK = """
import sys, torch, fusemoe, fusemoe.fp8
from torch._subclasses.fake_tensor import FakeTensorMode
status = fusemoe.native_binding_status()
assert status.startswith(sys.argv[1]), status
for name in ("moe_experts_forward", "moe_experts_backward", "moe_experts_backward_into",
             "moe_experts_fp8_forward", "quantize_weights_fp8"):
    assert torch._library.custom_ops._maybe_get_opdef("fusemoe::" + name) is not None, name
T, H, I, E, K = 37, 128, 128, 6, 2
with FakeTensorMode():
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.zeros(T, K, dtype=torch.int32)
    w = torch.rand(T, K)
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16)
    for precision in ("bf16", "fp8"):
        y = fusemoe.moe_experts(x, idx, w, w13, w2, precision=precision)
        y.float().sum().backward()
        assert y.shape == (T, H) and x.grad.shape == (T, H) and w13.grad.shape == w13.shape
    try:
        fusemoe.moe_experts(x, idx.long(), w, w13, w2)
    except ValueError as e:
        assert "topk_idx must be torch.int32" in str(e), e
    else:
        raise AssertionError("no ValueError for int64 topk_idx")
print(status)
"""


def run_fallback(env_changes, expected_status):
    """FALLBACK_CHECK in a fresh process (the path is chosen once, at import) with env_changes."""
    env = {k: v for k, v in os.environ.items() if k != "FUSEMOE_NATIVE"}
    if os.environ.get("FUSEMOE_TEST_INSTALLED") != "1":  # as conftest.py: python/ of this checkout
        env["PYTHONPATH"] = PYTHON_DIR
    env.update(env_changes)
    result = subprocess.run([sys.executable, "-c", FALLBACK_CHECK, expected_status], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def test_ctypes_fallback_when_disabled():
    """FUSEMOE_NATIVE=0: the ops are the Python definitions over ctypes, and work (fake tensors,
    autograd, both precisions, the same checks)."""
    run_fallback({"FUSEMOE_NATIVE": "0"}, "ctypes: FUSEMOE_NATIVE=0")


def test_ctypes_fallback_when_not_built(tmp_path):
    """A C library without the binding beside it (a build where torch was not importable): the
    ctypes path, and the status names where the binding was looked for and how to build it."""
    if not fusemoe.is_available():
        pytest.skip(f"skipped: libfusemoe_c.so not built (looked at {fusemoe.library_path()})")
    library = tmp_path / _capi.LIBRARY_NAME
    shutil.copyfile(_capi.library_path(), library)
    status = run_fallback({"FUSEMOE_LIBRARY": str(library)}, "ctypes: libfusemoe_torch.so not built")
    assert str(tmp_path / _native.LIBRARY_NAME) in status and "--no-build-isolation" in status


# ---- on an sm_90 GPU: the checks behind the CUDA-device check ----

def cuda_problem():
    return make_problem(**SHAPE, device="cuda", seed=3)


@pytest.mark.parametrize("case", ["dw13 dtype", "dw2 strided", "grad dtypes differ", "saved_z shape",
                                  "saved_z needs fused", "save_z needs fused"])
def test_cpp_checks_agree_on_cuda_tensors(case):
    require_gpu()
    require_native()
    p = cuda_problem()
    args = forward_args(p)
    dw13, dw2 = torch.empty_like(p["w13_EFH"]), torch.empty_like(p["w2_EHI"])
    z = torch.empty(SHAPE["num_tokens"] * SHAPE["top_k"], 2 * SHAPE["intermediate"],
                    dtype=torch.bfloat16, device="cuda")
    impl = "fused"
    if case == "dw13 dtype":
        dw13 = dw13.half()
    elif case == "dw2 strided":
        dw2 = dw2.transpose(1, 2)
    elif case == "grad dtypes differ":
        dw13 = dw13.float()
    elif case == "saved_z shape":
        z = z[:-1]
    elif case == "saved_z needs fused":
        impl = "unfused"
    if case == "save_z needs fused":
        both_raise_the_same("moe_experts_forward", *args, "unfused", False, True, None)
        return
    both_raise_the_same("moe_experts_backward_into", p["dy_TH"], *args, dw13, dw2, False, impl, z,
                        None)


def test_cpp_check_of_the_fp8_buffer_on_cuda():
    require_gpu()
    require_native()
    p = make_problem(37, 128, 128, 6, 2, device="cuda", seed=5)
    args = forward_args(p)
    for bad in (torch.empty(16, dtype=torch.uint8, device="cuda"),
                torch.empty(16, dtype=torch.float32, device="cuda")):
        message = both_raise_the_same("moe_experts_fp8_forward", *args, bad, "fused", False, False,
                                      None)
        assert message.startswith("fusemoe.moe_experts: fp8_weights must be the buffer")


W1W3_GRAD_CASES = {  # the gradient buffers [dw1, dw3, dw2] -> the message
    "dw3 shape": (lambda g: g.__setitem__(1, g[1][:, :32].contiguous()),
                  "dw3 must be contiguous, on cuda:0, of shape (6, 64, 128); got (6, 32, 128) on "
                  "cuda:0, strides (4096, 128, 1)"),
    "dw1 dtype": (lambda g: g.__setitem__(0, g[0].half()),
                  "dw1 must be a float32 or bfloat16 tensor, got torch.float16"),
    "one dtype": (lambda g: g.__setitem__(2, g[2].float()),
                  "dw1, dw3 and dw2 must have one dtype, got torch.bfloat16, torch.bfloat16 and "
                  "torch.float32"),
}


@pytest.mark.parametrize("case", W1W3_GRAD_CASES, ids=W1W3_GRAD_CASES)
def test_cpp_checks_of_the_w1w3_weight_gradients_on_cuda(case):
    """fusemoe.separate's _into ops (bf16 and FP8): the gradient buffers' checks, behind the
    CUDA-device check, give the same message from C++ and Python."""
    require_gpu()
    require_native()
    mutate, expected = W1W3_GRAD_CASES[case]
    p = cuda_problem()
    w1, w3 = (t.contiguous() for t in p["w13_EFH"].split(SHAPE["intermediate"], dim=1))
    grads = [torch.empty_like(w) for w in (w1, w3, p["w2_EHI"])]
    mutate(grads)
    inputs = (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], w1, w3, p["w2_EHI"])
    fp8_weights = torch.empty(16, dtype=torch.uint8, device="cuda")
    for name, extra in (("moe_experts_w1w3_backward_into", ()),
                        ("moe_experts_w1w3_fp8_backward_into", (fp8_weights,))):
        message = both_raise_the_same(name, p["dy_TH"], *inputs, *extra, *grads, True, "fused",
                                      None, None)
        assert message == f"fusemoe.moe_experts_w1w3: {expected}", name


def test_cpp_check_of_the_w1w3_fp8_buffer_on_cuda():
    require_gpu()
    require_native()
    p = make_problem(37, 128, 128, 6, 2, device="cuda", seed=5)
    w1, w3 = (t.contiguous() for t in p["w13_EFH"].split(128, dim=1))
    inputs = (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], w1, w3, p["w2_EHI"])
    for bad in (torch.empty(16, dtype=torch.uint8, device="cuda"),
                torch.empty(16, dtype=torch.float32, device="cuda")):
        message = both_raise_the_same("moe_experts_w1w3_fp8_forward", *inputs, bad, "fused",
                                      False, False, None)
        assert message.startswith("fusemoe.moe_experts_w1w3: fp8_weights must be the buffer "
                                  "fusemoe.separate.quantize_weights_fp8_w1w3(w1, w3, w2)")
