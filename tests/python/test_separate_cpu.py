"""fusemoe.moe_experts_w1w3 (separate gate and up weights, torchtitan's layout) without a GPU:
argument errors naming the argument, fake kernels, and the op's autograd over the CPU stand-in
kernels of moe_reference.py: the same outputs and gradients as fusemoe.moe_experts on w13 =
[w1; w3], gradients reaching w1 and w3 apart, and no [E, 2I, H] tensor made around the ops (a
concatenation copy would be one); precision="fp8" (its weight buffer, cache, fake kernels and
autograd) and grad_in_place (two micro-batches accumulate in .grad) equal moe_experts' on
[w1; w3] with the same options. The library itself is tested on the GPU (test_separate_gpu.py,
tests/gpu/test_separate_gate_up.cpp)."""
import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
import fusemoe.separate  # noqa: E402
from moe_reference import (SEPARATE_OUTPUTS, into_accumulate_flags, make_problem,  # noqa: E402
                           register_cpu_fp8_w1w3_kernels, register_cpu_kernels, rel_err,
                           separate_and_w13, split_w13)

register_cpu_kernels()
register_cpu_fp8_w1w3_kernels()

SHAPE = dict(num_tokens=37, hidden=128, intermediate=64, num_experts=6, top_k=2)


@pytest.fixture
def problem():
    p = make_problem(**SHAPE, device="cpu")
    p["w1_EIH"], p["w3_EIH"] = split_w13(p["w13_EFH"])
    return p


def op_args(p):
    return (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], p["w1_EIH"], p["w3_EIH"],
            p["w2_EHI"])


def escaped(message):
    for c in "()[]":
        message = message.replace(c, "\\" + c)
    return message


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.__setitem__(3, a[3].float()), "w1 (gate) must be torch.bfloat16"),
    (lambda a: a.__setitem__(4, a[4].float()), "w3 (up) must be torch.bfloat16"),
    (lambda a: a.__setitem__(3, a[3].transpose(1, 2)), "w1 (gate) must be contiguous"),
    (lambda a: a.__setitem__(4, a[4][:, :32].contiguous()), "w3 (up) must have the shape of w1"),
    (lambda a: a.__setitem__(3, a[3][:, :, :64].contiguous()),
     "w1 (gate) must be [E, I, H] with H = x.shape[1] = 128"),
    (lambda a: a.__setitem__(5, a[5][:, :, :32].contiguous()), "w2 (down) must be [E, H, I]"),
    (lambda a: a.__setitem__(1, a[1][:5]), "topk_idx must be [T, K] with T = x.shape[0] = 37"),
])
def test_validation_names_the_argument(problem, mutate, message):
    args = list(op_args(problem))
    mutate(args)
    with pytest.raises(ValueError, match="fusemoe.moe_experts_w1w3: " + escaped(message)):
        fusemoe.moe_experts_w1w3(*args)


def test_fake_kernels(problem):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in op_args(problem)]
        y = fusemoe.moe_experts_w1w3(*fake)
        assert y.shape == problem["x_TH"].shape and y.dtype == torch.bfloat16
        grads = torch.ops.fusemoe.moe_experts_w1w3_backward(
            mode.from_tensor(problem["dy_TH"]), *fake, "fused")
        assert [tuple(g.shape) for g in grads[2:]] == [
            tuple(t.shape) for t in (problem["w1_EIH"], problem["w3_EIH"], problem["w2_EHI"])]


@pytest.mark.parametrize("recompute_z", [False, True])
def test_same_as_w13_with_gradients_apart(problem, recompute_z):
    """Outputs and gradients equal moe_experts' on w13 = [w1; w3] (the stand-ins compute the
    same math), the w13 gradient split into w1's and w3's."""
    def leaves(*tensors):
        return [t.clone().requires_grad_() for t in tensors]

    x, w, w1, w3, w2 = leaves(problem["x_TH"], problem["topk_weights_TK"], problem["w1_EIH"],
                              problem["w3_EIH"], problem["w2_EHI"])
    idx, dy = problem["topk_idx_TK"], problem["dy_TH"]
    y = fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2, recompute_z=recompute_z)
    y.backward(dy)

    x_ref, w_ref, w13_ref, w2_ref = leaves(problem["x_TH"], problem["topk_weights_TK"],
                                           problem["w13_EFH"], problem["w2_EHI"])
    y_ref = fusemoe.moe_experts(x_ref, idx, w_ref, w13_ref, w2_ref, recompute_z=recompute_z)
    y_ref.backward(dy)
    dw1_ref, dw3_ref = split_w13(w13_ref.grad)
    assert torch.equal(y, y_ref)
    for got, ref in ((x.grad, x_ref.grad), (w.grad, w_ref.grad), (w1.grad, dw1_ref),
                     (w3.grad, dw3_ref), (w2.grad, w2_ref.grad)):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_no_concatenated_weight_is_made(problem):
    """What runs around the ops (autograd, the Python layer) makes no [E, 2I, H] tensor: the
    dispatch mode sees each custom op as one call (its kernel runs below the mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.append(tuple(t.shape))
            return out

    x, idx, w, w1, w3, w2 = op_args(problem)
    w1, w3 = w1.clone().requires_grad_(), w3.clone().requires_grad_()
    with Created() as created:
        y = fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2)
        y.backward(problem["dy_TH"])
    concatenated = tuple(problem["w13_EFH"].shape)
    assert concatenated not in created.shapes
    assert tuple(w1.grad.shape) == tuple(w1.shape) and tuple(w3.grad.shape) == tuple(w3.shape)


def test_compiles_fullgraph(problem):
    def layer(x, idx, w, w1, w3, w2):
        return fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2) * 2

    args = op_args(problem)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), layer(*args))


# ---- precision="fp8" and grad_in_place (FP8 needs H and I multiples of 128) ----

FP8_SHAPE = dict(num_tokens=37, hidden=128, intermediate=128, num_experts=6, top_k=2)


@pytest.fixture
def fp8_problem():
    p = make_problem(**FP8_SHAPE, device="cpu", seed=4)
    p["w1_EIH"], p["w3_EIH"] = split_w13(p["w13_EFH"])
    return p


def assert_bitwise(separate, concatenated):
    for name, got, ref in zip(SEPARATE_OUTPUTS, separate, concatenated):
        assert got.dtype == ref.dtype and torch.equal(got, ref), f"{name} differs from moe_experts'"


@pytest.mark.parametrize("recompute_z", [False, True])
def test_fp8_same_as_w13(fp8_problem, recompute_z):
    """precision="fp8": outputs and gradients equal moe_experts(precision="fp8") on [w1; w3]."""
    assert_bitwise(*separate_and_w13(fp8_problem, precision="fp8", recompute_z=recompute_z))


def test_fp8_weight_buffer_same_as_w13(fp8_problem):
    """quantize_weights_fp8_w1w3 gives the buffer of quantize_weights_fp8 on [w1; w3] (the
    stand-in builds it that way: this checks the op's wiring and size), and an explicit
    fp8_weights is used as given."""
    p = fp8_problem
    buffer = fusemoe.separate.quantize_weights_fp8_w1w3(p["w1_EIH"], p["w3_EIH"], p["w2_EHI"])
    assert torch.equal(buffer, fusemoe.fp8.quantize_weights_fp8(p["w13_EFH"], p["w2_EHI"]))
    args = op_args(p)
    assert torch.equal(fusemoe.moe_experts_w1w3(*args, precision="fp8", fp8_weights=buffer),
                       fusemoe.moe_experts_w1w3(*args, precision="fp8"))


def test_fp8_cache_per_weight_version(fp8_problem):
    """The buffer is cached on w1 per version of w1, w3 and w2 (as moe_experts' on w13, w2): one
    quantization for two calls, a new one after an in-place update of any weight, and never a
    stale buffer (the stand-ins read the weights from it)."""
    p = fp8_problem
    x, idx, w, w1, w3, w2 = (t.clone() for t in op_args(p))
    y = fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2, precision="fp8")
    fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2, precision="fp8")
    cache = w1._fusemoe_fp8_cache_w1w3
    assert cache.quantizations == 1
    for step, weight in enumerate((w3, w2, w1)):
        weight.mul_(0.5)
        got = fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2, precision="fp8")
        assert cache.quantizations == step + 2
        assert torch.equal(got, fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2)), \
            f"a stale FP8 buffer after an update of weight {step}"
        assert not torch.equal(got, y)
    fusemoe.fp8.invalidate_fp8_caches()  # what every optimizer step does
    fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2, precision="fp8")
    assert cache.quantizations == 5


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_grad_in_place_accumulates_as_w13(fp8_problem, precision):
    """grad_in_place over two micro-batches: the _into op is called with accumulate False, then
    True, and .grad of w1, w3, w2 equals moe_experts(grad_in_place=True)'s on [w1; w3] bitwise
    and the sum of the two micro-batches' autograd gradients bitwise (the stand-ins add as the
    kernels do, autograd's bf16 add): a kernel that overwrote would give the second
    micro-batch's alone. x and topk_weights still get theirs through autograd."""
    into_accumulate_flags.clear()
    in_place = separate_and_w13(fp8_problem, micro_batches=2, precision=precision,
                                grad_in_place=True)
    # Per micro-batch the w1/w3 op, then the w13 op (separate_and_w13 interleaves them).
    assert into_accumulate_flags == [False, False, True, True]
    assert_bitwise(*in_place)
    separate, _ = separate_and_w13(fp8_problem, micro_batches=2, precision=precision)
    first, _ = separate_and_w13(fp8_problem, micro_batches=1, precision=precision)
    for name, got, summed, once in zip(SEPARATE_OUTPUTS, in_place[0], separate, first):
        if name in ("dw1", "dw3", "dw2"):  # added as autograd adds (moe_reference.add_into)
            assert torch.equal(got, summed), name
            assert rel_err(got, once) > 0.1, f"{name}: the second micro-batch was not added"
        else:
            assert torch.equal(got, summed), name


def test_grad_in_place_needs_leaf_weights(fp8_problem):
    """A weight that is not a leaf (a converted copy) has no .grad to write: the backward then
    returns the gradients through autograd, as moe_experts does."""
    p = fp8_problem
    w1_param = p["w1_EIH"].float().requires_grad_()
    w3, w2 = (t.clone().requires_grad_() for t in (p["w3_EIH"], p["w2_EHI"]))
    y = fusemoe.moe_experts_w1w3(p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"],
                                 w1_param.bfloat16(), w3, w2, grad_in_place=True)
    y.backward(p["dy_TH"])
    assert w1_param.grad is not None and w3.grad is not None and w2.grad is not None
    ref = separate_and_w13(p)[1]
    assert torch.equal(w1_param.grad, ref[3].float()) and torch.equal(w3.grad, ref[4])


@pytest.mark.parametrize("options, message", [
    (dict(precision="fp16"), 'precision must be "bf16" or "fp8", got \'fp16\''),
    (dict(precision="fp8", impl="unfused"), 'precision="fp8" needs impl="fused"'),
    (dict(precision="fp8", fp8_weights=torch.empty(16, dtype=torch.uint8)),
     "fp8_weights must be the buffer fusemoe.separate.quantize_weights_fp8_w1w3(w1, w3, w2) "
     "returned"),
])
def test_fp8_errors_name_the_entry_point(fp8_problem, options, message):
    with pytest.raises(ValueError, match="fusemoe.moe_experts_w1w3: " + escaped(message)):
        fusemoe.moe_experts_w1w3(*op_args(fp8_problem), **options)


def test_fp8_needs_multiples_of_128(problem):
    """I = 64: refused naming the sizes, also under fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    message = "fusemoe.moe_experts_w1w3: " + escaped(
        'precision="fp8" needs hidden and intermediate to be multiples of 128, got H=128, I=64')
    with pytest.raises(ValueError, match=message):
        fusemoe.moe_experts_w1w3(*op_args(problem), precision="fp8")
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in op_args(problem)]
        with pytest.raises(ValueError, match=message):
            fusemoe.moe_experts_w1w3(*fake, precision="fp8")


@pytest.mark.parametrize("mutate, message", [
    (lambda g: g.__setitem__(1, g[1][:, :32].contiguous()),
     "dw3 must be contiguous, on cpu, of shape (6, 128, 128); got (6, 32, 128)"),
    (lambda g: g.__setitem__(0, g[0].half()),
     "dw1 must be a float32 or bfloat16 tensor, got torch.float16"),
    (lambda g: g.__setitem__(2, g[2].float()),
     "dw1, dw3 and dw2 must have one dtype, got torch.bfloat16, torch.bfloat16 and torch.float32"),
])
def test_backward_into_checks_name_the_gradient(fp8_problem, mutate, message):
    """The _into ops' gradient buffers, through the fake kernels and the CPU stand-ins."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    p = fp8_problem
    grads = [torch.empty_like(w) for w in (p["w1_EIH"], p["w3_EIH"], p["w2_EHI"])]
    mutate(grads)
    buffer = fusemoe.separate.quantize_weights_fp8_w1w3(p["w1_EIH"], p["w3_EIH"], p["w2_EHI"])
    calls = [(torch.ops.fusemoe.moe_experts_w1w3_backward_into, ()),
             (torch.ops.fusemoe.moe_experts_w1w3_fp8_backward_into, (buffer,))]
    for op, extra in calls:
        args = (p["dy_TH"], *op_args(p), *extra, *grads, True, "fused")
        with pytest.raises(ValueError, match="fusemoe.moe_experts_w1w3: " + escaped(message)):
            fusemoe.ops._call(op, *args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
            with pytest.raises(ValueError, match="fusemoe.moe_experts_w1w3: " + escaped(message)):
                op(*fake)


def test_fp8_fake_kernels(fp8_problem):
    """precision="fp8" traces through its fake kernels (buffer, forward, backward, _into)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    p = fp8_problem
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in op_args(p)]
        leaves = [fake[0].requires_grad_(), fake[3].requires_grad_(), fake[4].requires_grad_()]
        y = fusemoe.moe_experts_w1w3(*fake, precision="fp8", swiglu_clamp=0.5)
        assert y.shape == p["x_TH"].shape and y.dtype == torch.bfloat16
        grads = torch.autograd.grad(y.float().sum(), leaves)
        assert [g.shape for g in grads] == [t.shape for t in leaves]
        buffer = torch.ops.fusemoe.quantize_weights_fp8_w1w3(*fake[3:])
        assert buffer.numel() == fusemoe.fp8.fp8_weights_bytes(6, 128, 128)
        dy = mode.from_tensor(p["dy_TH"])
        outs = torch.ops.fusemoe.moe_experts_w1w3_fp8_backward_into(
            dy, *fake, buffer, *(torch.empty_like(t) for t in fake[3:]), False, "fused")
        assert [o.shape for o in outs] == [fake[0].shape, fake[2].shape]


def test_compiles_fullgraph_fp8(fp8_problem):
    """precision="fp8" compiled (the buffer quantized in the graph on every call) equals eager,
    forward and backward."""
    def layer(x, idx, w, w1, w3, w2):
        return fusemoe.moe_experts_w1w3(x, idx, w, w1, w3, w2, precision="fp8") * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (layer, compiled):
        args = [t.clone().requires_grad_() if t.is_floating_point() else t
                for t in op_args(fp8_problem)]
        y = fn(*args)
        y.backward(fp8_problem["dy_TH"])
        outs.append([y] + [t.grad for t in args if t.is_floating_point()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
