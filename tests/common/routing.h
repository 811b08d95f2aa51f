// The named routings that tests and benchmarks draw top-k expert ids from, and the expert-sorted
// rows the GEMM launchers take (the order src/kernels/routing.h produces on the device).
//
// Every token draws Gumbel logits g_e = log p(e) + Gumbel noise; its K slots get the experts
// the routing names, and the weights are the softmax of those experts' logits (the normalised
// top-k weights of a softmax router). p is uniform except for kSkewed (p(e) ~ 1/(rank+1)^1.2
// with ranks a permutation fixed by the seed, so the same experts are popular at every T).
// Legend: T tokens, K top-k, E experts, S = T*K slots, R rows (valid slots).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fusemoe::harness {

enum class Routing {
  kUniform,      // K distinct experts per token, uniformly at random
  kSkewed,       // K distinct experts per token, Zipf-like popularity
  kOneExpert,    // slot 0 of every token -> expert 3 (that expert holds T rows), rest uniform
  kAllSlotsOne,  // every slot -> expert 3 (repeated ids: all S rows on one expert)
  kFewExperts,   // only experts 1 and E-2: every other expert is empty
  kMasked,       // uniform with ~30% of slots masked (-1) and every 5th token fully masked
};

constexpr Routing kAllRoutings[] = {Routing::kUniform,    Routing::kSkewed, Routing::kOneExpert,
                                    Routing::kAllSlotsOne, Routing::kFewExperts, Routing::kMasked};

// Zipf exponent of kSkewed: the most popular of 128 experts gets ~27% of the first draws.
constexpr double kSkewExponent = 1.2;

const char* routing_name(Routing routing);
// False when `name` is none of the names routing_name gives.
bool parse_routing(const std::string& name, Routing* routing);

struct TopK {
  std::vector<int32_t> idx_TK;  // expert id per slot, -1 masked
  std::vector<float> w_TK;      // routing weight per slot (masked slots too: never read)
};

// Draws for T tokens from the seed alone (the same seed and T give the same ids and weights).
TopK make_topk(int64_t num_tokens, int64_t num_experts, int64_t top_k, Routing routing, uint64_t seed);

// How the rows spread over the experts.
struct RoutingStats {
  int64_t valid_rows = 0;  // R
  int64_t min_rows = 0, max_rows = 0, num_empty_experts = 0;
};
RoutingStats routing_stats(const std::vector<int32_t>& idx_TK, int64_t num_experts);

// Valid slots in expert order, increasing slot order inside an expert (a stable counting sort).
struct ExpertRows {
  std::vector<int32_t> counts;    // [E]
  std::vector<int32_t> offsets;   // [E+1], offsets[E] = R
  std::vector<int32_t> row_slot;  // [R]
  std::vector<int32_t> slot_row;  // [S], -1 for a slot without a row
  int64_t num_rows() const { return offsets.back(); }
};
ExpertRows sort_by_expert(const std::vector<int32_t>& idx_TK, int64_t num_experts);

// Ids for `num_slots` slots with exactly counts[e] slots on expert e, at random slots (repeated
// ids per token allowed); the remaining slots are masked. sum(counts) <= num_slots.
std::vector<int32_t> topk_with_counts(const std::vector<int32_t>& counts, int64_t num_slots, uint64_t seed);

}  // namespace fusemoe::harness
