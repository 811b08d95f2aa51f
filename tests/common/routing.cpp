#include "common/routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "fusemoe/error.h"

namespace fusemoe::harness {

const char* routing_name(Routing routing) {
  switch (routing) {
    case Routing::kUniform: return "uniform";
    case Routing::kSkewed: return "skewed";
    case Routing::kOneExpert: return "one_expert";
    case Routing::kAllSlotsOne: return "all_slots_one";
    case Routing::kFewExperts: return "few_experts";
    case Routing::kMasked: return "masked";
  }
  return "?";
}

bool parse_routing(const std::string& name, Routing* routing) {
  for (Routing r : kAllRoutings) {
    if (name == routing_name(r)) {
      *routing = r;
      return true;
    }
  }
  return false;
}

TopK make_topk(int64_t num_tokens, int64_t num_experts, int64_t top_k, Routing routing, uint64_t seed) {
  FUSEMOE_CHECK(num_experts >= 1 && top_k >= 1, "make_topk: E=" << num_experts << " K=" << top_k);
  const bool distinct = routing == Routing::kUniform || routing == Routing::kSkewed ||
                        routing == Routing::kOneExpert || routing == Routing::kMasked;
  FUSEMOE_CHECK(!distinct || top_k <= num_experts, "make_topk: K=" << top_k << " distinct of E=" << num_experts);
  const int32_t fixed_expert = static_cast<int32_t>(3 % num_experts);
  std::mt19937_64 rank_rng(seed ^ 0x5EED0F5EEDull);
  std::vector<double> log_p_E(num_experts, 0.0);
  if (routing == Routing::kSkewed) {
    std::vector<int64_t> rank_E(num_experts);
    std::iota(rank_E.begin(), rank_E.end(), 0);
    std::shuffle(rank_E.begin(), rank_E.end(), rank_rng);
    for (int64_t e = 0; e < num_experts; ++e) {
      log_p_E[e] = -kSkewExponent * std::log(static_cast<double>(rank_E[e] + 1));
    }
  }
  if (routing == Routing::kOneExpert) log_p_E[fixed_expert] = -std::numeric_limits<double>::infinity();
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(num_tokens));
  auto uniform_open = [&rng]() { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1p-53; };

  TopK out;
  out.idx_TK.resize(num_tokens * top_k);
  out.w_TK.resize(num_tokens * top_k);
  std::vector<double> logits_E(num_experts);
  std::vector<int32_t> order_E(num_experts);
  std::vector<double> chosen_logit(top_k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t e = 0; e < num_experts; ++e) logits_E[e] = log_p_E[e] - std::log(-std::log(uniform_open()));
    // The K largest logits: K distinct experts drawn without replacement with p(e).
    const int64_t num_drawn = std::min(top_k, num_experts);
    std::iota(order_E.begin(), order_E.end(), 0);
    std::partial_sort(order_E.begin(), order_E.begin() + num_drawn, order_E.end(),
                      [&](int32_t a, int32_t b) { return logits_E[a] > logits_E[b]; });
    for (int64_t j = 0; j < top_k; ++j) {
      int32_t e = order_E[std::min(j, num_drawn - 1)];
      switch (routing) {
        case Routing::kOneExpert:
          if (j == 0) e = fixed_expert;
          else e = order_E[j - 1];  // the K-1 best others (fixed_expert's logit is -inf)
          break;
        case Routing::kAllSlotsOne: e = fixed_expert; break;
        case Routing::kFewExperts:
          e = static_cast<int32_t>(j % 2 == 0 ? 1 % num_experts : std::max<int64_t>(num_experts - 2, 0));
          break;
        default: break;
      }
      out.idx_TK[t * top_k + j] = e;
      chosen_logit[j] = std::isfinite(logits_E[e]) ? logits_E[e] : -std::log(-std::log(uniform_open()));
    }
    const double max_logit = *std::max_element(chosen_logit.begin(), chosen_logit.end());
    double sum = 0.0;
    for (int64_t j = 0; j < top_k; ++j) sum += std::exp(chosen_logit[j] - max_logit);
    for (int64_t j = 0; j < top_k; ++j) {
      out.w_TK[t * top_k + j] = static_cast<float>(std::exp(chosen_logit[j] - max_logit) / sum);
    }
    if (routing == Routing::kMasked) {
      for (int64_t j = 0; j < top_k; ++j) {
        if (t % 5 == 0 || uniform_open() < 0.3) out.idx_TK[t * top_k + j] = -1;
      }
    }
  }
  return out;
}

RoutingStats routing_stats(const std::vector<int32_t>& idx_TK, int64_t num_experts) {
  std::vector<int64_t> rows_E(num_experts, 0);
  RoutingStats stats;
  for (int32_t e : idx_TK) {
    if (e < 0 || e >= num_experts) continue;
    ++rows_E[e];
    ++stats.valid_rows;
  }
  stats.min_rows = *std::min_element(rows_E.begin(), rows_E.end());
  stats.max_rows = *std::max_element(rows_E.begin(), rows_E.end());
  stats.num_empty_experts = std::count(rows_E.begin(), rows_E.end(), int64_t{0});
  return stats;
}

ExpertRows sort_by_expert(const std::vector<int32_t>& idx_TK, int64_t num_experts) {
  ExpertRows rows;
  rows.counts.assign(num_experts, 0);
  for (int32_t e : idx_TK) {
    if (e >= 0 && e < num_experts) ++rows.counts[e];
  }
  rows.offsets.assign(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) rows.offsets[e + 1] = rows.offsets[e] + rows.counts[e];
  rows.row_slot.assign(rows.offsets.back(), 0);
  rows.slot_row.assign(idx_TK.size(), -1);
  std::vector<int32_t> next(rows.offsets.begin(), rows.offsets.end() - 1);
  for (size_t s = 0; s < idx_TK.size(); ++s) {
    const int32_t e = idx_TK[s];
    if (e < 0 || e >= num_experts) continue;
    const int32_t r = next[e]++;
    rows.row_slot[r] = static_cast<int32_t>(s);
    rows.slot_row[s] = r;
  }
  return rows;
}

std::vector<int32_t> topk_with_counts(const std::vector<int32_t>& counts, int64_t num_slots, uint64_t seed) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  FUSEMOE_CHECK(total <= num_slots, "topk_with_counts: " << total << " rows for " << num_slots << " slots");
  std::vector<int32_t> slots(num_slots);
  std::iota(slots.begin(), slots.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int32_t> idx(num_slots, -1);
  int64_t next = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int32_t i = 0; i < counts[e]; ++i) idx[slots[next++]] = static_cast<int32_t>(e);
  }
  return idx;
}

}  // namespace fusemoe::harness
