"""fusemoe's PyTorch op and module on an sm_90 GPU (skipped elsewhere; see conftest.py).

Forward and every gradient against a pure-PyTorch fp32 implementation fed the same bf16-rounded
inputs, under the FlashAttention-3 rule: err(fusemoe) <= 2 * err(pure-PyTorch bf16) + atol,
err = relative L2 (DeepGEMM calc_diff printed alongside). Then: torch.compile(fullgraph=True)
equals eager bitwise, checkpointing and two accumulated micro-batches equal the plain sums,
masked slots, T = 0, a side stream, and errors from the library.
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
"""
import functools
import math

import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
from conftest import require_gpu  # noqa: E402
from moe_reference import (OUTPUTS, assert_within_noise, make_problem,  # noqa: E402
                           moe_experts_torch, rel_err, run_layer)

ATOL = 1e-3  # relative L2: keeps a near-zero bf16 baseline error from demanding bitwise equality
IMPLS = ["unfused", "fused"]
each_impl = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture(autouse=True)
def gpu():
    require_gpu()


def check_against_reference(p, impl=fusemoe.DEFAULT_IMPL, swiglu_clamp=None, **options):
    got = run_layer(functools.partial(fusemoe.moe_experts, impl=impl, swiglu_clamp=swiglu_clamp,
                                      **options), p, torch.bfloat16)
    torch_layer = functools.partial(moe_experts_torch, swiglu_clamp=swiglu_clamp)
    same_precision = run_layer(torch_layer, p, torch.bfloat16)
    ref = run_layer(torch_layer, p, torch.float32)
    assert_within_noise([(name, got[name], same_precision[name], ref[name]) for name in OUTPUTS],
                        ATOL, "torch bf16")
    return got


SHAPES = {  # T, H, I, E, K
    "one_token_top1": (1, 128, 64, 4, 1),
    "small": (199, 256, 128, 8, 2),
    "top_k_equals_experts": (64, 128, 64, 8, 8),
    "uneven_4097": (4097, 128, 64, 16, 4),
    "qwen3_30b_a3b": (256, 2048, 768, 128, 8),
}


@each_impl
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_fp32_reference(shape, impl):
    num_tokens, hidden, intermediate, num_experts, top_k = shape
    check_against_reference(make_problem(num_tokens, hidden, intermediate, num_experts, top_k,
                                         "cuda", seed=sum(shape)), impl)


@pytest.mark.parametrize("shape", [SHAPES["small"], SHAPES["qwen3_30b_a3b"]],
                         ids=["small", "qwen3_30b_a3b"])
def test_fused_with_recomputed_z(shape):
    """The fused op saves z in the forward by default; recompute_z=True takes the other path."""
    check_against_reference(make_problem(*shape, "cuda", seed=23), "fused", recompute_z=True)


@pytest.mark.parametrize("impl, recompute_z", [("unfused", False), ("fused", False),
                                                ("fused", True)])
def test_swiglu_clamp(impl, recompute_z):
    """The clamp through the op (FusemoeCLayer's clamp fields, C ABI 6): at c = 0.75 about a third of g and u
    are clamped (z ~ N(0, 1) here), so a clamp that were dropped would fail the comparison."""
    p = make_problem(199, 256, 128, 8, 2, "cuda", seed=29)
    check_against_reference(p, impl, swiglu_clamp=0.75, recompute_z=recompute_z)
    unclamped = run_layer(functools.partial(fusemoe.moe_experts, impl=impl), p, torch.bfloat16)
    clamped = run_layer(functools.partial(fusemoe.moe_experts, impl=impl, swiglu_clamp=0.75), p,
                        torch.bfloat16)
    change = rel_err(clamped["y"], unclamped["y"])
    assert math.isfinite(change) and change > 1e-2  # a NaN would give inf


def test_swiglu_clamp_value_is_checked_by_the_library():
    p = make_problem(16, 128, 64, 4, 2, "cuda")
    args = [p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    with pytest.raises(fusemoe.FusemoeError, match="swiglu_clamp must be finite and > 0"):
        fusemoe.moe_experts(*args, swiglu_clamp=-1.0)


@each_impl
def test_all_tokens_to_one_expert(impl):
    check_against_reference(make_problem(300, 256, 128, 8, 1, "cuda", routing="one_expert"), impl)


@each_impl
def test_masked_slots(impl):
    p = make_problem(131, 256, 128, 8, 4, "cuda", seed=3)
    mask_TK = torch.rand(p["topk_idx_TK"].shape, device="cuda") < 0.3
    mask_TK[:5] = True  # five tokens with every slot masked
    p["topk_idx_TK"] = p["topk_idx_TK"].masked_fill(mask_TK, -1)
    p["topk_weights_TK"] = p["topk_weights_TK"].masked_fill(mask_TK, float("nan"))  # never read
    got = check_against_reference(p, impl)
    assert torch.all(got["y"][:5] == 0) and torch.all(got["dx"][:5] == 0)
    assert torch.all(got["d_topk_weights"][mask_TK] == 0)


@each_impl
def test_zero_tokens(impl):
    p = make_problem(0, 128, 64, 4, 2, "cuda")
    got = run_layer(functools.partial(fusemoe.moe_experts, impl=impl), p, torch.bfloat16)
    assert got["y"].shape == (0, 128) and got["dx"].shape == (0, 128)
    assert torch.all(got["dw13"] == 0) and torch.all(got["dw2"] == 0)


@each_impl
def test_side_stream_matches_default_stream(impl):
    p = make_problem(199, 256, 128, 8, 2, "cuda", seed=5)
    layer = functools.partial(fusemoe.moe_experts, impl=impl)
    expected = run_layer(layer, p, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run_layer(layer, p, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    for name in OUTPUTS:
        assert torch.equal(got[name], expected[name]), name


@each_impl
def test_opcheck(impl):
    p = make_problem(37, 128, 64, 6, 2, "cuda", seed=7)
    args = [p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in args]
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_forward.default, (*leaves, impl))
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_backward.default,
                          (p["dy_TH"], *args, impl))


def module_and_inputs(num_tokens, seed, impl):
    p = make_problem(num_tokens, 256, 128, 8, 2, "cuda", seed=seed)
    module = fusemoe.MoEExperts(8, 256, 128, impl=impl, device="cuda")
    with torch.no_grad():
        module.gate_up_proj.copy_(p["w13_EFH"])
        module.down_proj.copy_(p["w2_EHI"])
    # As Hugging Face's router passes them: int64 ids, bf16 weights.
    return module, p, p["topk_idx_TK"].long(), p["topk_weights_TK"].bfloat16()


def module_step(fn, module, x, idx, w, dy):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = fn(x, idx, w)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad]


@each_impl
def test_compile_fullgraph_equals_eager(impl):
    module, p, idx, w = module_and_inputs(199, seed=11, impl=impl)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for num_tokens in (199, 64):  # a second T runs the dynamic-shape graph
        args = (p["x_TH"][:num_tokens], idx[:num_tokens], w[:num_tokens], p["dy_TH"][:num_tokens])
        eager = module_step(module, module, *args)
        got = module_step(compiled, module, *args)
        for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, eager):
            assert torch.equal(a, b), f"T={num_tokens} {name}: max diff {(a - b).abs().max()}"


@each_impl
def test_checkpointing_and_two_micro_batches(impl):
    from torch.utils.checkpoint import checkpoint
    module, p, idx, w = module_and_inputs(199, seed=13, impl=impl)
    batches = [p["x_TH"], p["x_TH"].flip(0).contiguous()]

    def layer(x):
        return module(torch.nn.functional.rms_norm(x, (x.shape[-1],)), idx, w)

    separate = []
    for x in batches:
        module.zero_grad(set_to_none=True)
        layer(x).backward(p["dy_TH"])
        separate.append((module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()))
    module.zero_grad(set_to_none=True)
    for x in batches:
        checkpoint(layer, x, use_reentrant=False).backward(p["dy_TH"])
    assert torch.equal(module.gate_up_proj.grad, separate[0][0] + separate[1][0])
    assert torch.equal(module.down_proj.grad, separate[0][1] + separate[1][1])


@each_impl
def test_grad_in_place_accumulates_into_grad(impl):
    """grad_in_place: the first micro-batch writes .grad (bitwise the autograd gradient), the
    second adds in the kernel (fused: the TMA reduce-add of the bf16-rounded gradient, the same
    add as autograd's, so bitwise; unfused: cuBLAS's beta = 1, one rounding of fp32 acc + bf16
    .grad, so close to autograd's), and x / topk_weights still get their gradients through
    autograd."""
    module, p, idx, w = module_and_inputs(199, seed=17, impl=impl)
    batches = [p["x_TH"], p["x_TH"].flip(0).contiguous()]
    separate = []
    for x in batches:
        separate.append(module_step(module, module, x, idx, w, p["dy_TH"]))
    in_place = fusemoe.MoEExperts.from_experts(module, impl=impl, grad_in_place=True)
    first = module_step(in_place, module, batches[0], idx, w, p["dy_TH"])
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), first, separate[0]):
        assert torch.equal(a, b), f"first micro-batch {name}: max diff {(a - b).abs().max()}"
    x = batches[1].clone().requires_grad_()
    in_place(x, idx, w).backward(p["dy_TH"])  # no zero_grad: accumulates
    assert torch.equal(x.grad, separate[1][1])
    for grad, parts in ((module.gate_up_proj.grad, (separate[0][3], separate[1][3])),
                        (module.down_proj.grad, (separate[0][4], separate[1][4]))):
        exact = parts[0].float() + parts[1].float()
        err = rel_err(grad, exact)
        assert err < 4e-3, f"accumulated weight gradient rel err {err:.2e}"
        if impl == "fused":
            assert torch.equal(grad, parts[0] + parts[1]), "not autograd's bf16 add"


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("frozen", ["experts", "down", "gate_up"])
def test_frozen_weights_skip_their_gradients(frozen, precision):
    """Weights that do not require grad: the library skips their gradient GEMMs; dx,
    d_topk_weights and the trainable weights' gradients are bitwise those of the run with every
    weight trainable, and the frozen weights' .grad stays None."""
    p = make_problem(300, 256, 128, 8, 2, "cuda", seed=23)
    gate_up_frozen, down_frozen = frozen in ("experts", "gate_up"), frozen in ("experts", "down")

    def run(freeze):
        x, w = (p[k].clone().requires_grad_() for k in ("x_TH", "topk_weights_TK"))
        w13 = p["w13_EFH"].clone().requires_grad_(not (freeze and gate_up_frozen))
        w2 = p["w2_EHI"].clone().requires_grad_(not (freeze and down_frozen))
        y = fusemoe.moe_experts(x, p["topk_idx_TK"], w, w13, w2, precision=precision)
        y.backward(p["dy_TH"])
        return y.detach(), x.grad, w.grad, w13.grad, w2.grad

    every = run(False)
    got = run(True)
    for name, a, b in zip(("y", "dx", "d_topk_weights"), got, every):
        assert torch.equal(a, b), name
    assert (got[3] is None) == gate_up_frozen and (got[4] is None) == down_frozen
    for name, a, b in (("dw13", got[3], every[3]), ("dw2", got[4], every[4])):
        assert a is None or torch.equal(a, b), name


@each_impl
def test_bad_expert_ids_are_reported_without_a_sync(impl):
    p = make_problem(16, 128, 64, 4, 2, "cuda")
    args = [p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    bad_ids = args[1].clone()
    bad_ids[3, 1] = 4  # E = 4: out of range
    bad_ids[9, 0] = -7
    fusemoe.check_expert_ids()  # nothing pending from earlier tests
    y = fusemoe.moe_experts(args[0], bad_ids, *args[2:], impl=impl)  # masked, reported later
    assert torch.isfinite(y).all()
    message = "2 expert id.s. outside \\[-1, 4\\); first at token 3, slot 1, value 4"
    with pytest.raises(fusemoe.FusemoeError, match=message):
        fusemoe.check_expert_ids()
    fusemoe.check_expert_ids()  # reported once, then cleared
    # The next call raises instead when nobody asked: the report is read before every call.
    fusemoe.moe_experts(args[0], bad_ids, *args[2:], impl=impl)
    torch.cuda.synchronize()
    with pytest.raises(fusemoe.FusemoeError, match="token 3, slot 1.*reported asynchronously"):
        fusemoe.moe_experts(*args, impl=impl)
    check_against_reference(p, impl)
    fusemoe.check_expert_ids()


@each_impl
def test_workspace_out_of_memory_is_a_clear_error_and_leaves_no_state(impl):
    """A call whose workspace torch's allocator cannot give (capped with
    set_per_process_memory_fraction) raises FusemoeError, also a torch.OutOfMemoryError, naming
    fusemoe, the call and the bytes, before launching anything. Forward and backward; then the
    same calls give the bits they gave before, and bad ids are still reported."""
    num_tokens, hidden, intermediate, num_experts, top_k = 4096, 256, 2048, 8, 8
    p = make_problem(num_tokens, hidden, intermediate, num_experts, top_k, "cuda", seed=41)
    layer = functools.partial(fusemoe.moe_experts, impl=impl)
    expected = run_layer(layer, p, torch.bfloat16)
    fusemoe.check_expert_ids()
    c_layer = fusemoe._capi.layer(hidden, intermediate, num_experts, top_k, num_tokens, impl)

    def starve(use):
        """Caps the caching allocator at what it holds now plus half of the workspace of `use`
        (more than the call's outputs, allocated first, need). Free blocks of 1 MiB or more inside
        the segments it holds are taken first by filler tensors: earlier tests can leave such a
        block big enough for the workspace (seen after test_native_binding.py), which the cap
        would not stop. Returns the workspace's bytes and the fillers (keep them until the call)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        fillers = [torch.empty(block["size"], dtype=torch.uint8, device="cuda")
                   for segment in torch.cuda.memory_snapshot()
                   for block in segment["blocks"]
                   if block["state"] == "inactive" and block["size"] >= 1 << 20]
        num_bytes = c_layer.workspace_bytes(use)
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(
            (torch.cuda.memory_reserved() + num_bytes // 2) / total)
        return num_bytes, fillers

    args = [p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    try:
        num_bytes, fillers = starve("forward")
        with pytest.raises(fusemoe.FusemoeError,
                           match=f"^fusemoe: cannot allocate the forward workspace of {num_bytes} "
                                 "bytes") as raised:
            layer(*args)
        assert isinstance(raised.value, torch.OutOfMemoryError)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del raised, fillers

    leaves = [p[k].clone().requires_grad_()
              for k in ("x_TH", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    y = layer(leaves[0], p["topk_idx_TK"], *leaves[1:])
    use = "backward_saved_z" if impl == "fused" else "backward"  # "fused" saves z by default
    try:
        num_bytes, fillers = starve(use)
        with pytest.raises(fusemoe.FusemoeError,
                           match=f"^fusemoe: cannot allocate the {use} workspace of {num_bytes} "
                                 "bytes") as raised:
            y.backward(p["dy_TH"])
        assert isinstance(raised.value, torch.OutOfMemoryError)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del raised, fillers, y, leaves

    fusemoe.check_expert_ids()  # the failed calls left no report behind
    got = run_layer(layer, p, torch.bfloat16)
    for name in OUTPUTS:
        assert torch.equal(got[name], expected[name]), name
    bad_ids = p["topk_idx_TK"].clone()
    bad_ids[3, 1] = num_experts
    layer(args[0], bad_ids, *args[2:])
    with pytest.raises(fusemoe.FusemoeError, match="first at token 3, slot 1, value 8"):
        fusemoe.check_expert_ids()


def test_errors_from_the_library_and_the_op():
    p = make_problem(16, 128, 64, 4, 2, "cuda")
    args = [p[k] for k in ("x_TH", "topk_idx_TK", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    with pytest.raises(ValueError, match="topk_weights must be torch.float32"):
        fusemoe.moe_experts(args[0], args[1], args[2].bfloat16(), *args[3:])
    with pytest.raises(ValueError, match="topk_idx is on cpu"):
        fusemoe.moe_experts(args[0], args[1].cpu(), *args[2:])
    with pytest.raises(fusemoe.FusemoeError, match="hidden"):
        fusemoe.moe_experts(args[0][:, :100].contiguous(), args[1], args[2],
                            args[3][:, :, :100].contiguous(), args[4][:, :100].contiguous())
    # The layer still works after the errors.
    check_against_reference(p)
