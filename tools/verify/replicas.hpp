// Redundant experts (EPLB) for the tests and epx-bench, stated apart from src/core/replicas: replica
// tables, the choice rule of docs/semantics.md ("Redundant experts (EPLB)") written out again, and a
// problem's routing rewritten to the physical experts it picks.
#pragma once
#include <cstdint>
#include <vector>

#include "verify/random_inputs.hpp"

namespace epx::verify {

// epx-bench --replicas N: replica j of logical expert e is physical expert j * E + e (the logical
// layout N times over, so the replicas of e sit on N ranks spread evenly). [E, N].
std::vector<int32_t> spread_replicas(int64_t experts, int64_t replicas);

// A random table [E, M] of P physical experts: each logical expert one at least, every id once,
// the entries of a row at random columns (-1 elsewhere), in a seeded order.
std::vector<int32_t> random_replicas(int64_t experts, int64_t physical, int64_t width, uint64_t seed);

// The rule: the row's replicas on rank s (id / (P / R) == s) if any, else all of them, in table
// order; token t takes number (t + s) mod n. -1 stays -1.
int32_t chosen_replica(const std::vector<int32_t>& table, int64_t width, int64_t per_rank, int32_t logical, int s,
                       int64_t t);

// Each rank's [T*K] routing of a problem with the logical ids rewritten by the rule.
std::vector<std::vector<int32_t>> physical_routing(const Problem& p, const std::vector<int32_t>& table,
                                                   int64_t physical, int64_t width);

// The plain problem an EPLB problem (p.cfg.num_physical_experts > 0, p.replicas its table) equals:
// num_experts = P, no EPLB, the routing in physical ids. docs/semantics.md.
Problem physical_problem(const Problem& p);

}  // namespace epx::verify
