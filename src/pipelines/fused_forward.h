// The fused forward pipeline (Impl::kFused) on sm_90a. Arguments are validated by src/api
// before this runs.
#pragma once

#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"

namespace fusemoe {

size_t fused_workspace_bytes(const LayerConfig& config);
void fused_forward(const LayerConfig& config, const ForwardArgs& args);
// The routing record of the last call that used `workspace` (for check_expert_ids).
RoutingPlan fused_routing_plan(const LayerConfig& config, void* workspace);

}  // namespace fusemoe
