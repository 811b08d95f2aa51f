"""fusemoe.torchtitan against torchtitan's own MoE module (torchtitan.models.common.moe, PyPI's
torchtitan 0.3; scripts/run_tests.sh installs it where it installs, and these tests report skipped
where it is missing). Shapes follow torchtitan's legend: D model dim, F expert hidden, E experts,
K top-k, B batch, L sequence.

- RoutedExperts: the patched forward and backward (y, dx, d_scores, dw1, dw3, dw2) against an fp32
  reference (moe_reference.moe_experts_torch on fp64 copies, autograd), within 2x the error of
  torchtitan's own bf16 forward and backward of the same module + atol (the FlashAttention-3 rule).
- MoE: a whole layer (router included) patched and not, the same routing, outputs and every
  Parameter's gradient close; the report names what was swapped; unpatching restores torchtitan.
- Options: precision ("bf16", "fp8") and grad_in_place reach fusemoe.moe_experts_w1w3 (the
  patched module gives what the op called directly with them gives, bitwise, over two
  micro-batches; the FP8 buffer is quantized once).
On "cpu" the fusemoe ops run on moe_reference.py's stand-in kernels (the adapter's plumbing:
shapes, dtypes, which gradient goes where); on "cuda" on the library (sm_90 GPU, impl "fused").
"""
import copy

import pytest

torch = pytest.importorskip("torch")

from conftest import require_gpu  # noqa: E402
from moe_reference import (assert_within_noise, moe_experts_torch,  # noqa: E402
                           register_cpu_fp8_w1w3_kernels, register_cpu_kernels, rel_err)

try:
    from torchtitan.models.common import moe as tt_moe
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
except Exception as e:  # torchtitan imports much (spmd_types, tyro): any failure means absent
    pytest.skip(f"skipped: torchtitan's MoE does not import here ({e!r}); scripts/run_tests.sh "
                "installs torchtitan from PyPI where it installs", allow_module_level=True)

import fusemoe  # noqa: E402
import fusemoe.torchtitan as fusemoe_tt  # noqa: E402

register_cpu_kernels()
register_cpu_fp8_w1w3_kernels()

DIMS = dict(D=256, F=128, E=8, K=2)
ATOL = 1e-3


def device_of(name):
    if name == "cuda":
        require_gpu()
    return torch.device(name)


def moe_config(D, F, E, K):
    return tt_moe.MoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=tt_moe.RoutedExperts.Config(
            inner_experts=tt_moe.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=tt_moe.TokenChoiceTopKRouter.Config(
            num_experts=E, top_k=K, score_func="softmax",
            gate=Linear.Config(in_features=D, out_features=E)))


def build_moe(device, seed=0):
    """A bf16 torchtitan MoE with N(0, 1/fan_in) weights."""
    torch.manual_seed(seed)
    model = moe_config(**DIMS).build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.to(device=device, dtype=torch.bfloat16)


def routing(B, L, device, seed):
    gen = torch.Generator().manual_seed(seed)
    ids_BLK = torch.rand(B, L, DIMS["E"], generator=gen).topk(DIMS["K"], dim=-1).indices
    scores_BLK = torch.softmax(torch.randn(B, L, DIMS["K"], generator=gen), dim=-1)
    return ids_BLK.to(device), scores_BLK.to(device)


def run_routed(module, x_BLD, scores_BLK, ids_BLK, dy_BLD):
    """Forward + backward of a RoutedExperts; returns (y, dx, d_scores, dw1, dw3, dw2)."""
    x = x_BLD.clone().requires_grad_()
    scores = scores_BLK.clone().requires_grad_()
    experts = module.inner_experts
    for p in experts.parameters():
        p.grad = None
    counts_E = torch.bincount(ids_BLK.reshape(-1), minlength=DIMS["E"])
    y = module(x, scores, ids_BLK, counts_E)
    y.backward(dy_BLD)
    return (y.detach(), x.grad, scores.grad, experts.w1_EFD.grad, experts.w3_EFD.grad,
            experts.w2_EDF.grad)


def reference_routed(module, x_BLD, scores_BLK, ids_BLK, dy_BLD):
    """The same from fp64 copies through moe_reference.moe_experts_torch (autograd)."""
    experts = module.inner_experts
    leaves = [t.detach().double().requires_grad_()
              for t in (x_BLD, scores_BLK, experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)]
    x, scores, w1, w3, w2 = leaves
    D, K = x.shape[-1], scores.shape[-1]
    y = moe_experts_torch(x.reshape(-1, D), ids_BLK.reshape(-1, K), scores.reshape(-1, K),
                          torch.cat([w1, w3], dim=1), w2).reshape(x.shape)
    y.backward(dy_BLD.double())
    return (y.detach(),) + tuple(t.grad for t in leaves)


@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
@pytest.mark.parametrize("B, L", [(1, 1), (2, 37), (4, 256)])
def test_routed_experts_against_torchtitan(device_name, B, L):
    device = device_of(device_name)
    model = build_moe(device)
    original = model.routed_experts
    patched = copy.deepcopy(original)
    wrapper = torch.nn.Module()
    wrapper.routed_experts = patched
    report = fusemoe_tt.patch_torchtitan_moe(wrapper)
    assert report.replaced == ["routed_experts"] and report.left == {}
    gen = torch.Generator().manual_seed(B * 1000 + L)
    x_BLD = torch.randn(B, L, DIMS["D"], generator=gen).to(device, torch.bfloat16)
    dy_BLD = torch.randn(B, L, DIMS["D"], generator=gen).to(device, torch.bfloat16)
    ids_BLK, scores_BLK = routing(B, L, device, seed=B + L)
    got = run_routed(patched, x_BLD, scores_BLK, ids_BLK, dy_BLD)
    noise = run_routed(original, x_BLD, scores_BLK, ids_BLK, dy_BLD)
    ref = reference_routed(original, x_BLD, scores_BLK, ids_BLK, dy_BLD)
    names = ("y", "dx", "d_scores", "dw1", "dw3", "dw2")
    for name, g, n in zip(names, got, noise):
        assert g.dtype == n.dtype and g.shape == n.shape, name
    assert_within_noise(list(zip(names, got, noise, ref)), ATOL, "torchtitan bf16",
                        prefix=f"{device_name} B={B} L={L}: ")


@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
def test_moe_layer_patched_and_unpatched(device_name):
    device = device_of(device_name)
    original = build_moe(device, seed=1)
    patched = copy.deepcopy(original)
    report = fusemoe_tt.patch_torchtitan_moe(patched)
    assert report.replaced == ["routed_experts"], str(report)
    gen = torch.Generator().manual_seed(7)
    x_BLD = torch.randn(2, 64, DIMS["D"], generator=gen).to(device, torch.bfloat16)
    dy_BLD = torch.randn(2, 64, DIMS["D"], generator=gen).to(device, torch.bfloat16)
    results = []
    for model in (original, patched):
        x = x_BLD.clone().requires_grad_()
        y = model(x)
        y.backward(dy_BLD)
        results.append({"y": y.detach(), "dx": x.grad,
                        **{name: p.grad for name, p in model.named_parameters()}})
    ours, theirs = results[1], results[0]
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        err = rel_err(ours[name], theirs[name])
        assert err <= 2e-2, f"{name}: relative error {err:.3g} between patched and torchtitan"
    fusemoe_tt.unpatch_torchtitan_moe(patched)
    assert "forward" not in vars(patched.routed_experts)
    with torch.no_grad():
        assert torch.equal(patched(x_BLD), original(x_BLD))


def test_plan_leaves_expert_parallel_dispatchers():
    """A dispatcher other than LocalTokenDispatcher (expert parallelism) is left, with the
    reason; so is a GroupedExperts whose _grouped_mm was replaced (a low-precision converter)."""
    model = build_moe("cpu")

    class OtherDispatcher(LocalTokenDispatcher):
        pass

    model.routed_experts.token_dispatcher.__class__ = OtherDispatcher
    report = fusemoe_tt.plan_torchtitan_moe(model)
    assert report.replaced == []
    assert "OtherDispatcher (expert parallel)" in report.left["routed_experts"]
    model = build_moe("cpu")
    model.routed_experts.inner_experts._grouped_mm = lambda **kw: None
    assert "_grouped_mm is overridden" in fusemoe_tt.plan_torchtitan_moe(model).left["routed_experts"]
    before = model.routed_experts.forward
    fusemoe_tt.patch_torchtitan_moe(model)
    assert model.routed_experts.forward == before


@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("grad_in_place", [False, True])
def test_options_reach_the_op(device_name, precision, grad_in_place):
    """patch_torchtitan_moe(precision=..., grad_in_place=...): two micro-batches through the
    patched RoutedExperts give the outputs and (accumulated) gradients of
    fusemoe.moe_experts_w1w3 called directly on copies of its Parameters with the same options,
    bitwise; with grad_in_place the Parameters' .grad is written by the _into op; at FP8 the
    module's cache quantizes once for both micro-batches."""
    device = device_of(device_name)
    module = build_moe(device).routed_experts
    wrapper = torch.nn.Module()
    wrapper.routed_experts = module
    fusemoe_tt.patch_torchtitan_moe(wrapper, precision=precision, grad_in_place=grad_in_place)
    experts = module.inner_experts
    weights = [w.detach().clone().requires_grad_()
               for w in (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)]
    B, L, D, K = 2, 37, DIMS["D"], DIMS["K"]
    gen = torch.Generator().manual_seed(11)
    ids_BLK, scores_BLK = routing(B, L, device, seed=5)
    in_place_before = fusemoe.ops._in_place_backward_count()
    for _ in range(2):
        x_BLD = torch.randn(B, L, D, generator=gen).to(device, torch.bfloat16)
        dy_BLD = torch.randn(B, L, D, generator=gen).to(device, torch.bfloat16)
        x, scores = x_BLD.clone().requires_grad_(), scores_BLK.clone().requires_grad_()
        y = module(x, scores, ids_BLK, torch.bincount(ids_BLK.reshape(-1), minlength=DIMS["E"]))
        y.backward(dy_BLD)
        x_ref, scores_ref = x_BLD.clone().requires_grad_(), scores_BLK.clone().requires_grad_()
        y_ref = fusemoe.moe_experts_w1w3(
            x_ref.reshape(-1, D), ids_BLK.reshape(-1, K).to(torch.int32),
            scores_ref.reshape(-1, K).float(), *weights, precision=precision,
            grad_in_place=grad_in_place)
        y_ref.backward(dy_BLD.reshape(-1, D))
        for name, got, ref in (("y", y, y_ref), ("dx", x.grad, x_ref.grad),
                               ("d_scores", scores.grad, scores_ref.grad)):
            assert torch.equal(got.reshape(ref.shape), ref), name
    # two micro-batches, patched and direct
    assert fusemoe.ops._in_place_backward_count() - in_place_before == (4 if grad_in_place else 0)
    for name, param, ref in zip(("dw1", "dw3", "dw2"),
                                (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF), weights):
        assert torch.equal(param.grad, ref.grad), name
    if precision == "fp8":
        assert module._fusemoe_fp8_cache.quantizations == 1
