// The low-latency combine's expert outputs: ll_outputs.hpp.
#include "bench/ll_outputs.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace epx::bench {

namespace {

// Rows of each local expert of `rank` that its ll_dispatch fills.
// Rows of each output expert: the shared one's (this rank's tokens), then the routed ones'.
std::vector<int64_t> rows_per_expert(const verify::Problem& p, int rank) {
  const int64_t l_count = p.cfg.num_experts / p.ranks, first = p.cfg.shared_expert ? 1 : 0;
  std::vector<int64_t> rows(first + l_count, 0);
  if (first) rows[0] = p.inputs[rank].tokens;
  for (const verify::RankInput& in : p.inputs)
    for (const int32_t e : in.idx)
      if (e >= 0 && e / l_count == rank) ++rows[first + e % l_count];
  return rows;
}

// Gives the whole pages inside [begin, end) back to the system. On Linux they read as zeros
// afterwards (private anonymous memory, which a large vector's storage is), as these bytes
// already are; where madvise fails they just stay resident.
void release(uint16_t* begin, uint16_t* end) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t from = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t to = reinterpret_cast<uintptr_t>(end) / page * page;
  if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);
}

}  // namespace

std::vector<uint16_t> ll_expert_outputs(const verify::Problem& p, int rank, uint64_t seed) {
  const int64_t h = p.cfg.hidden, slots = p.ranks * p.cfg.max_tokens_per_rank;
  std::vector<int64_t> rows = rows_per_expert(p, rank);
  int64_t kept = 0;
  for (int64_t& n : rows) kept += n = std::min(n + 1, slots);  // one row past the filled ones
  const std::vector<uint16_t> values = verify::random_bf16(kept * h, seed);
  std::vector<uint16_t> y(rows.size() * slots * h, 0);
  const uint16_t* next = values.data();
  for (size_t l = 0; l < rows.size(); ++l) {
    uint16_t* expert = y.data() + l * slots * h;
    std::copy_n(next, rows[l] * h, expert);
    next += rows[l] * h;
    release(expert + rows[l] * h, expert + slots * h);
  }
  return y;
}

}  // namespace epx::bench
