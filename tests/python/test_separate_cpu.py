"""fusemoe.moe_experts_w1w3 (separate gate and up weights, torchtitan's layout) without a GPU:
argument errors naming the argument, fake kernels, and the op's autograd over the CPU stand-in
kernels of moe_reference.py: the same outputs and gradients as fusemoe.moe_experts on w13 =
[w1; w3], gradients reaching w1 and w3 apart, and no [E, 2I, H] tensor made around the ops (a
concatenation copy would be one). The library itself is tested on the GPU (test_ops_gpu.py,
tests/gpu/test_separate_gate_up.cpp)."""
import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
from moe_reference import make_problem, register_cpu_kernels  # noqa: E402

register_cpu_kernels()

SHAPE = dict(num_tokens=37, hidden=128, intermediate=64, num_experts=6, top_k=2)


def split(w13_EFH):
    intermediate = w13_EFH.shape[1] // 2
    return w13_EFH[:, :intermediate].contiguous(), w13_EFH[:, intermediate:].contiguous()


@pytest.fixture
def problem():
    p = make_problem(**SHAPE, device="cpu")
    p["w1_EIH"], p["w3_EIH"] = split(p["w13_EFH"])
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
    dw1_ref, dw3_ref = split(w13_ref.grad)
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
