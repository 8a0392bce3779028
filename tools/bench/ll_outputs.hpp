// The expert outputs y [L, R*M, H] bf16 ([1 + L, ...] with the shared expert) that a rank gives
// ll_combine, kept resident only where ll_combine reads them.
#pragma once
#include <cstdint>
#include <vector>

#include "verify/random_inputs.hpp"

namespace epx::bench {

// Rank `rank`'s y: random in the rows its ll_dispatch fills (the first n of local expert l's R*M
// slots, n = the (token, expert) pairs of every rank routed to it) and in one row more per
// expert, so a backend that reads one row too many still gets a wrong sum; zero elsewhere.
// Those other rows are most of y (an expert gets R*M*K/E of its R*M slots on average), so their
// pages go back to the system: y costs the memory of its used rows, not of the whole tensor.
// The whole tensor is resident while it is made: make one rank's at a time.
std::vector<uint16_t> ll_expert_outputs(const verify::Problem& p, int rank, uint64_t seed);

}  // namespace epx::bench
