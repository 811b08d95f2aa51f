// The start of every single-GPU workspace: the routing plan, then the regions a pipeline carves
// after it. With a null base only bytes are counted (WorkspaceCarver), so workspace_bytes and
// the call's layout come from the same code.
#pragma once

#include <cstdint>

#include "common/workspace_carver.h"
#include "kernels/routing.h"

namespace fusemoe {

// Lays out `plan` at `base` (unless only counting) and returns the carver of the regions after it.
inline WorkspaceCarver carver_after_routing_plan(void* base, int64_t max_tokens, int64_t top_k, int64_t num_experts,
                                                 RoutingPlan* plan) {
  if (base) carve_routing_plan(static_cast<char*>(base), max_tokens, top_k, num_experts, plan);
  return WorkspaceCarver(base, routing_plan_bytes(max_tokens, top_k, num_experts));
}

}  // namespace fusemoe
