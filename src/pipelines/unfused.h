// Host launchers of the unfused pipeline: Impl::kUnfused (bf16 pools) and Impl::kReferenceFp32
// (fp32 pools, fp32 GEMMs). Arguments are validated by src/api before these run.
#pragma once

#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"

namespace fusemoe {

size_t unfused_workspace_bytes(const LayerConfig& config, Impl impl);
void unfused_forward(const LayerConfig& config, Impl impl, const ForwardArgs& args);
void unfused_backward(const LayerConfig& config, Impl impl, const BackwardArgs& args);
// The routing record of the last call that used `workspace` (for check_expert_ids).
RoutingPlan unfused_routing_plan(const LayerConfig& config, Impl impl, void* workspace);

}  // namespace fusemoe
