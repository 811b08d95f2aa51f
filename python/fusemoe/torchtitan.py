"""torchtitan's MoE on fusemoe: patch_torchtitan_moe(model) swaps the forward of every
torchtitan RoutedExperts (token dispatch, GroupedExperts, score-weighted combine; module
torchtitan.models.common.moe, torchtitan 0.3) for fusemoe.moe_experts_w1w3 on the same
Parameters. GroupedExperts keeps w1 (gate) and w3 (up) [E, F, D] and w2 [E, D, F] apart, the
layout fusemoe reads in place: nothing is concatenated, and autograd gives w1, w3, w2, the tokens
and the routing scores their gradients as the module's own forward does.

    y_t = sum_k score[t,k] * W2_e (silu(W1_e x_t) * (W3_e x_t)),  e = expert_id[t,k]

torchtitan's legend: D model dimension (fusemoe's H), F expert hidden (I), E experts, K top-k,
T tokens (B*L). Like GroupedExperts, the swapped forward computes in bf16 (weights and tokens cast
per call, as GroupedExperts' .bfloat16() does) and returns the input's dtype; the scores stay fp32.

Swapped: a RoutedExperts whose dispatcher is the EP=1 LocalTokenDispatcher and whose experts are
a plain GroupedExperts (not a subclass, no _grouped_mm override such as the MXFP8 converter's).
Left alone, with the reason in the report: expert-parallel dispatchers (AllToAll, DeepEP; fusemoe's
own expert parallelism is fusemoe.ExpertParallelMoEExperts) and other experts classes. A weight
that is a DTensor at forward time (tensor or expert parallelism; FSDP2 unshards to plain tensors
before the forward) raises, naming it. Only impl "fused" reads separate gate and up weights.
precision="fp8": the FP8 weight buffer is cached per module, keyed on its Parameters' versions
(fusemoe.fp8's rules). grad_in_place=True writes dw1, dw3, dw2 into the Parameters' .grad where
they are bf16 and contiguous (passed as they are); a cast copy has no .grad of its own, so other
Parameters get their gradients through autograd as without it.
"""
import types

import torch

from .fp8 import Fp8WeightCache
from .hf import ExpertsDecision, PatchReport
from ._checks import _check_fp8_weight_grads
from .ops import DEFAULT_IMPL
from .separate import cached_fp8_weights_w1w3, moe_experts_w1w3


def _torchtitan_moe():
    """torchtitan's MoE module, or ImportError saying what is missing."""
    try:
        from torchtitan.models.common import moe, token_dispatcher
    except Exception as e:  # torchtitan imports much (spmd_types, tyro): any failure is "missing"
        raise ImportError(f"fusemoe.torchtitan needs torchtitan (models.common.moe): {e!r}") from e
    return moe, token_dispatcher


def _plain(weight, name):
    from torch.distributed.tensor import DTensor
    if isinstance(weight, DTensor):
        raise RuntimeError(
            f"fusemoe.torchtitan: {name} is a DTensor ({weight.placements}) at forward time: "
            "tensor and expert parallelism are not supported by this adapter (EP=1, no TP); "
            "FSDP2 is (it unshards to plain tensors before the forward)")
    return weight


def _routed_experts_forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                            num_local_tokens_per_expert_E):
    """RoutedExperts.forward on fusemoe: num_local_tokens_per_expert_E is not needed (fusemoe
    routes on the device from the expert ids)."""
    del num_local_tokens_per_expert_E
    batch, length, dim = x_BLD.shape
    top_k = topk_scores_BLK.shape[-1]
    experts = self.inner_experts
    w1_EFD = _plain(experts.w1_EFD, "w1_EFD")
    w3_EFD = _plain(experts.w3_EFD, "w3_EFD")
    w2_EDF = _plain(experts.w2_EDF, "w2_EDF")
    x_TD = x_BLD.reshape(batch * length, dim)
    w1_EFD_bf16, w3_EFD_bf16, w2_EDF_bf16 = (
        w.to(torch.bfloat16).contiguous() for w in (w1_EFD, w3_EFD, w2_EDF))
    options = self._fusemoe_options
    fp8_weights = None
    if options["precision"] == "fp8" and options["impl"] == "fused":
        fp8_weights = cached_fp8_weights_w1w3(w1_EFD_bf16, w3_EFD_bf16, w2_EDF_bf16,
                                              self._fusemoe_fp8_cache, (w1_EFD, w3_EFD, w2_EDF))
    y_TD = moe_experts_w1w3(
        x_TD.to(torch.bfloat16).contiguous(),
        topk_expert_ids_BLK.reshape(-1, top_k).to(torch.int32).contiguous(),
        topk_scores_BLK.reshape(-1, top_k).to(torch.float32).contiguous(),
        w1_EFD_bf16, w3_EFD_bf16, w2_EDF_bf16, fp8_weights=fp8_weights, **options)
    return y_TD.to(x_BLD.dtype).view(batch, -1, dim)


def _decide(name, module, moe, token_dispatcher):
    reasons = []
    dispatcher = module.token_dispatcher
    if type(dispatcher) is not token_dispatcher.LocalTokenDispatcher:
        reasons.append(f"token dispatcher {type(dispatcher).__name__} (expert parallel): only "
                       "LocalTokenDispatcher (EP=1) is supported")
    experts = module.inner_experts
    if type(experts) is not moe.GroupedExperts:
        reasons.append(f"experts {type(experts).__name__}: only torchtitan's GroupedExperts")
    elif "_grouped_mm" in vars(experts):
        reasons.append("GroupedExperts._grouped_mm is overridden (e.g. a low-precision converter)")
    return ExpertsDecision(name=name, class_name=type(module).__name__, swap=not reasons,
                           reasons=reasons)


def plan_torchtitan_moe(model):
    """What patch_torchtitan_moe(model) would do, changing nothing: a fusemoe.PatchReport."""
    moe, token_dispatcher = _torchtitan_moe()
    return PatchReport([_decide(name, m, moe, token_dispatcher)
                        for name, m in model.named_modules() if isinstance(m, moe.RoutedExperts)])


def patch_torchtitan_moe(model, impl=DEFAULT_IMPL, recompute_z=False, grad_in_place=False,
                         precision="bf16", fp8_weight_grads=False):
    """Swaps the forward of every supported RoutedExperts in model (in place; the Parameters,
    their names and state dicts are unchanged) and returns the fusemoe.PatchReport. recompute_z,
    grad_in_place, precision ("bf16" or "fp8") and fp8_weight_grads as in
    fusemoe.moe_experts_w1w3 (see the module docstring). unpatch_torchtitan_moe restores the
    forwards."""
    _check_fp8_weight_grads(fp8_weight_grads, precision, "fusemoe.patch_torchtitan_moe")
    moe, token_dispatcher = _torchtitan_moe()
    report = plan_torchtitan_moe(model)
    modules = dict(model.named_modules())
    options = dict(impl=impl, recompute_z=recompute_z, grad_in_place=grad_in_place,
                   precision=precision, fp8_weight_grads=fp8_weight_grads)
    for decision in report.decisions:
        if decision.swap:
            module = modules[decision.name]
            module._fusemoe_options = options
            module._fusemoe_fp8_cache = Fp8WeightCache()
            module.forward = types.MethodType(_routed_experts_forward, module)
    return report


def unpatch_torchtitan_moe(model):
    """Restores torchtitan's forward on every module patch_torchtitan_moe swapped."""
    for module in model.modules():
        if "forward" in vars(module) and getattr(module.forward, "__func__", None) is _routed_experts_forward:
            del module.forward
            del module._fusemoe_options, module._fusemoe_fp8_cache
