"""fusemoe for PyTorch: the MoE experts block (dispatch, gate/up GEMM, SwiGLU, down GEMM, weighted
combine, and its backward) from the fusemoe CUDA library, as a custom op with autograd
(torch.ops.fusemoe.moe_experts_forward / moe_experts_backward), an nn.Module and a drop-in for
Hugging Face Qwen3-MoE models. The CUDA library is the CMake target fusemoe_c (libfusemoe_c.so),
found through FUSEMOE_LIBRARY or at build/ of the repository.

    import fusemoe
    experts = fusemoe.MoEExperts(num_experts=128, hidden_dim=2048, intermediate_dim=768,
                                 device="cuda")                     # impl="fused" by default
    y = experts(hidden_states, top_k_index, top_k_weights)          # like Qwen3MoeExperts
    fusemoe.replace_qwen3_moe_experts(hf_model)                     # swap, weights shared
"""
from ._capi import FusemoeError, is_available, library_path
from .modules import MoEExperts, replace_qwen3_moe_experts
from .ops import DEFAULT_IMPL, check_expert_ids, moe_experts

__all__ = ["DEFAULT_IMPL", "FusemoeError", "MoEExperts", "check_expert_ids", "is_available",
           "library_path", "moe_experts", "replace_qwen3_moe_experts"]
__version__ = "0.1.0"
