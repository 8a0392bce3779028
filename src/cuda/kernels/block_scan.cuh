// An exclusive scan of 0/1 flags over any number of items with one thread block, in item
// order: what makes positions deterministic (rows ordered by source token).
#pragma once
#include <cub/block/block_scan.cuh>

namespace epx::detail {

constexpr int kScanThreads = 256;

// For i in [0, n): position(i, exclusive count of flagged items before i) for flagged items.
// Returns the total on every thread. Call with blockDim.x == kScanThreads.
template <typename Flag, typename Position>
__device__ int64_t block_scan_flags(int64_t n, Flag flag, Position position) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t running;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int64_t base = 0; base < n; base += kScanThreads) {
    const int64_t i = base + threadIdx.x;
    const int f = i < n && flag(i) ? 1 : 0;
    int before = 0, total = 0;
    Scan(temp).ExclusiveSum(f, before, total);
    if (f) position(i, running + before);
    __syncthreads();
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
  return running;
}

}  // namespace epx::detail
