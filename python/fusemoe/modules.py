"""fusemoe.MoEExperts, a drop-in for Hugging Face transformers' experts modules (Qwen3MoeExperts
and the others fusemoe.patch_hf_experts swaps, see hf.py).

Parameters keep Hugging Face's (and the C++ API's) layout: gate_up_proj [E, 2I, H] (gate rows,
then up rows) and down_proj [E, H, I]. forward(hidden_states, top_k_index, top_k_weights) has
Qwen3MoeExperts.forward's signature; it converts what the op is strict about (router indices to
int32, router weights to fp32, activations and fp32 master weights to bf16) through autograd, so
gradients reach every input in its own dtype.
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k.
"""
import torch
from torch import nn

from . import _capi
from ._checks import _check_fp8_weight_grads, library_refusal
from .experts import moe_experts
from .ops import DEFAULT_IMPL


def _check_impl_name(impl):
    if not isinstance(impl, str):
        raise ValueError(f"fusemoe: impl must be a string such as \"unfused\", got {impl!r}")
    if _capi.is_available():
        _capi.impl_code(impl)  # raises FusemoeError listing the known names


def op_weights(w13, w2):
    """The experts' weights as the ops take them: bf16 (fp32 master weights are cast, through
    autograd, so their gradients come back in fp32)."""
    if w13.dtype != torch.bfloat16:
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    return w13, w2


def op_inputs(hidden_states, top_k_index, top_k_weights, hidden_dim):
    """What the ops are strict about, from a caller's tensors (any leading shape, index and
    weight dtypes): x [T, H] bf16, topk_idx [T, K] int32, topk_weights [T, K] fp32, contiguous,
    converted through autograd."""
    top_k = top_k_index.shape[-1]
    x_TH = hidden_states.reshape(-1, hidden_dim).to(torch.bfloat16).contiguous()
    topk_idx_TK = top_k_index.reshape(-1, top_k).to(torch.int32).contiguous()
    topk_weights_TK = top_k_weights.reshape(-1, top_k).to(torch.float32).contiguous()
    return x_TH, topk_idx_TK, topk_weights_TK


def output_like(y_TH, hidden_states):
    """y in hidden_states' dtype and shape."""
    y = y_TH.to(hidden_states.dtype)
    # A view only where the caller's shape needs one (FSDP2 warns about views it returns).
    return y if y.shape == hidden_states.shape else y.reshape(hidden_states.shape)


def _invalidate_fp8_caches(module, incompatible_keys):
    from .fp8 import invalidate_fp8_caches
    invalidate_fp8_caches()


class MoEExperts(nn.Module):
    """The experts block of an MoE layer, computed by fusemoe (impl: "unfused", ...)."""

    # Class default: a module pickled before the option existed (torch.save of the whole module)
    # unpickles without the attribute and keeps its old behaviour.
    fp8_weight_grads = False

    def __init__(self, num_experts, hidden_dim, intermediate_dim, impl=DEFAULT_IMPL, device=None,
                 dtype=torch.bfloat16, init_std=0.02, grad_in_place=False, recompute_z=False,
                 swiglu_clamp=None, precision="bf16", fp8_weight_grads=False):
        """grad_in_place: the backward adds the weight gradients straight into .grad (see
        fusemoe.moe_experts; eager mode, bf16 parameters, no gradient hooks on them).
        recompute_z: recompute the pre-activations in the backward instead of saving them in the
        forward (impl "fused": less activation memory, one more GEMM; see fusemoe.moe_experts).
        swiglu_clamp: None, or c: g <- min(g, c), u <- clamp(u, -c, c) (DeepSeek-V4's limit).
        precision: "bf16", or "fp8" (blockwise FP8 GEMMs, impl "fused", intermediate_dim a multiple
        of 128; the FP8 copy of the weights is rebuilt once per weight update: fusemoe.fp8).
        fp8_weight_grads (precision "fp8" only): the weight gradients' GEMMs in FP8 too (faster at
        many tokens per expert, less accurate: see fusemoe.moe_experts).
        A shape the library refuses at this impl and precision (docs/design.md, "Limits") raises
        ValueError here, with the library's reason, when the library is loaded."""
        super().__init__()
        _check_impl_name(impl)
        if precision not in ("bf16", "fp8"):
            raise ValueError(f"fusemoe: precision must be \"bf16\" or \"fp8\", got {precision!r}")
        _check_fp8_weight_grads(fp8_weight_grads, precision, "fusemoe.MoEExperts")
        # The library's limits now rather than at the first forward (top_k is the forward's).
        refusal = library_refusal(hidden_dim, intermediate_dim, num_experts, 1, impl, precision)
        if refusal is not None:
            raise ValueError(f"fusemoe.MoEExperts: the library refuses num_experts={num_experts}, "
                             f"hidden_dim={hidden_dim}, intermediate_dim={intermediate_dim} at "
                             f"impl={impl!r}, precision={precision!r}: {refusal}")
        self.precision = precision
        self.fp8_weight_grads = fp8_weight_grads
        from .fp8 import Fp8WeightCache
        self._fp8_cache = Fp8WeightCache()  # empty until a forward at precision "fp8"
        self.grad_in_place = bool(grad_in_place)
        self.recompute_z = bool(recompute_z)
        if isinstance(swiglu_clamp, bool):  # float(True) would be a clamp of 1.0
            raise ValueError(f"fusemoe: swiglu_clamp must be None or a number, got {swiglu_clamp!r}")
        self.swiglu_clamp = None if swiglu_clamp is None else float(swiglu_clamp)
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.impl = impl
        self.init_std = init_std
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_dim, intermediate_dim, device=device, dtype=dtype))
        self.reset_parameters()
        # FSDP2 and the like rewrite the unsharded weights without bumping their version: a load
        # must reach the FP8 cache some other way (fusemoe.fp8).
        self.register_load_state_dict_post_hook(_invalidate_fp8_caches)

    def reset_parameters(self):
        # Hugging Face's Qwen3-MoE initialisation: N(0, initializer_range = 0.02).
        nn.init.normal_(self.gate_up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.init_std)
        cache = getattr(self, "_fp8_cache", None)
        if cache is not None and cache.quantizations:  # new values, perhaps the same versions
            _invalidate_fp8_caches(self, None)

    @classmethod
    def from_experts(cls, experts, impl=DEFAULT_IMPL, grad_in_place=False, recompute_z=False,
                     swiglu_clamp=None, precision="bf16", fp8_weight_grads=False):
        """A MoEExperts over the very Parameter objects of `experts` (no copy): an optimizer or a
        state dict that holds them keeps working."""
        num_experts, two_intermediate, hidden_dim = experts.gate_up_proj.shape
        module = cls(num_experts, hidden_dim, two_intermediate // 2, impl=impl, device="meta",
                     grad_in_place=grad_in_place, recompute_z=recompute_z,
                     swiglu_clamp=swiglu_clamp, precision=precision,
                     fp8_weight_grads=fp8_weight_grads)
        module.gate_up_proj = experts.gate_up_proj
        module.down_proj = experts.down_proj
        return module

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """hidden_states [..., H], top_k_index [..., K] (int; -1 masks a slot), top_k_weights
        [..., K] (any float dtype) -> [..., H] in hidden_states' dtype."""
        w13_EFH, w2_EHI = op_weights(self.gate_up_proj, self.down_proj)
        x_TH, topk_idx_TK, topk_weights_TK = op_inputs(hidden_states, top_k_index, top_k_weights,
                                                       self.hidden_dim)
        fp8_weights = None
        if self.precision == "fp8":
            from .fp8 import cached_fp8_weights
            # Keyed on the Parameters themselves (an fp32 master's bf16 copy is new each call).
            fp8_weights = cached_fp8_weights(w13_EFH, w2_EHI, self._fp8_cache,
                                             (self.gate_up_proj, self.down_proj))
        y_TH = moe_experts(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl=self.impl,
                           grad_in_place=self.grad_in_place, recompute_z=self.recompute_z,
                           swiglu_clamp=self.swiglu_clamp, precision=self.precision,
                           fp8_weights=fp8_weights, fp8_weight_grads=self.fp8_weight_grads)
        return output_like(y_TH, hidden_states)

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, impl={self.impl!r}" +
                (", grad_in_place=True" if self.grad_in_place else "") +
                (", recompute_z=True" if self.recompute_z else "") +
                (f", swiglu_clamp={self.swiglu_clamp}" if self.swiglu_clamp is not None else "") +
                (f", precision={self.precision!r}" if self.precision != "bf16" else "") +
                (", fp8_weight_grads=True" if self.fp8_weight_grads else ""))
