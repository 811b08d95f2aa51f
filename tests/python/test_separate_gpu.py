"""fusemoe.moe_experts_w1w3 on an sm_90 GPU (skipped elsewhere; see conftest.py): the output and
every gradient bitwise equal to fusemoe.moe_experts on w13 = [w1; w3] (the library reads the same
tiles from two tensors), with z saved and recomputed, masked slots, T = 0; the cuBLAS impl is
refused with the library's message; torch.library.opcheck on the ops.
Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k."""
import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
from conftest import require_gpu  # noqa: E402
from moe_reference import make_problem  # noqa: E402


@pytest.fixture(autouse=True)
def gpu():
    require_gpu()


def split(w13_EFH):
    intermediate = w13_EFH.shape[1] // 2
    return w13_EFH[:, :intermediate].contiguous(), w13_EFH[:, intermediate:].contiguous()


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
    w1_EIH, w3_EIH = split(p["w13_EFH"])
    x, idx, w, w2, dy = (p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w2_EHI", "dy_TH"))
    separate = gradients(lambda x, w, w1, w3, w2: fusemoe.moe_experts_w1w3(
        x, idx, w, w1, w3, w2, recompute_z=recompute_z), [x, w, w1_EIH, w3_EIH, w2], dy)
    concatenated = gradients(lambda x, w, w13, w2: fusemoe.moe_experts(
        x, idx, w, w13, w2, recompute_z=recompute_z), [x, w, p["w13_EFH"], w2], dy)
    y, dx, dw, dw1, dw3, dw2 = separate
    y_ref, dx_ref, dw_ref, dw13_ref, dw2_ref = concatenated
    dw1_ref, dw3_ref = split(dw13_ref)
    for name, got, ref in (("y", y, y_ref), ("dx", dx, dx_ref), ("d_topk_weights", dw, dw_ref),
                           ("dw1", dw1, dw1_ref), ("dw3", dw3, dw3_ref), ("dw2", dw2, dw2_ref)):
        assert torch.equal(got, ref), f"{name} differs from the w13 call"


def test_unfused_is_refused():
    p = make_problem(num_tokens=7, hidden=256, intermediate=128, num_experts=8, top_k=2,
                     device="cuda")
    w1_EIH, w3_EIH = split(p["w13_EFH"])
    with pytest.raises(fusemoe.FusemoeError, match="not supported yet by impl unfused"):
        fusemoe.moe_experts_w1w3(p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], w1_EIH,
                                 w3_EIH, p["w2_EHI"], impl="unfused")


def test_opcheck():
    p = make_problem(num_tokens=33, hidden=256, intermediate=128, num_experts=8, top_k=2,
                     device="cuda")
    w1_EIH, w3_EIH = split(p["w13_EFH"])
    args = (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"].clone().requires_grad_(),
            w1_EIH.requires_grad_(), w3_EIH.requires_grad_(), p["w2_EHI"].clone().requires_grad_(),
            "fused")
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_w1w3_forward, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
