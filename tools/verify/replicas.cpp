#include "verify/replicas.hpp"

#include <algorithm>
#include <random>

namespace epx::verify {

std::vector<int32_t> spread_replicas(int64_t experts, int64_t replicas) {
  std::vector<int32_t> table(experts * replicas);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t j = 0; j < replicas; ++j) table[e * replicas + j] = static_cast<int32_t>(j * experts + e);
  return table;
}

std::vector<int32_t> random_replicas(int64_t experts, int64_t physical, int64_t width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(physical);
  for (int64_t p = 0; p < physical; ++p) ids[p] = static_cast<int32_t>(p);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<std::vector<int32_t>> rows(experts);
  for (int64_t e = 0; e < experts; ++e) rows[e].push_back(ids[e]);
  for (int64_t p = experts; p < physical; ++p) {  // the extra ones to random experts with room
    int64_t e = static_cast<int64_t>(rng() % experts);
    while (static_cast<int64_t>(rows[e].size()) >= width) e = (e + 1) % experts;
    rows[e].push_back(ids[p]);
  }
  std::vector<int32_t> table(experts * width, -1);
  for (int64_t e = 0; e < experts; ++e) {
    std::vector<int64_t> cols(width);
    for (int64_t j = 0; j < width; ++j) cols[j] = j;
    std::shuffle(cols.begin(), cols.end(), rng);
    std::sort(cols.begin(), cols.begin() + static_cast<int64_t>(rows[e].size()));  // the row's order kept
    for (size_t i = 0; i < rows[e].size(); ++i) table[e * width + cols[i]] = rows[e][i];
  }
  return table;
}

int32_t chosen_replica(const std::vector<int32_t>& table, int64_t width, int64_t per_rank, int32_t logical, int s,
                       int64_t t) {
  if (logical < 0) return -1;
  std::vector<int32_t> own, all;
  for (int64_t j = 0; j < width; ++j) {
    const int32_t p = table[logical * width + j];
    if (p < 0) continue;
    all.push_back(p);
    if (p / per_rank == s) own.push_back(p);
  }
  const std::vector<int32_t>& c = own.empty() ? all : own;
  return c[(t + s) % static_cast<int64_t>(c.size())];
}

std::vector<std::vector<int32_t>> physical_routing(const Problem& p, const std::vector<int32_t>& table,
                                                   int64_t physical, int64_t width) {
  std::vector<std::vector<int32_t>> out(p.ranks);
  const int64_t k_count = p.cfg.topk;
  for (int s = 0; s < p.ranks; ++s)
    for (size_t i = 0; i < p.inputs[s].idx.size(); ++i)
      out[s].push_back(chosen_replica(table, width, physical / p.ranks, p.inputs[s].idx[i], s,
                                      static_cast<int64_t>(i) / k_count));
  return out;
}

Problem physical_problem(const Problem& p) {
  const int64_t physical = p.cfg.num_physical_experts;
  const int64_t width = p.cfg.max_replicas > 0 ? p.cfg.max_replicas : physical - p.cfg.num_experts + 1;
  Problem plain = p;
  const auto routing = physical_routing(p, p.replicas, physical, width);
  for (int r = 0; r < p.ranks; ++r) plain.inputs[r].idx = routing[r];
  plain.cfg.num_experts = physical;
  plain.cfg.num_physical_experts = plain.cfg.max_replicas = 0;
  plain.replicas.clear();
  return plain;
}

}  // namespace epx::verify
