"""fusemoe in Hugging Face transformers models: find the experts modules whose math is this
layer's (SwiGLU experts without bias, gate and up rows concatenated as [gate; up], weights
[E, 2I, H] and [E, H, I]) and swap each for a fusemoe.MoEExperts over the same Parameters.

transformers 5 marks its experts classes with @use_experts_implementation, which records the
layout on every instance (has_bias, is_transposed, is_concatenated, has_gate) and gives the
class a default gate function (act_fn(g) * u) unless the model defines its own _apply_gate.
A module is swapped only when all of these say "fusemoe's math" and the library accepts the
layer's shape; every other experts module is left alone with the reasons, e.g. gpt-oss: biases,
its own gate function (clamped, alpha-scaled sigmoid, up + 1, interleaved rows), transposed
weights, H = 2880 not a multiple of 128. DeepSeek-V4's experts (SwiGLU with its swiglu_limit
clamp) are the one custom gate function recognised: fusemoe's swiglu_clamp computes it.
Routing stays the model's: the swapped module receives the router's top-k ids and weights. A
masked slot must be id -1 for fusemoe; an id >= E (which transformers' own loops skip) is
reported as a bad id (FusemoeError), never used.
"""
import dataclasses

from torch import nn

from ._checks import _check_fp8_weight_grads, library_refusal
from .modules import MoEExperts
from .ops import DEFAULT_IMPL

_SILU_ACTIVATIONS = ("silu", "swish")
_SILU_CLASSES = ("SiLU", "SiLUActivation")
# Experts classes whose own _apply_gate is min(g, c), clamp(u, -c, c), silu(g) * u: the
# attribute that holds c.
_CLAMPED_SWIGLU_LIMIT_ATTRIBUTE = {"DeepseekV4Experts": "limit"}
# transformers' @use_experts_implementation layout flags and the values fusemoe computes.
_LAYOUT_FLAGS = (
    ("is_transposed", False, "weights stored transposed ([E, H, 2I] / [E, I, H])"),
    ("is_concatenated", True, "gate and up rows interleaved, not [gate; up]"),
    ("has_gate", True, "no gate projection (not a gated linear unit)"),
)


@dataclasses.dataclass
class ExpertsDecision:
    """What patch_hf_experts does with one experts module."""
    name: str                 # module path in the model, e.g. "model.layers.0.mlp.experts"
    class_name: str
    swap: bool
    reasons: list             # why it is left alone (empty when swapped)
    swiglu_clamp: float = None  # the clamp the swapped module computes (DeepSeek-V4), or None


@dataclasses.dataclass
class PatchReport:
    """The decisions of plan_hf_experts / patch_hf_experts, in module order."""
    decisions: list

    @property
    def replaced(self):
        """Names of the modules swapped (or, for a plan, to be swapped)."""
        return [d.name for d in self.decisions if d.swap]

    @property
    def left(self):
        """{name: "reason; reason"} of the experts modules left alone."""
        return {d.name: "; ".join(d.reasons) for d in self.decisions if not d.swap}

    def __str__(self):
        lines = [f"fusemoe: {len(self.replaced)} experts module(s) swapped, "
                 f"{len(self.left)} left alone"]
        lines += [f"  swapped {d.name} ({d.class_name}"
                  + (f", swiglu_clamp={d.swiglu_clamp}" if d.swiglu_clamp is not None else "")
                  + ")" for d in self.decisions if d.swap]
        lines += [f"  left    {d.name} ({d.class_name}): {'; '.join(d.reasons)}"
                  for d in self.decisions if not d.swap]
        return "\n".join(lines)


def _is_experts_candidate(module):
    """An experts module: 3-D gate_up_proj / down_proj Parameters (transformers' layout) or a
    class named *Experts."""
    if isinstance(module, MoEExperts):
        return True
    weights = [getattr(module, attr, None) for attr in ("gate_up_proj", "down_proj", "up_proj")]
    if any(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        return True
    return type(module).__name__.endswith("Experts")


def _activation_reasons(module):
    """Reasons the gate function is not silu(g) * u (optionally clamped), and the clamp."""
    cls = type(module)
    apply_gate = getattr(cls, "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        limit_attribute = _CLAMPED_SWIGLU_LIMIT_ATTRIBUTE.get(cls.__name__)
        if limit_attribute is None:
            return [f"its own gate function {cls.__name__}._apply_gate (not silu(g) * u)"], None
        clamp = getattr(module, limit_attribute, None)
        if not isinstance(clamp, (int, float)) or isinstance(clamp, bool):
            return [f"{cls.__name__}.{limit_attribute} = {clamp!r} is not a number"], None
        swiglu_clamp = float(clamp)
    else:
        swiglu_clamp = None
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    act_class = type(getattr(module, "act_fn", None)).__name__
    if act not in _SILU_ACTIVATIONS and act_class not in _SILU_CLASSES:
        return [f"activation {act or act_class} is not SiLU"], None
    return [], swiglu_clamp


def _shape_reasons(module, impl, precision):
    """Reasons the weights are not [E, 2I, H] / [E, H, I] (read in the module's own layout, so a
    transposed module's H and I are its real ones) or the library refuses the layer's shape."""
    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(w13, nn.Parameter) and isinstance(w2, nn.Parameter)
            and w13.dim() == 3 and w2.dim() == 3):
        return ["no 3-D gate_up_proj and down_proj Parameters"]
    transposed = bool(getattr(module, "is_transposed", False))
    if transposed:
        num_experts, hidden, two_intermediate = w13.shape
    else:
        num_experts, two_intermediate, hidden = w13.shape
    intermediate = two_intermediate // 2
    expected_w2 = ((num_experts, intermediate, hidden) if transposed
                   else (num_experts, hidden, intermediate))
    if two_intermediate % 2 or tuple(w2.shape) != expected_w2:
        return [f"gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} do not form "
                "one experts layer"]
    top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", 1)
    refusal = library_refusal(hidden, intermediate, num_experts, top_k, impl, precision)
    if refusal is not None:
        return [f"the library refuses H={hidden}, I={intermediate}, E={num_experts}, "
                f"K={top_k}: {refusal}"]
    return []


def _decide(name, module, impl, precision):
    decision = ExpertsDecision(name, type(module).__name__, False, [])
    if isinstance(module, MoEExperts):
        decision.reasons.append("already a fusemoe.MoEExperts")
        return decision
    biases = [n for n, _ in module.named_parameters(recurse=False) if "bias" in n]
    if biases or getattr(module, "has_bias", False):
        decision.reasons.append("has biases" + (f" ({', '.join(biases)})" if biases else ""))
    for attribute, expected, reason in _LAYOUT_FLAGS:
        if getattr(module, attribute, expected) != expected:
            decision.reasons.append(reason)
    activation_reasons, decision.swiglu_clamp = _activation_reasons(module)
    decision.reasons += activation_reasons
    decision.reasons += _shape_reasons(module, impl, precision)
    decision.swap = not decision.reasons
    if not decision.swap:
        decision.swiglu_clamp = None
    return decision


def plan_hf_experts(model, impl=DEFAULT_IMPL, precision="bf16"):
    """What patch_hf_experts would do, changing nothing: a PatchReport."""
    return PatchReport([_decide(name, module, impl, precision)
                        for name, module in model.named_modules()
                        if name and _is_experts_candidate(module)])


def _swap(model, decision, impl, grad_in_place, recompute_z, precision, fp8_weight_grads):
    experts = model.get_submodule(decision.name)
    parent_name, _, child_name = decision.name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name,
            MoEExperts.from_experts(experts, impl=impl, grad_in_place=grad_in_place,
                                    recompute_z=recompute_z, swiglu_clamp=decision.swiglu_clamp,
                                    precision=precision, fp8_weight_grads=fp8_weight_grads))


def patch_hf_experts(model, impl=DEFAULT_IMPL, grad_in_place=False, recompute_z=False,
                     strict=True, precision="bf16", fp8_weight_grads=False):
    """Swaps every transformers experts module that computes fusemoe's math (see the module
    docstring) for a fusemoe.MoEExperts sharing its Parameter objects (an optimizer or state
    dict that holds them keeps working), leaves the others alone, and returns the PatchReport
    (report.replaced, report.left with the reasons; print(report) lists both).
    strict=True raises ValueError, listing every reason, when no module is swapped.
    grad_in_place, recompute_z, precision, fp8_weight_grads: see fusemoe.MoEExperts (a layer the
    library refuses at that precision, e.g. fp8 with I % 128 != 0, is left with the library's
    reason)."""
    _check_fp8_weight_grads(fp8_weight_grads, precision, "fusemoe.patch_hf_experts")
    report = plan_hf_experts(model, impl, precision)
    if strict and not report.replaced:
        detail = ("\n" + str(report)) if report.decisions else (
            " (no experts module found: transformers >= 5 experts classes hold 3-D gate_up_proj "
            "and down_proj Parameters)")
        raise ValueError(f"fusemoe.patch_hf_experts: no experts module swapped{detail}")
    for decision in report.decisions:
        if decision.swap:
            _swap(model, decision, impl, grad_in_place, recompute_z, precision, fp8_weight_grads)
    return report


def replace_qwen3_moe_experts(model, impl=DEFAULT_IMPL, grad_in_place=False, recompute_z=False,
                              precision="bf16", fp8_weight_grads=False):
    """patch_hf_experts for Qwen3MoeExperts modules only, and strict about them: raises
    ValueError if there is none or one cannot be swapped. Returns the names replaced."""
    _check_fp8_weight_grads(fp8_weight_grads, precision, "fusemoe.replace_qwen3_moe_experts")
    decisions = [d for d in plan_hf_experts(model, impl, precision).decisions
                 if d.class_name == "Qwen3MoeExperts"]
    if not decisions:
        raise ValueError("fusemoe.replace_qwen3_moe_experts: the model has no Qwen3MoeExperts "
                         "module")
    refused = [f"{d.name}: {'; '.join(d.reasons)}" for d in decisions if not d.swap]
    if refused:
        raise ValueError("fusemoe.replace_qwen3_moe_experts: " + "; ".join(refused))
    for decision in decisions:
        _swap(model, decision, impl, grad_in_place, recompute_z, precision, fp8_weight_grads)
    return [d.name for d in decisions]
