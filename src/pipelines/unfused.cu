// The unfused MoE layer from standard parts: device routing (counting sort), row gather, cuBLAS
// grouped GEMMs (cublasGemmGroupedBatchedEx, fp32 accumulation), SwiGLU, weighted combine, and
// the backward likewise. It is the "good libraries, no fusion" baseline and, instantiated with
// fp32 pools (Impl::kReferenceFp32), the GPU oracle at full size.
//
// Host synchronisation: cuBLAS's grouped GEMM takes its per-group sizes (m, n, k) in host
// arrays, so each call copies the per-expert row counts to the host once (one stream sync).
// This makes the baseline not CUDA-graph capturable; the fused implementation avoids it.
//
// Backward math (design.md §1), per row r of expert e with slot weight w:
//   z = xs W1^T (recomputed), a = dy W2, h = swiglu(z), d_topk_w = <h, a> (= <o, dy>),
//   dh = w a, dz = swiglu'(dh), dxs = dz W1, dx_t = sum_j dxs,
//   dW2_e = dys^T (w h), dW1_e = dz^T xs.
#include "pipelines/unfused.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common/workspace_carver.h"
#include "pipelines/plan_workspace.h"
#include "kernels/moe_elementwise.h"
#include "kernels/routing.h"

namespace fusemoe {
namespace {

using bf16 = __nv_bfloat16;

#define FUSEMOE_CUBLAS_CHECK(expr)                                                  \
  do {                                                                              \
    cublasStatus_t fusemoe_cublas_status_ = (expr);                                 \
    FUSEMOE_CHECK(fusemoe_cublas_status_ == CUBLAS_STATUS_SUCCESS,                  \
                  #expr << " failed: " << cublasGetStatusName(fusemoe_cublas_status_) \
                        << " (" << cublasGetStatusString(fusemoe_cublas_status_) << ")"); \
  } while (0)

constexpr int kMaxGemmsPerCall = 5;  // backward: z, a, dxs, dW2, dW1

// One cuBLAS handle per (thread, device): handles are not safe to share across threads that
// set different streams. They are deliberately never destroyed: destroying them from a static
// destructor can run after the CUDA runtime has shut down.
cublasHandle_t cublas_handle() {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  int device = 0;
  FUSEMOE_CUDA_CHECK(cudaGetDevice(&device));
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasHandle_t handle = nullptr;
  FUSEMOE_CUBLAS_CHECK(cublasCreate(&handle));
  // Default math: fp32 GEMMs stay fp32 (no TF32), which the fp32 reference relies on.
  FUSEMOE_CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
  handles.emplace(device, handle);
  return handle;
}

// Row-major C[M,N] = op(A)[M,K] . op(B)[K,N]; ld* are the stored row lengths (row-major).
struct RowMajorGemm {
  const void* a;
  const void* b;
  void* c;
  int m, n, k;
  bool trans_a, trans_b;
  int lda, ldb, ldc;
};

// A list of same-typed problems for one cublasGemmGroupedBatchedEx call (one group each).
struct GemmBatch {
  std::vector<RowMajorGemm> problems;
  cudaDataType ab_type;
  cudaDataType c_type;
  float beta;
};

// Copies the pointer arrays of every batch of one layer call to the device in one upload, so
// the GEMMs later run back to back without a host round trip between them. Pageable source:
// cudaMemcpyAsync returns once the data is staged, so the host vector may die afterwards.
void upload_gemm_pointers(const std::vector<const GemmBatch*>& batches, void** device_ptr_arrays,
                          cudaStream_t stream) {
  std::vector<const void*> host_ptrs;
  for (const GemmBatch* batch : batches) {
    for (const auto& p : batch->problems) host_ptrs.push_back(p.b);  // cuBLAS "A" (see below)
    for (const auto& p : batch->problems) host_ptrs.push_back(p.a);  // cuBLAS "B"
    for (const auto& p : batch->problems) host_ptrs.push_back(p.c);
  }
  if (host_ptrs.empty()) return;
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(device_ptr_arrays, host_ptrs.data(),
                                     host_ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice,
                                     stream));
}

// Runs one batch whose pointer arrays start at `device_ptrs`; returns the next batch's start.
// cuBLAS is column-major: row-major C = A.B is column-major C^T = B^T.A^T, so the operands
// swap and m/n swap.
void** run_gemm_batch(const GemmBatch& batch, void** device_ptrs, cudaStream_t stream) {
  const int count = static_cast<int>(batch.problems.size());
  if (count == 0) return device_ptrs;
  cublasHandle_t handle = cublas_handle();
  FUSEMOE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  FUSEMOE_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  std::vector<cublasOperation_t> trans_a(count), trans_b(count);
  std::vector<int> m(count), n(count), k(count), lda(count), ldb(count), ldc(count), sizes(count, 1);
  std::vector<float> alpha(count, 1.0f), beta(count, batch.beta);
  for (int i = 0; i < count; ++i) {
    const RowMajorGemm& p = batch.problems[i];
    trans_a[i] = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    trans_b[i] = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    m[i] = p.n;
    n[i] = p.m;
    k[i] = p.k;
    lda[i] = p.ldb;
    ldb[i] = p.lda;
    ldc[i] = p.ldc;
  }
  const void* const* a_ptrs = const_cast<const void* const*>(device_ptrs);
  const void* const* b_ptrs = const_cast<const void* const*>(device_ptrs + count);
  void* const* c_ptrs = device_ptrs + 2 * count;
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      handle, trans_a.data(), trans_b.data(), m.data(), n.data(), k.data(), alpha.data(), a_ptrs,
      batch.ab_type, lda.data(), b_ptrs, batch.ab_type, ldb.data(), beta.data(), c_ptrs,
      batch.c_type, ldc.data(), count, sizes.data(), CUBLAS_COMPUTE_32F);
  FUSEMOE_CHECK(status == CUBLAS_STATUS_SUCCESS,
                "cublasGemmGroupedBatchedEx (" << count << " groups, A/B type " << batch.ab_type
                    << ", C type " << batch.c_type << ") failed: " << cublasGetStatusName(status));
  return device_ptrs + 3 * count;
}

// Workspace of the unfused pipeline, carved from one allocation (base == nullptr: sizes only).
// Pool element type is bf16 (kUnfused) or float (kReferenceFp32). Rows: R_max = max_tokens*K.
template <typename Pool>
struct UnfusedWorkspace {
  RoutingPlan plan;
  void** gemm_ptr_arrays = nullptr;  // [kMaxGemmsPerCall * 3 * E]
  Pool* xs_RH = nullptr;    // gathered x
  Pool* o_or_dys_RH = nullptr;  // forward: o = h W2^T; backward: gathered dy
  Pool* z_RF = nullptr;     // [R, 2I] gate|up
  Pool* h_or_wh_RI = nullptr;   // forward: h; backward: w*h
  Pool* a_RI = nullptr;     // backward: dy W2
  Pool* dz_RF = nullptr;    // backward
  Pool* dxs_RH = nullptr;   // backward
  // Weight-gradient scratch in the pool type (see backward_impl for when it is used).
  Pool* dw13_scratch = nullptr;
  Pool* dw2_scratch = nullptr;
  // kReferenceFp32 only: weights widened to fp32.
  float* w13_f32 = nullptr;
  float* w2_f32 = nullptr;
  size_t total_bytes = 0;

  UnfusedWorkspace(const LayerConfig& c, void* base) {
    const int64_t rows = c.max_tokens * c.top_k;
    const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
    WorkspaceCarver carver = carver_after_routing_plan(base, c.max_tokens, c.top_k, E, &plan);
    gemm_ptr_arrays = carver.take<void*>(kMaxGemmsPerCall * 3 * E * sizeof(void*));
    xs_RH = carver.take<Pool>(rows * H * sizeof(Pool));
    o_or_dys_RH = carver.take<Pool>(rows * H * sizeof(Pool));
    z_RF = carver.take<Pool>(rows * 2 * I * sizeof(Pool));
    h_or_wh_RI = carver.take<Pool>(rows * I * sizeof(Pool));
    a_RI = carver.take<Pool>(rows * I * sizeof(Pool));
    dz_RF = carver.take<Pool>(rows * 2 * I * sizeof(Pool));
    dxs_RH = carver.take<Pool>(rows * H * sizeof(Pool));
    dw13_scratch = carver.take<Pool>(E * 2 * I * H * sizeof(Pool));
    dw2_scratch = carver.take<Pool>(E * H * I * sizeof(Pool));
    if (std::is_same<Pool, float>::value) {
      w13_f32 = carver.take<float>(E * 2 * I * H * sizeof(float));
      w2_f32 = carver.take<float>(E * H * I * sizeof(float));
    }
    total_bytes = carver.bytes();
  }
};

template <typename Pool>
constexpr cudaDataType pool_type() {
  return std::is_same<Pool, float>::value ? CUDA_R_32F : CUDA_R_16BF;
}

SwigluClamp clamp_of(const LayerConfig& c) { return SwigluClamp{c.use_swiglu_clamp, c.swiglu_clamp}; }

// Routes on the device, then copies the per-expert counts to the host (the baseline's one
// sync) and turns invalid expert ids into an error, or, when the caller passed an
// expert_id_report, leaves them to that report (the caller's choice of one reporting channel).
// Returns counts; offsets follow from them.
std::vector<int32_t> route_and_read_counts(const LayerConfig& c, const int32_t* topk_idx,
                                           int64_t num_tokens, const RoutingPlan& plan,
                                           int32_t* expert_id_report, cudaStream_t stream) {
  launch_routing(topk_idx, num_tokens, c.top_k, c.num_experts, plan, expert_id_report, stream);
  std::vector<int32_t> counts(c.num_experts);
  int32_t bad[3] = {0, 0, 0};
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(counts.data(), plan.expert_counts, counts.size() * 4,
                                     cudaMemcpyDeviceToHost, stream));
  FUSEMOE_CUDA_CHECK(cudaMemcpyAsync(bad, plan.bad_id_info, sizeof(bad), cudaMemcpyDeviceToHost,
                                     stream));
  FUSEMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (expert_id_report == nullptr) check_bad_id_record(bad, c.num_experts, c.top_k);
  return counts;
}

// What both passes start from: the routing (per-expert counts, rows in use), the weights in the
// pool type (widened into the workspace for the fp32 reference) and x gathered into xs.
template <typename Pool>
struct RoutedRows {
  std::vector<int32_t> counts;
  int64_t num_rows = 0;
  const Pool* w13 = nullptr;
  const Pool* w2 = nullptr;
};

template <typename Pool, typename Args>
RoutedRows<Pool> route_and_gather_x(const LayerConfig& c, const Args& args, const UnfusedWorkspace<Pool>& ws) {
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
  cudaStream_t stream = args.stream;
  RoutedRows<Pool> r;
  r.counts = route_and_read_counts(c, args.topk_idx, args.num_tokens, ws.plan, args.expert_id_report, stream);
  for (int32_t n : r.counts) r.num_rows += n;
  r.w13 = static_cast<const Pool*>(args.w13);
  r.w2 = static_cast<const Pool*>(args.w2);
  if (std::is_same<Pool, float>::value) {
    launch_widen_bf16(args.w13, E * 2 * I * H, ws.w13_f32, stream);
    launch_widen_bf16(args.w2, E * H * I, ws.w2_f32, stream);
    r.w13 = reinterpret_cast<const Pool*>(ws.w13_f32);
    r.w2 = reinterpret_cast<const Pool*>(ws.w2_f32);
  }
  launch_gather_rows(static_cast<const bf16*>(args.x), ws.plan.row_slot, r.num_rows, c.top_k, H, ws.xs_RH,
                     stream);
  return r;
}

template <typename Pool>
void forward_impl(const LayerConfig& c, const ForwardArgs& args) {
  UnfusedWorkspace<Pool> ws(c, args.workspace);
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
  cudaStream_t stream = args.stream;
  const auto [counts, num_rows, w13, w2] = route_and_gather_x(c, args, ws);

  GemmBatch gate_up{{}, pool_type<Pool>(), pool_type<Pool>(), 0.0f};
  GemmBatch down{{}, pool_type<Pool>(), pool_type<Pool>(), 0.0f};
  int64_t row0 = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int rows = counts[e];
    if (rows > 0) {
      // z[rows, 2I] = xs[rows, H] . W13_e^T ;  o[rows, H] = h[rows, I] . W2_e^T
      gate_up.problems.push_back({ws.xs_RH + row0 * H, w13 + e * 2 * I * H, ws.z_RF + row0 * 2 * I,
                                  rows, int(2 * I), int(H), false, true, int(H), int(H), int(2 * I)});
      down.problems.push_back({ws.h_or_wh_RI + row0 * I, w2 + e * H * I, ws.o_or_dys_RH + row0 * H,
                               rows, int(H), int(I), false, true, int(I), int(I), int(H)});
    }
    row0 += rows;
  }
  upload_gemm_pointers({&gate_up, &down}, ws.gemm_ptr_arrays, stream);
  void** ptrs = run_gemm_batch(gate_up, ws.gemm_ptr_arrays, stream);
  launch_swiglu_forward(ws.z_RF, num_rows, I, clamp_of(c), ws.h_or_wh_RI, stream);
  run_gemm_batch(down, ptrs, stream);
  launch_combine_forward(ws.o_or_dys_RH, ws.plan.slot_row, args.topk_weights, args.num_tokens,
                         c.top_k, H, args.y, stream);
}

template <typename Pool>
void backward_impl(const LayerConfig& c, const BackwardArgs& args) {
  UnfusedWorkspace<Pool> ws(c, args.workspace);
  const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
  const bool bf16_grads = args.weight_grad_dtype == WeightGradDtype::kBFloat16;
  cudaStream_t stream = args.stream;
  const auto [counts, num_rows, w13, w2] = route_and_gather_x(c, args, ws);
  constexpr bool kReference = std::is_same<Pool, float>::value;
  launch_gather_rows(static_cast<const bf16*>(args.dy), ws.plan.row_slot, num_rows, c.top_k, H,
                     ws.o_or_dys_RH, stream);
  Pool* dys_RH = ws.o_or_dys_RH;

  // Weight gradients. cublasGemmGroupedBatchedEx has no bf16-in/fp32-out mode, so the GEMMs
  // write the pool type: straight into dw13/dw2 when those are bf16 (beta = 1 accumulates),
  // otherwise into scratch that a finalise kernel widens and adds (for kUnfused this rounds the
  // fp32 gradients through bf16, as torch._grouped_mm does for bf16 parameters).
  const bool direct = !kReference && bf16_grads;
  void* dw13_target = direct ? args.dw13 : static_cast<void*>(ws.dw13_scratch);
  void* dw2_target = direct ? args.dw2 : static_cast<void*>(ws.dw2_scratch);
  const size_t grad_elem = sizeof(Pool);
  const float grad_beta = (direct && args.accumulate_weight_grads) ? 1.0f : 0.0f;

  GemmBatch recompute_z{{}, pool_type<Pool>(), pool_type<Pool>(), 0.0f};
  GemmBatch dy_w2{{}, pool_type<Pool>(), pool_type<Pool>(), 0.0f};
  GemmBatch dxs{{}, pool_type<Pool>(), pool_type<Pool>(), 0.0f};
  // A null dw2 or dw13 (frozen weights): its GEMMs, zeroing and finalise are skipped.
  const bool want_dw2 = args.dw2 != nullptr, want_dw13 = args.dw13 != nullptr;
  GemmBatch dw2{{}, pool_type<Pool>(), pool_type<Pool>(), grad_beta};
  GemmBatch dw13{{}, pool_type<Pool>(), pool_type<Pool>(), grad_beta};
  int64_t row0 = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int rows = counts[e];
    if (rows > 0) {
      char* dw13_e = static_cast<char*>(dw13_target) + e * 2 * I * H * grad_elem;
      char* dw2_e = static_cast<char*>(dw2_target) + e * H * I * grad_elem;
      // z[rows,2I] = xs . W13_e^T
      recompute_z.problems.push_back({ws.xs_RH + row0 * H, w13 + e * 2 * I * H, ws.z_RF + row0 * 2 * I,
                                      rows, int(2 * I), int(H), false, true, int(H), int(H), int(2 * I)});
      // a[rows,I] = dys[rows,H] . W2_e[H,I]
      dy_w2.problems.push_back({dys_RH + row0 * H, w2 + e * H * I, ws.a_RI + row0 * I,
                                rows, int(I), int(H), false, false, int(H), int(I), int(I)});
      // dxs[rows,H] = dz[rows,2I] . W13_e[2I,H]
      dxs.problems.push_back({ws.dz_RF + row0 * 2 * I, w13 + e * 2 * I * H, ws.dxs_RH + row0 * H,
                              rows, int(H), int(2 * I), false, false, int(2 * I), int(H), int(H)});
      // dW2_e[H,I] = dys^T[H,rows] . wh[rows,I]
      if (want_dw2) {
        dw2.problems.push_back({dys_RH + row0 * H, ws.h_or_wh_RI + row0 * I, dw2_e,
                                int(H), int(I), rows, true, false, int(H), int(I), int(I)});
      }
      // dW13_e[2I,H] = dz^T[2I,rows] . xs[rows,H]
      if (want_dw13) {
        dw13.problems.push_back({ws.dz_RF + row0 * 2 * I, ws.xs_RH + row0 * H, dw13_e,
                                 int(2 * I), int(H), rows, true, false, int(2 * I), int(H), int(H)});
      }
    }
    row0 += rows;
  }
  upload_gemm_pointers({&recompute_z, &dy_w2, &dxs, &dw2, &dw13}, ws.gemm_ptr_arrays, stream);
  void** ptrs = run_gemm_batch(recompute_z, ws.gemm_ptr_arrays, stream);
  ptrs = run_gemm_batch(dy_w2, ptrs, stream);
  launch_swiglu_backward(ws.z_RF, ws.a_RI, ws.plan.row_slot, args.topk_weights, num_rows, I,
                         clamp_of(c), args.d_topk_weights, ws.h_or_wh_RI, ws.dz_RF, stream);
  ptrs = run_gemm_batch(dxs, ptrs, stream);
  ptrs = run_gemm_batch(dw2, ptrs, stream);
  run_gemm_batch(dw13, ptrs, stream);
  launch_combine_backward(ws.dxs_RH, ws.plan.slot_row, args.num_tokens, c.top_k, H, args.dx,
                          args.d_topk_weights, stream);
  const int64_t dw13_elems = want_dw13 ? 2 * I * H : 0, dw2_elems = want_dw2 ? H * I : 0;
  if (direct) {
    if (!args.accumulate_weight_grads) {
      launch_zero_empty_expert_grads(ws.plan.expert_counts, E, dw13_elems, dw2_elems, true, args.dw13,
                                     args.dw2, stream);
    }
  } else {
    // Experts with no rows: their scratch was never written; zero it so finalise is exact.
    launch_zero_empty_expert_grads(ws.plan.expert_counts, E, dw13_elems, dw2_elems, !kReference,
                                   ws.dw13_scratch, ws.dw2_scratch, stream);
    launch_finalize_weight_grad(ws.dw13_scratch, E * dw13_elems, args.accumulate_weight_grads,
                                bf16_grads, args.dw13, stream);
    launch_finalize_weight_grad(ws.dw2_scratch, E * dw2_elems, args.accumulate_weight_grads,
                                bf16_grads, args.dw2, stream);
  }
}

}  // namespace

size_t unfused_workspace_bytes(const LayerConfig& config, Impl impl) {
  if (impl == Impl::kReferenceFp32) return UnfusedWorkspace<float>(config, nullptr).total_bytes;
  return UnfusedWorkspace<bf16>(config, nullptr).total_bytes;
}

RoutingPlan unfused_routing_plan(const LayerConfig& config, Impl impl, void* workspace) {
  if (impl == Impl::kReferenceFp32) return UnfusedWorkspace<float>(config, workspace).plan;
  return UnfusedWorkspace<bf16>(config, workspace).plan;
}

void unfused_forward(const LayerConfig& config, Impl impl, const ForwardArgs& args) {
  if (impl == Impl::kReferenceFp32) {
    forward_impl<float>(config, args);
  } else {
    forward_impl<bf16>(config, args);
  }
}

void unfused_backward(const LayerConfig& config, Impl impl, const BackwardArgs& args) {
  if (impl == Impl::kReferenceFp32) {
    backward_impl<float>(config, args);
  } else {
    backward_impl<bf16>(config, args);
  }
}

}  // namespace fusemoe
