"""fusemoe experts under FSDP2 (torch.distributed.fsdp.fully_shard) with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), world size 1 in this process.

The model is a fusemoe.MoEExperts with fp32 master weights; the unsharded run is the same
module without FSDP (MoEExperts casts fp32 weights to bf16 itself), so both compute the op on
the same bf16 values and the gradients must be equal bitwise (world size 1: the reduction is a
copy; fp32 accumulation in both). Two micro-batches check that FSDP accumulates the sharded
gradients. grad_in_place=True is checked too: under FSDP2 the kernels write the unsharded bf16
Parameters' .grad and FSDP2's post-backward reduces it like any gradient; its hooks on the
expert weights (register_post_accumulate_grad_hook) still do not fire (docs/design.md).

CPU (gloo, the stand-in kernels of moe_reference.py) where torch.distributed has gloo, and the
GPU (nccl, the fusemoe kernels) on an sm_90 GPU. Shape legend: T tokens, H hidden, I expert
intermediate, F = 2I, E experts, K top-k.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import fusemoe  # noqa: E402
from conftest import require_gpu  # noqa: E402
from moe_reference import make_problem, register_cpu_fp8_kernels, register_cpu_kernels  # noqa: E402

register_cpu_kernels()
register_cpu_fp8_kernels()


@pytest.fixture
def process_group(tmp_path, request):
    """A one-process group of the backend the test asks for (its 'backend' mark)."""
    backend = request.node.get_closest_marker("backend").args[0]
    if not dist.is_available() or not getattr(dist, f"is_{backend}_available")():
        pytest.skip(f"skipped: torch.distributed has no {backend}")
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def fully_shard_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        pytest.skip(f"skipped: torch {torch.__version__} has no torch.distributed.fsdp.fully_shard")
    return fully_shard, MixedPrecisionPolicy


def micro_batches(device):
    """Two micro-batches (x fp32, ids, weights already bf16-representable: FSDP casts floating
    forward inputs to bf16, so both runs then see the same values), and the module's weights."""
    p = make_problem(199, 256, 128, 8, 2, device, seed=41)
    batches = []
    for seed in (41, 42):
        q = make_problem(199, 256, 128, 8, 2, device, seed=seed)
        weights_TK = q["topk_weights_TK"].bfloat16().float()
        batches.append((q["x_TH"].float(), q["topk_idx_TK"].long(), weights_TK, q["dy_TH"]))
    return p["w13_EFH"].float(), p["w2_EHI"].float(), batches


def grads_of(module, batches, wrap_input):
    """Sum over the micro-batches of the gradients of <y, dy>: (dw13, dw2, [dx per batch])."""
    dxs = []
    for x_TH, idx_TK, w_TK, dy_TH in batches:
        x_TH = x_TH.clone().requires_grad_()
        y_TH = module(wrap_input(x_TH), idx_TK, w_TK)
        (y_TH.float() * dy_TH.float()).sum().backward()
        dxs.append(x_TH.grad)
    grads = [p.grad for p in (module.gate_up_proj, module.down_proj)]
    if hasattr(grads[0], "full_tensor"):  # DTensor shards: world size 1 holds the whole tensor
        grads = [g.full_tensor() for g in grads]
    return grads[0], grads[1], dxs


def check_fsdp_matches_unsharded(device, impl, grad_in_place):
    fully_shard, MixedPrecisionPolicy = fully_shard_api()
    from fusemoe import ops
    in_place_before = ops._in_place_backward_count()
    w13_EFH, w2_EHI, batches = micro_batches(device)
    module = fusemoe.MoEExperts(8, 256, 128, impl=impl, device=device, dtype=torch.float32,
                                grad_in_place=grad_in_place)
    with torch.no_grad():
        module.gate_up_proj.copy_(w13_EFH)
        module.down_proj.copy_(w2_EHI)
    unsharded = copy.deepcopy(module)
    unsharded.grad_in_place = False  # the plain autograd path is the reference
    expected = grads_of(unsharded, batches, lambda x: x)

    # The mesh on the test's device: left to FSDP, a machine with a GPU puts a CPU module's mesh
    # on cuda:0 and the gloo test fails with mixed devices.
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device if device == "cpu" else "cuda", (1,))
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
    got = grads_of(module, batches, lambda x: x)
    assert module.gate_up_proj.grad is not None and module.down_proj.grad is not None, \
        "FSDP left the expert weights without gradients"
    assert module.gate_up_proj.grad.dtype == torch.float32
    for name, g, e in (("dw13", got[0], expected[0]), ("dw2", got[1], expected[1])):
        assert torch.isfinite(g).all() and torch.equal(g, e), \
            f"{name}: max diff {(g - e).abs().max().item()}"
    for i, (g, e) in enumerate(zip(got[2], expected[2])):
        assert torch.equal(g, e), f"dx of micro-batch {i}: max diff {(g - e).abs().max().item()}"
    # grad_in_place took its own path (the kernels wrote the unsharded Parameters' .grad).
    assert ops._in_place_backward_count() - in_place_before == (len(batches) if grad_in_place else 0)


@pytest.mark.backend("gloo")
@pytest.mark.parametrize("grad_in_place", [False, True])
def test_fsdp2_matches_unsharded_cpu(process_group, grad_in_place):
    check_fsdp_matches_unsharded("cpu", "unfused", grad_in_place)


@pytest.mark.backend("nccl")
@pytest.mark.parametrize("grad_in_place", [False, True])
@pytest.mark.parametrize("impl", ["fused", "unfused"])
def test_fsdp2_matches_unsharded_gpu(impl, grad_in_place, request):
    require_gpu()
    torch.cuda.set_device(0)
    request.getfixturevalue("process_group")  # after the GPU gate: no nccl group without a GPU
    check_fsdp_matches_unsharded("cuda", impl, grad_in_place)


def check_fsdp_fp8_cache_follows_steps(device):
    """precision="fp8" under FSDP2: the FP8 weight buffer (fusemoe.fp8.Fp8WeightCache) must be
    rebuilt after each optimizer step. FSDP2 all-gathers into the same unsharded Parameter object,
    preserving its version counter, and its storage may come back at the same address, so the
    unsharded Parameter alone does not show the step. Three steps of two micro-batches, SGD on
    the fp32 masters; FSDP2 (bf16 parameters) against the same module unsharded: equal outputs
    and FP8 buffers at every forward, one quantization per step unsharded; FSDP2 at least one
    per step, and one per micro-batch at most (where the all-gather lands at a new address)."""
    fully_shard, MixedPrecisionPolicy = fully_shard_api()
    w13_EFH, w2_EHI, batches = micro_batches(device)
    module = fusemoe.MoEExperts(8, 256, 128, impl="fused", device=device, dtype=torch.float32,
                                precision="fp8")
    with torch.no_grad():
        module.gate_up_proj.copy_(w13_EFH)
        module.down_proj.copy_(w2_EHI)
    unsharded = copy.deepcopy(module)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device if device == "cpu" else "cuda", (1,))
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float32))
    models = (module, unsharded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    steps, previous_y = 3, None
    for step in range(steps):
        for i, (x_TH, idx_TK, w_TK, dy_TH) in enumerate(batches):
            ys, buffers = [], []
            for m in models:
                y_TH = m(x_TH.clone().requires_grad_(), idx_TK, w_TK)
                buffers.append(m._fp8_cache._buffer.clone())
                (y_TH.float() * dy_TH.float()).sum().backward()
                ys.append(y_TH.detach())
            assert torch.equal(buffers[0], buffers[1]), \
                f"step {step}, micro-batch {i}: the FSDP2 module's FP8 weight buffer is stale"
            assert torch.equal(ys[0], ys[1]), \
                f"step {step}, micro-batch {i}: max diff {(ys[0] - ys[1]).abs().max().item()}"
            if i == 0:
                # The steps do change the weights (else the test would prove nothing).
                assert previous_y is None or not torch.equal(ys[1], previous_y)
                previous_y = ys[1]
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert unsharded._fp8_cache.quantizations == steps
    assert steps <= module._fp8_cache.quantizations <= steps * len(batches)


@pytest.mark.backend("gloo")
def test_fsdp2_fp8_weight_cache_follows_optimizer_steps_cpu(process_group):
    check_fsdp_fp8_cache_follows_steps("cpu")


@pytest.mark.backend("nccl")
def test_fsdp2_fp8_weight_cache_follows_optimizer_steps_gpu(request):
    require_gpu()
    torch.cuda.set_device(0)
    request.getfixturevalue("process_group")
    check_fsdp_fp8_cache_follows_steps("cuda")
