// The fused backward pipeline (Impl::kFused) on sm_90a. Arguments are validated by
// src/api before this runs (the same checks as for the unfused backward).
#pragma once

#include "fusemoe/fusemoe.h"
#include "kernels/routing.h"

namespace fusemoe {

// Workspace of the fused backward; the routing plan sits at its start, as in the fused
// forward's workspace, so fused_routing_plan() finds the record of either call. The room for
// the recomputed z comes last, so a backward given the forward's saved z (z_saved) needs less.
size_t fused_backward_workspace_bytes(const LayerConfig& config, bool z_saved);
void fused_backward(const LayerConfig& config, const BackwardArgs& args);

}  // namespace fusemoe
