// Shared helpers of the expert-parallel suites (co-resident ranks in one process, and ranks in
// processes over CUDA IPC): a rank's share of a gpu_test_util.h problem and its call arguments.
#pragma once

#include <cstdint>
#include <vector>

#include "fusemoe/expert_parallel.h"
#include "gpu/gpu_test_util.h"

namespace fusemoe::test {

// Rows [first, first + count) of a [rows, width] host array.
template <class T>
std::vector<T> rows_of(const std::vector<T>& all, int64_t first, int64_t count, int64_t width) {
  return std::vector<T>(all.begin() + first * width, all.begin() + (first + count) * width);
}

// A rank's share of a problem on the device: the rows of its tokens [first_token, + num_tokens)
// (x, topk ids and weights, dy) and the weights of its experts [first_expert, + num_experts).
struct RankInputs {
  DeviceBuffer x, idx, w, dy, w13, w2;

  RankInputs() = default;
  RankInputs(const HostProblem& p, int64_t first_token, int64_t num_tokens, int64_t first_expert,
             int64_t num_experts)
      : x(DeviceBuffer::from(rows_of(p.x_TH, first_token, num_tokens, p.d.H))),
        idx(DeviceBuffer::from(rows_of(p.idx_TK, first_token, num_tokens, p.d.K))),
        w(DeviceBuffer::from(rows_of(p.w_TK, first_token, num_tokens, p.d.K))),
        dy(DeviceBuffer::from(rows_of(p.dy_TH, first_token, num_tokens, p.d.H))),
        w13(DeviceBuffer::from(rows_of(p.w13_EFH, first_expert, num_experts, 2 * p.d.I * p.d.H))),
        w2(DeviceBuffer::from(rows_of(p.w2_EHI, first_expert, num_experts, p.d.H * p.d.I))) {}

  // The call of these inputs (num_sms and stream left at their defaults).
  EpCall call(int64_t num_tokens, void* const* peer_symmetric, const DeviceBuffer& workspace) const {
    EpCall c;
    harness::set_layer_inputs(c, x.get(), idx.as<int32_t>(), w.as<float>(), w13.get(), w2.get(), num_tokens,
                              workspace.get(), workspace.bytes());
    c.peer_symmetric = peer_symmetric;
    return c;
  }
};

}  // namespace fusemoe::test
