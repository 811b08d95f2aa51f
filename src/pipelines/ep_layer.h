// The expert-parallel layer's pipeline on one rank (ep_layer.cu). Arguments are validated by
// src/api before these run.
#pragma once

#include "fusemoe/expert_parallel.h"
#include "kernels/routing.h"

namespace fusemoe {

// The layer one owner rank computes: its E/R experts over up to every rank's slots (each owner
// row a token of top-1; top_k itself may exceed E/R). Its limits, saved z and FP8 weight buffer.
LayerConfig ep_owner_layer(const EpConfig& config);
size_t ep_symmetric_layout_bytes(const EpConfig& config);
size_t ep_private_workspace_bytes(const EpConfig& config, WorkspaceUse use);
// The routing record (bad expert ids) of the last call that used this private workspace.
RoutingPlan ep_routing_plan(const EpConfig& config, void* workspace);
void ep_layer_forward(const EpConfig& config, const EpForwardArgs& args);
void ep_layer_backward(const EpConfig& config, const EpBackwardArgs& args);

}  // namespace fusemoe
