// A plain copy within GPU 0 (local_copy.cu): by `blocks` SMs (1024 threads each, 16-byte loads,
// four in flight per thread), and by the copy engines (blocks = 0, cudaMemcpyAsync); and plain
// reads of `bytes` by `blocks` SMs (eight 16-byte loads in flight per thread), and plain writes.
#pragma once
#include <cstddef>
#include <vector>

namespace epx::bench {

struct LocalCopyTime {
  int blocks;                 // 0: copy engines
  std::vector<double> times;  // us per copy, timed iterations
};

std::vector<LocalCopyTime> time_local_copies(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters);
std::vector<LocalCopyTime> time_local_reads(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters);
std::vector<LocalCopyTime> time_local_writes(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters);

}  // namespace epx::bench
