"""fusemoe.moe_experts_w1w3 on an sm_90 GPU (skipped elsewhere; see conftest.py): the output and
every gradient bitwise equal to fusemoe.moe_experts on w13 = [w1; w3] (the library reads the same
tiles from two tensors), with z saved and recomputed, masked slots, T = 0; the cuBLAS impl is
refused with the library's message; torch.library.opcheck on the ops. precision="fp8": the weight
buffer of quantize_weights_fp8_w1w3 byte-equal to quantize_weights_fp8's on w13, and every output
and gradient bitwise moe_experts(precision="fp8")'s on w13; grad_in_place (bf16 and FP8): two
micro-batches into .grad bitwise moe_experts(grad_in_place=True)'s on w13, the first bitwise
autograd's, the sum within 4e-3 of the exact one (a kernel that overwrote would miss it).
Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k."""
import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
import fusemoe.fp8  # noqa: E402
import fusemoe.separate  # noqa: E402
from conftest import require_gpu  # noqa: E402
from moe_reference import (SEPARATE_OUTPUTS, make_problem, rel_err,  # noqa: E402
                           separate_and_w13, split_w13)


@pytest.fixture(autouse=True)
def gpu():
    require_gpu()


def gradients(layer, inputs, dy_TH):
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    y_TH = layer(*leaves)
    y_TH.backward(dy_TH)
    return [y_TH.detach()] + [t.grad for t in leaves if t.is_floating_point()]


@pytest.mark.parametrize("num_tokens", [0, 1, 199, 2048])
@pytest.mark.parametrize("recompute_z", [False, True])
def test_bitwise_equal_to_w13(num_tokens, recompute_z):
    p = make_problem(num_tokens=num_tokens, hidden=512, intermediate=256, num_experts=16, top_k=4,
                     device="cuda", seed=num_tokens)
    if num_tokens > 1:
        p["topk_idx_TK"][::5, 1] = -1  # masked slots
    w1_EIH, w3_EIH = split_w13(p["w13_EFH"])
    x, idx, w, w2, dy = (p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w2_EHI", "dy_TH"))
    separate = gradients(lambda x, w, w1, w3, w2: fusemoe.moe_experts_w1w3(
        x, idx, w, w1, w3, w2, recompute_z=recompute_z), [x, w, w1_EIH, w3_EIH, w2], dy)
    concatenated = gradients(lambda x, w, w13, w2: fusemoe.moe_experts(
        x, idx, w, w13, w2, recompute_z=recompute_z), [x, w, p["w13_EFH"], w2], dy)
    y, dx, dw, dw1, dw3, dw2 = separate
    y_ref, dx_ref, dw_ref, dw13_ref, dw2_ref = concatenated
    dw1_ref, dw3_ref = split_w13(dw13_ref)
    for name, got, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("d_topk_weights", dw, dw_ref),
                           ("dw1", dw1, dw1_ref), ("dw3", dw3, dw3_ref), ("dw2", dw2, dw2_ref)):
        assert torch.equal(got, ref), f"{name} differs from the w13 call"


def test_unfused_is_refused():
    p = make_problem(num_tokens=7, hidden=256, intermediate=128, num_experts=8, top_k=2,
                     device="cuda")
    w1_EIH, w3_EIH = split_w13(p["w13_EFH"])
    with pytest.raises(fusemoe.FusemoeError, match="not supported yet by impl unfused"):
        fusemoe.moe_experts_w1w3(p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], w1_EIH,
                                 w3_EIH, p["w2_EHI"], impl="unfused")


def test_opcheck():
    p = make_problem(num_tokens=33, hidden=256, intermediate=128, num_experts=8, top_k=2,
                     device="cuda")
    w1_EIH, w3_EIH = split_w13(p["w13_EFH"])
    args = (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"].clone().requires_grad_(),
            w1_EIH.requires_grad_(), w3_EIH.requires_grad_(), p["w2_EHI"].clone().requires_grad_(),
            "fused")
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_w1w3_forward, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def fp8_problem(num_tokens, seed=0):
    p = make_problem(num_tokens=num_tokens, hidden=512, intermediate=256, num_experts=16,
                     top_k=4, device="cuda", seed=seed)
    if num_tokens > 1:
        p["topk_idx_TK"][::5, 1] = -1  # masked slots
    p["w1_EIH"], p["w3_EIH"] = split_w13(p["w13_EFH"])
    return p


def test_fp8_weight_buffer_bytewise_equal_to_w13():
    p = fp8_problem(1)
    from_w1_w3 = fusemoe.separate.quantize_weights_fp8_w1w3(p["w1_EIH"], p["w3_EIH"], p["w2_EHI"])
    from_w13 = fusemoe.fp8.quantize_weights_fp8(p["w13_EFH"], p["w2_EHI"])
    assert from_w1_w3.dtype == torch.uint8 and torch.equal(from_w1_w3, from_w13)


@pytest.mark.parametrize("num_tokens", [0, 1, 199, 2048])
@pytest.mark.parametrize("recompute_z", [False, True])
def test_fp8_bitwise_equal_to_w13(num_tokens, recompute_z):
    """precision="fp8" (the cached buffer of each form): every output and gradient bitwise the
    w13 call's."""
    separate, concatenated = separate_and_w13(fp8_problem(num_tokens, seed=num_tokens + 1), 1,
                                              precision="fp8", recompute_z=recompute_z)
    for name, got, ref in zip(SEPARATE_OUTPUTS, separate, concatenated):
        assert torch.equal(got, ref), f"{name} differs from the w13 call at FP8"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_grad_in_place_bitwise_equal_to_w13(precision):
    """grad_in_place over two micro-batches: .grad of w1, w3, w2 bitwise the w13 call's (the
    library writes, then adds, the same values into two tensors instead of one); x and
    topk_weights through autograd, bitwise."""
    separate, concatenated = separate_and_w13(fp8_problem(199, seed=21), 2, precision=precision,
                                              grad_in_place=True)
    for name, got, ref in zip(SEPARATE_OUTPUTS, separate, concatenated):
        assert got.dtype == ref.dtype and torch.equal(got, ref), f"{name} differs ({precision})"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_grad_in_place_accumulates(precision):
    """The first micro-batch writes .grad bitwise autograd's; the second adds in the kernel (one
    rounding of fp32 + bf16 .grad): within 4e-3 of the exact sum of the two autograd gradients,
    which a kernel that overwrote would miss by far."""
    p = fp8_problem(199, seed=22)
    once, _ = separate_and_w13(p, 1, precision=precision)
    first, _ = separate_and_w13(p, 1, precision=precision, grad_in_place=True)
    twice, _ = separate_and_w13(p, 2, precision=precision, grad_in_place=True)
    flipped = dict(p, x_TH=p["x_TH"].flip(0).contiguous())
    second, _ = separate_and_w13(flipped, 1, precision=precision)
    for i, name in enumerate(SEPARATE_OUTPUTS[3:], start=3):
        assert torch.equal(first[i], once[i]), f"{name}: first micro-batch differs from autograd"
        exact = once[i].float() + second[i].float()
        err = rel_err(twice[i], exact)
        assert err < 4e-3, f"{name}: accumulated weight gradient rel err {err:.2e} ({precision})"


def test_fp8_cache_once_per_weight_version():
    p = fp8_problem(64, seed=23)
    w1, w3, w2 = (p[k].clone() for k in ("w1_EIH", "w3_EIH", "w2_EHI"))
    args = (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"])
    first = fusemoe.moe_experts_w1w3(*args, w1, w3, w2, precision="fp8")
    assert torch.equal(fusemoe.moe_experts_w1w3(*args, w1, w3, w2, precision="fp8"), first)
    assert w1._fusemoe_fp8_cache_w1w3.quantizations == 1
    w3.mul_(0.5)
    changed = fusemoe.moe_experts_w1w3(*args, w1, w3, w2, precision="fp8")
    assert w1._fusemoe_fp8_cache_w1w3.quantizations == 2
    w13 = torch.cat([w1, w3], dim=1)
    assert torch.equal(changed, fusemoe.moe_experts(*args, w13, w2, precision="fp8"))


def test_opcheck_fp8_and_into():
    p = make_problem(num_tokens=33, hidden=256, intermediate=128, num_experts=8, top_k=2,
                     device="cuda")
    w1_EIH, w3_EIH = split_w13(p["w13_EFH"])
    weights = (w1_EIH, w3_EIH, p["w2_EHI"])
    buffer = fusemoe.separate.quantize_weights_fp8_w1w3(*weights)
    inputs = (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"])
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    leaves = (p["topk_weights_TK"].clone().requires_grad_(),
              *(w.clone().requires_grad_() for w in weights))
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_w1w3_fp8_forward,
                          (inputs[0], inputs[1], *leaves, buffer, "fused"), test_utils=utils)
    torch.library.opcheck(torch.ops.fusemoe.quantize_weights_fp8_w1w3, weights,
                          test_utils=("test_schema", "test_faketensor"))
    grads = tuple(torch.zeros_like(w) for w in weights)
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_w1w3_backward_into,
                          (p["dy_TH"], *inputs, *weights, *grads, True, "fused"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_w1w3_fp8_backward_into,
                          (p["dy_TH"], *inputs, *weights, buffer, *grads, False, "fused"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_w1w3_fp8_backward,
                          (p["dy_TH"], *inputs, *weights, buffer, "fused"),
                          test_utils=("test_schema", "test_faketensor"))
