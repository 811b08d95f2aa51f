"""fusemoe for PyTorch: the MoE experts block (dispatch, gate/up GEMM, SwiGLU, down GEMM, weighted
combine, and its backward) from the fusemoe CUDA library, as a custom op with autograd
(torch.ops.fusemoe.moe_experts_forward / moe_experts_backward), an nn.Module and a drop-in for
Hugging Face MoE models' experts (Qwen3-MoE, Qwen3-Next, OLMoE, Mixtral, Qwen2-MoE, ...). The
CUDA library is the CMake target fusemoe_c (libfusemoe_c.so): FUSEMOE_LIBRARY, else the copy
`pip install .` put in the package, else build/ of the repository. The ops' kernels are C++ (the
native binding libfusemoe_torch.so beside it, built where torch is importable) or, without it,
Python over ctypes: fusemoe.native_binding_status() says which and why.

    import fusemoe
    experts = fusemoe.MoEExperts(num_experts=128, hidden_dim=2048, intermediate_dim=768,
                                 device="cuda")                     # impl="fused" by default
    y = experts(hidden_states, top_k_index, top_k_weights)          # like Qwen3MoeExperts
    report = fusemoe.patch_hf_experts(hf_model)                      # swap, weights shared
    print(report)                                                   # swapped / left and why

Expert parallelism over a torch.distributed group (fusemoe.expert_parallel has the rules):
    experts = fusemoe.ExpertParallelMoEExperts.from_experts(hf_experts, max_tokens_per_rank=8192)
"""
from ._capi import FusemoeError, is_available, library_path
from .expert_parallel import ExpertParallelMoEExperts
from .hf import PatchReport, patch_hf_experts, plan_hf_experts, replace_qwen3_moe_experts
from .modules import MoEExperts
from .experts import moe_experts
from .ops import DEFAULT_IMPL, check_expert_ids
from .separate import moe_experts_w1w3
from ._native import status as native_binding_status

__all__ = ["DEFAULT_IMPL", "ExpertParallelMoEExperts", "FusemoeError", "MoEExperts",
           "PatchReport", "check_expert_ids", "is_available", "library_path", "moe_experts",
           "moe_experts_w1w3",
           "native_binding_status",
           "patch_hf_experts", "plan_hf_experts", "replace_qwen3_moe_experts"]
__version__ = "0.1.0"
