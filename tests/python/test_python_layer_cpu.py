"""The Python layer without a GPU: argument validation, library loading and C ABI errors, and
the op's registration (autograd, fake kernels, torch.compile, checkpointing, accumulation) run
over CPU kernels from moe_reference.py that stand in for the CUDA library. Needs torch only
(library tests skip without libfusemoe_c.so). The GPU tests live in test_ops_gpu.py."""
import pytest

torch = pytest.importorskip("torch")

import fusemoe  # noqa: E402
from fusemoe import _capi  # noqa: E402
from moe_reference import (make_problem, moe_experts_backward_fp32, moe_experts_torch,  # noqa: E402
                           register_cpu_kernels, rel_err)

register_cpu_kernels()

SHAPE = dict(num_tokens=37, hidden=128, intermediate=64, num_experts=6, top_k=2)


def op_args(p):
    return (p["x_TH"], p["topk_idx_TK"], p["topk_weights_TK"], p["w13_EFH"], p["w2_EHI"])


@pytest.fixture
def problem():
    return make_problem(**SHAPE, device="cpu")


# ---- validation ----

@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.__setitem__(0, a[0].float()), "x (hidden_states) must be torch.bfloat16"),
    (lambda a: a.__setitem__(1, a[1].long()), "topk_idx must be torch.int32"),
    (lambda a: a.__setitem__(2, a[2].bfloat16()), "topk_weights must be torch.float32"),
    (lambda a: a.__setitem__(3, a[3].float()), "w13 (gate_up_proj) must be torch.bfloat16"),
    (lambda a: a.__setitem__(0, a[0][:, :64]), "x (hidden_states) must be contiguous"),
    (lambda a: a.__setitem__(0, a[0][None]), "x (hidden_states) must have 2 dimensions"),
    (lambda a: a.__setitem__(1, a[1][:5]), "topk_idx must be [T, K] with T = x.shape[0] = 37"),
    (lambda a: a.__setitem__(2, a[2][:, :1].contiguous()), "topk_weights must have the shape"),
    (lambda a: a.__setitem__(3, a[3][:, :, :64].contiguous()), "w13 (gate_up_proj) must be [E, 2I, H]"),
    (lambda a: a.__setitem__(4, a[4][:, :, :32].contiguous()), "w2 (down_proj) must be [E, H, I]"),
])
def test_validation_names_the_argument(problem, mutate, message):
    args = list(op_args(problem))
    mutate(args)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        fusemoe.moe_experts(*args)


def test_validation_under_fake_tensors(problem):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in op_args(problem)]
        y = fusemoe.moe_experts(*fake)
        assert y.shape == problem["x_TH"].shape and y.dtype == torch.bfloat16
        fake[1] = fake[1].long()
        with pytest.raises(ValueError, match="topk_idx must be torch.int32"):
            fusemoe.moe_experts(*fake)


def test_z_is_saved_only_when_it_can_be_used(problem, monkeypatch):
    """moe_experts asks the forward to save z for impl "fused" with a gradient required, unless
    recompute_z; never for "unfused" (the library refuses it) or without gradients."""
    from fusemoe import ops
    asked = []
    real_forward = ops.moe_experts_forward

    def spy(*args):
        asked.append(args[-1])  # save_z
        return real_forward(*args)

    monkeypatch.setattr(ops, "moe_experts_forward", spy)
    x, idx, w, w13, w2 = op_args(problem)
    w13_leaf = w13.clone().requires_grad_()
    fusemoe.moe_experts(x, idx, w, w13_leaf, w2, impl="fused")
    fusemoe.moe_experts(x, idx, w, w13_leaf, w2, impl="fused", recompute_z=True)
    fusemoe.moe_experts(x, idx, w, w13_leaf, w2, impl="unfused")
    with torch.no_grad():
        fusemoe.moe_experts(x, idx, w, w13_leaf, w2, impl="fused")
    fusemoe.moe_experts(x, idx, w, w13, w2, impl="fused")  # nothing requires a gradient
    assert asked == [True, False, False, False, False]


def test_saved_z_arguments_are_checked(problem):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        x, idx, w, w13, w2, dy = [mode.from_tensor(t) for t in (*op_args(problem), problem["dy_TH"])]
        with pytest.raises(ValueError, match='save_z needs impl="fused"'):
            torch.ops.fusemoe.moe_experts_forward(x, idx, w, w13, w2, "unfused", False, True)
        y, z = torch.ops.fusemoe.moe_experts_forward(x, idx, w, w13, w2, "fused", False, True)
        assert tuple(z.shape) == (SHAPE["num_tokens"] * SHAPE["top_k"], 2 * SHAPE["intermediate"])
        torch.ops.fusemoe.moe_experts_backward(dy, x, idx, w, w13, w2, "fused", z)
        with pytest.raises(ValueError, match="saved_z must be the forward's z"):
            torch.ops.fusemoe.moe_experts_backward(dy, x, idx, w, w13, w2, "fused", z[:-1])
        with pytest.raises(ValueError, match='save_z needs impl="fused"'):
            torch.ops.fusemoe.moe_experts_backward(dy, x, idx, w, w13, w2, "unfused", z)


# ---- library loading and the C ABI ----

def test_missing_library_error(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEMOE_LIBRARY", str(tmp_path / "nowhere.so"))
    monkeypatch.setattr(_capi, "_lib", None)
    assert not fusemoe.is_available()
    with pytest.raises(fusemoe.FusemoeError, match="C library not found at .*nowhere.so"):
        _capi.workspace_bytes((128, 64, 6, 2, 37), "unfused")


def require_library():
    if not fusemoe.is_available():
        pytest.skip(f"skipped: libfusemoe_c.so not built (looked at {fusemoe.library_path()})")


def test_c_abi_errors_carry_the_library_message():
    require_library()
    assert _capi.impl_code("unfused") != _capi.impl_code("reference_fp32")
    with pytest.raises(fusemoe.FusemoeError, match='unknown implementation "nope".*unfused'):
        _capi.impl_code("nope")
    with pytest.raises(fusemoe.FusemoeError, match=r"hidden \(H\) must be a positive multiple of 128"):
        _capi.workspace_bytes((100, 64, 6, 2, 37), "unfused")
    with pytest.raises(fusemoe.FusemoeError, match="unknown implementation"):
        fusemoe.MoEExperts(6, 128, 64, impl="nope")
    assert _capi.workspace_bytes((128, 64, 6, 2, 37), "unfused") > 0


def test_workspace_per_call():
    """Each kind of call has its own size; the fused backward given saved z needs the room for
    z less; no use is the size every call accepts."""
    require_library()
    layer = (256, 128, 8, 2, 1000)
    sizes = {use: _capi.workspace_bytes(layer, "fused", use) for use in _capi.WORKSPACE_USES}
    assert _capi.workspace_bytes(layer, "fused") == max(sizes.values())
    z_bytes = _capi.saved_z_bytes(layer)
    assert z_bytes <= sizes["backward"] - sizes["backward_saved_z"] < z_bytes + 256
    assert sizes["forward"] < sizes["backward"]
    for use in _capi.WORKSPACE_USES:
        assert _capi.workspace_bytes(layer, "unfused", use) == _capi.workspace_bytes(layer, "unfused")
    with pytest.raises(fusemoe.FusemoeError, match="use must be one of"):
        _capi.workspace_bytes(layer, "fused", "sideways")


def test_expert_id_reports_are_raised_once_with_their_own_layer_shape(monkeypatch):
    """The op's asynchronous bad-id reports, driven by hand on host memory (the real ones are
    pinned and written by the GPU): one report per (device, E, K); any pending report of the
    device is raised before the next call, decoded with its own K, then cleared."""
    require_library()
    from fusemoe import ops
    real_zeros = torch.zeros

    def host_zeros(*args, pin_memory=False, **kwargs):  # pinned memory needs CUDA
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", host_zeros)
    monkeypatch.setattr(ops, "_reports", {})
    device = torch.device("cuda", 0)
    address_k2 = ops._expert_id_report(device, 8, 2)
    address_k4 = ops._expert_id_report(device, 16, 4)
    assert address_k2 != address_k4 and ops._expert_id_report(device, 8, 2) == address_k2
    report_k2 = ops._reports[(0, 8, 2)]
    report_k2.copy_(torch.tensor([2, 7, 8], dtype=torch.int32))  # flat slot 7 = token 3, slot 1
    with pytest.raises(fusemoe.FusemoeError,
                       match=r"2 expert id\(s\) outside \[-1, 8\); first at token 3, slot 1, "
                             r"value 8 .*\(found by an earlier fusemoe call"):
        ops._expert_id_report(device, 16, 4)  # a call of another layer shape raises it too
    assert int(report_k2[0]) == 0
    ops._expert_id_report(device, 16, 4)  # cleared: no error
    ops._reports[(0, 16, 4)].copy_(torch.tensor([1, 9, -5], dtype=torch.int32))
    with pytest.raises(fusemoe.FusemoeError, match="token 2, slot 1, value -5"):
        ops.check_expert_ids(synchronize=False)
    ops.check_expert_ids(synchronize=False)


def test_expert_id_report_message():
    require_library()
    import ctypes
    report = (ctypes.c_int32 * _capi.EXPERT_ID_REPORT_INTS)(0, 0, 0)
    _capi.check_expert_id_report(ctypes.addressof(report), 6, 2)  # empty: no error
    report[0], report[1], report[2] = 3, 7, 9  # 3 bad ids, first at flat slot 7 = (3, 1), id 9
    with pytest.raises(fusemoe.FusemoeError,
                       match=r"3 expert id\(s\) outside \[-1, 6\); first at token 3, slot 1, value 9"):
        _capi.check_expert_id_report(ctypes.addressof(report), 6, 2)
    with pytest.raises(fusemoe.FusemoeError, match="num_experts and top_k"):
        _capi.check_expert_id_report(ctypes.addressof(report), 6, 0)


# ---- the reference itself: closed-form backward against autograd ----

def test_reference_backward_matches_autograd(problem):
    p = {k: v.float() if v.is_floating_point() else v for k, v in problem.items()}
    leaves = [p[k].clone().requires_grad_() for k in ("x_TH", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    y = moe_experts_torch(leaves[0], p["topk_idx_TK"], leaves[1], leaves[2], leaves[3])
    y.backward(p["dy_TH"])
    closed = moe_experts_backward_fp32(p["dy_TH"], p["x_TH"], p["topk_idx_TK"],
                                       p["topk_weights_TK"], p["w13_EFH"], p["w2_EHI"])
    for leaf, grad in zip(leaves, closed):
        assert rel_err(grad, leaf.grad) <= 1e-5


# ---- registration: autograd, compile, checkpointing, accumulation (CPU stand-in kernels) ----

def grads_of(fn, p):
    leaves = [p[k].clone().requires_grad_() for k in ("x_TH", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    y = fn(leaves[0], p["topk_idx_TK"], leaves[1], leaves[2], leaves[3])
    y.backward(p["dy_TH"])
    return [y.detach()] + [leaf.grad for leaf in leaves]


def test_autograd_reaches_every_input(problem):
    got = grads_of(fusemoe.moe_experts, problem)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.bfloat16, torch.float32,
                                      torch.bfloat16, torch.bfloat16]
    ref = moe_experts_backward_fp32(problem["dy_TH"], *op_args(problem))
    for g, r in zip(got[1:], ref):
        assert rel_err(g, r) <= 1e-2


def test_opcheck(problem):
    args = op_args(problem)
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in args]
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_forward.default, (*leaves, "unfused"))
    torch.library.opcheck(torch.ops.fusemoe.moe_experts_backward.default,
                          (problem["dy_TH"], *args, "unfused"))


def test_compile_fullgraph_equals_eager(problem):
    module = fusemoe.MoEExperts.from_experts(_experts_holder(problem))
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager", dynamic=True)
    for num_tokens in (37, 20):
        x = problem["x_TH"][:num_tokens].clone().requires_grad_()
        idx = problem["topk_idx_TK"][:num_tokens].long()  # Hugging Face passes int64 ids
        w = problem["topk_weights_TK"][:num_tokens].clone().requires_grad_()
        outs = []
        for fn in (module, compiled):
            module.zero_grad()
            x.grad = w.grad = None
            y = fn(x, idx, w)
            y.backward(problem["dy_TH"][:num_tokens])
            outs.append([y, x.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad])
        for a, b in zip(*outs):
            assert torch.equal(a, b)


def _experts_holder(problem):
    holder = torch.nn.Module()
    holder.gate_up_proj = torch.nn.Parameter(problem["w13_EFH"].clone())
    holder.down_proj = torch.nn.Parameter(problem["w2_EHI"].clone())
    return holder


def test_checkpointing_and_accumulation(problem):
    from torch.utils.checkpoint import checkpoint
    module = fusemoe.MoEExperts.from_experts(_experts_holder(problem))
    idx, w, dy = problem["topk_idx_TK"], problem["topk_weights_TK"], problem["dy_TH"]

    def run(x, use_checkpoint):
        fn = lambda t: module(t * 2, idx, w)  # noqa: E731  (an op before the layer to recompute)
        return checkpoint(fn, x, use_reentrant=False) if use_checkpoint else fn(x)

    per_batch = []
    for x in (problem["x_TH"], problem["x_TH"].flip(0).contiguous()):
        module.zero_grad()
        run(x, False).backward(dy)
        per_batch.append((module.gate_up_proj.grad.clone(), module.down_proj.grad.clone()))
    module.zero_grad()
    for x in (problem["x_TH"], problem["x_TH"].flip(0).contiguous()):
        run(x, True).backward(dy)  # two micro-batches, checkpointed, gradients accumulate
    assert torch.equal(module.gate_up_proj.grad, per_batch[0][0] + per_batch[1][0])
    assert torch.equal(module.down_proj.grad, per_batch[0][1] + per_batch[1][1])


def test_module_shares_parameters_and_converts_inputs(problem):
    holder = _experts_holder(problem)
    module = fusemoe.MoEExperts.from_experts(holder)
    assert module.gate_up_proj is holder.gate_up_proj and module.down_proj is holder.down_proj
    x3 = problem["x_TH"].float().reshape(1, 37, 128)  # fp32, batched, like an autocast caller
    y3 = module(x3, problem["topk_idx_TK"].long().reshape(1, 37, 2),
                problem["topk_weights_TK"].bfloat16().reshape(1, 37, 2))
    assert y3.shape == x3.shape and y3.dtype == torch.float32
