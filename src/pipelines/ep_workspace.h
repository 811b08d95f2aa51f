// Memory of the expert-parallel layer (include/fusemoe/expert_parallel.h): the symmetric
// workspace every rank allocates with the same layout (so a field of rank d lives at rank d's
// base plus the field's offset), and each rank's private workspace. Sizes are the worst case:
// every token of every rank routed to one rank.
//   T = max_tokens, S = T*K slots per rank, El = E/R local experts, P = R*T pool rows (one per
//   (source rank, token) with an expert here), Q = R*S owner rows (one per routed slot here).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/workspace_carver.h"
#include "fusemoe/expert_parallel.h"
#include "kernels/routing.h"
#include "launchers/sm90_fp8_gemms.h"
#include "launchers/sm90_grouped_gemm.h"

namespace fusemoe {

// Local experts (E / R) one rank can own: the owner plan runs one thread per local expert in one
// block (kernels/ep_exchange.cu, kPlanThreads). validate_ep_config enforces it before any
// device work; kMaxExperts keeps E / R below it today.
constexpr int64_t kEpMaxLocalExperts = 1024;

// What source rank s sends owner rank d (in d's symmetric workspace, slot s): the rows of d's
// experts among s's routed slots, ordered by (local expert, slot), and the tokens they read,
// each once, in increasing order.
struct EpInbox {
  int32_t* counts;      // [El] rows per local expert
  int32_t* num_tokens;  // [1]
  int32_t* tokens;      // [T] token ids on the source
  int32_t* entry_pos;   // [S] index into tokens of each row's token
  int32_t* entry_slot;  // [S] the row's slot t*K + j on the source
  float* entry_weight;  // [S] its routing weight
};

struct EpSymmetric {
  int32_t* epoch;         // [1] calls made (this rank's own counter; all ranks agree)
  int32_t* message_flag;  // [R] message_flag[s]: the last call whose message from source s is here
  int32_t* rows_flag;     // [R] rows_flag[d]: the last call whose rows from owner d are here
  EpInbox inbox[kMaxRanks];
  void* x_stage;          // [T, H] bf16: this rank's x, readable by the owners
  void* dy_stage;         // [T, H] bf16: this rank's dy (backward)
  void* slots;            // [S, H] bf16: rows pushed back by the owners (y or dx parts)
  float* d_topk_stage;    // [S] fp32: router-weight gradients pushed back (backward)
  size_t total_bytes = 0;

  EpSymmetric(const EpConfig& c, void* base) {
    const LayerConfig& l = c.layer;
    const int64_t T = l.max_tokens, S = T * l.top_k, El = l.num_experts / c.world_size;
    WorkspaceCarver carver(base, 0);
    epoch = carver.take<int32_t>(sizeof(int32_t));
    message_flag = carver.take<int32_t>(kMaxRanks * sizeof(int32_t));
    rows_flag = carver.take<int32_t>(kMaxRanks * sizeof(int32_t));
    for (int s = 0; s < c.world_size; ++s) {
      EpInbox& in = inbox[s];
      in.counts = carver.take<int32_t>(El * 4);
      in.num_tokens = carver.take<int32_t>(4);
      in.tokens = carver.take<int32_t>(T * 4);
      in.entry_pos = carver.take<int32_t>(S * 4);
      in.entry_slot = carver.take<int32_t>(S * 4);
      in.entry_weight = carver.take<float>(S * 4);
    }
    for (int s = c.world_size; s < kMaxRanks; ++s) inbox[s] = EpInbox{};
    x_stage = carver.take(T * l.hidden * 2);
    dy_stage = carver.take(T * l.hidden * 2);
    slots = carver.take(S * l.hidden * 2);
    d_topk_stage = carver.take<float>(S * 4);
    total_bytes = carver.bytes();
  }
};

// The owner side of a call: its rows in (local expert, source, slot) order.
struct EpOwnerPlan {
  int32_t* expert_offsets;  // [El + 1]; expert_offsets[El] = rows in use
  int32_t* bases;           // [R][El]: first row of (source s, expert l)
  int32_t* entry_begin;     // [R][El + 1]: prefix of counts within source s's entries
  int32_t* pool_base;       // [R + 1]: first pool row of each source's tokens
  int32_t* row_pool;        // [Q] pool row of each row's token
  int32_t* row_src;         // [Q] its source rank
  int32_t* row_slot;        // [Q] its slot on the source
  float* row_weight;        // [Q] its routing weight
  int32_t* row_identity;    // [Q] r (the backward's dgrad reads weights by row through it)
};

// A rank's private workspace. Forward: routing, owner plan, pool, h. Backward adds the dy pool,
// the expert-sorted x and dy rows, dz, wh, router partials and (unless saved) z.
// Precision::kFp8Blockwise: the forward keeps h in E4M3 (no bf16 h) with the x pool quantized per
// row; the backward adds the dy pool quantized per row, dz in E4M3 and (when z is recomputed) the
// x pool quantized per row. Every FP8 region follows the BF16 ones, so BF16 sizes are unchanged.
// Row scales: token-major [pool rows, H/128] for the pools (the GEMMs gather their rows), block-
// major [K/128, rows_pad] for h and dz (rows_pad = sm90_fp8_rows_pad(Q)), as on one GPU.
struct EpPrivate {
  RoutingPlan plan;         // source side: this rank's slots by global expert
  int32_t* dest_TR;         // [T, R]: d if token t has a slot on rank d, else -1
  RoutingPlan token_plan;   // tokens by destination rank (dest_TR sorted, E = K = R)
  EpOwnerPlan owner;
  void* x_pool;             // [P, H] bf16
  void* h;                  // [Q, I] bf16 (forward)
  void* dy_pool = nullptr;  // [P, H] bf16 (backward)
  void* xs = nullptr;       // [Q, H] bf16
  void* dys = nullptr;      // [Q, H] bf16
  void* dz = nullptr;       // [Q, 2I] bf16
  void* wh = nullptr;       // [Q, I] bf16
  float* partials = nullptr;  // [Q, router partials per row]
  void* z = nullptr;        // [Q, 2I] bf16 (backward without saved z)
  void* x_pool_fp8 = nullptr;      // [P, H] E4M3 (FP8: forward, backward without saved z)
  float* x_pool_scales = nullptr;  // [P, H/128]
  void* h_fp8 = nullptr;           // [Q, I] E4M3 (FP8 forward)
  float* h_scales = nullptr;       // [I/128, rows_pad]
  void* dy_pool_fp8 = nullptr;     // [P, H] E4M3 (FP8 backward)
  float* dy_pool_scales = nullptr; // [P, H/128]
  void* dz_fp8 = nullptr;          // [Q, 2I] E4M3 (FP8 backward)
  float* dz_scales = nullptr;      // [2I/128, rows_pad]
  size_t total_bytes = 0;

  EpPrivate(const EpConfig& c, void* base, WorkspaceUse use) {
    const LayerConfig& l = c.layer;
    const int64_t R = c.world_size, T = l.max_tokens, S = T * l.top_k, El = l.num_experts / R;
    const int64_t P = R * T, Q = R * S, H = l.hidden, I = l.intermediate;
    if (base) carve_routing_plan(static_cast<char*>(base), T, l.top_k, l.num_experts, &plan);
    size_t reserved = routing_plan_bytes(T, l.top_k, l.num_experts);
    if (base) carve_routing_plan(static_cast<char*>(base) + reserved, T, R, R, &token_plan);
    reserved += routing_plan_bytes(T, R, R);
    WorkspaceCarver carver(base, reserved);
    dest_TR = carver.take<int32_t>(T * R * 4);
    owner.expert_offsets = carver.take<int32_t>((El + 1) * 4);
    owner.bases = carver.take<int32_t>(R * El * 4);
    owner.entry_begin = carver.take<int32_t>(R * (El + 1) * 4);
    owner.pool_base = carver.take<int32_t>((R + 1) * 4);
    owner.row_pool = carver.take<int32_t>(Q * 4);
    owner.row_src = carver.take<int32_t>(Q * 4);
    owner.row_slot = carver.take<int32_t>(Q * 4);
    owner.row_weight = carver.take<float>(Q * 4);
    owner.row_identity = carver.take<int32_t>(Q * 4);
    x_pool = carver.take(P * H * 2);
    const bool fp8 = l.precision == Precision::kFp8Blockwise;
    if (use == WorkspaceUse::kForward) {
      h = fp8 ? nullptr : carver.take(Q * I * 2);
    } else {
      h = nullptr;
      dy_pool = carver.take(P * H * 2);
      xs = carver.take(Q * H * 2);
      dys = carver.take(Q * H * 2);
      dz = carver.take(Q * 2 * I * 2);
      wh = carver.take(Q * I * 2);
      // ceil(I / 128) per row: the BF16 dgrad's narrowest tiles, so also enough for FP8's 256-wide ones.
      partials = carver.take<float>(Q * sm90_router_partials_per_row(I) * 4);
      if (use == WorkspaceUse::kBackward) z = carver.take(Q * 2 * I * 2);
    }
    if (fp8) {
      const int64_t rows_pad = sm90_fp8_rows_pad(Q);
      auto take_x_pool_fp8 = [&] {
        x_pool_fp8 = carver.take(P * H);
        x_pool_scales = carver.take<float>(P * (H / 128) * 4);
      };
      if (use == WorkspaceUse::kForward) {
        take_x_pool_fp8();
        h_fp8 = carver.take(Q * I);
        h_scales = carver.take<float>((I / 128) * rows_pad * 4);
      } else {
        dy_pool_fp8 = carver.take(P * H);
        dy_pool_scales = carver.take<float>(P * (H / 128) * 4);
        dz_fp8 = carver.take(Q * 2 * I);
        dz_scales = carver.take<float>((2 * I / 128) * rows_pad * 4);
        if (use == WorkspaceUse::kBackward) take_x_pool_fp8();  // the z recompute gathers its rows
      }
    }
    total_bytes = carver.bytes();
  }
};

}  // namespace fusemoe
