// Exclusive scans over any number of items with one thread block, in item order: what makes
// positions deterministic (rows ordered by source token) and layouts computed in parallel; and
// one warp's inclusive sum over its lanes.
#pragma once
#include <cub/block/block_scan.cuh>

namespace epx::detail {

constexpr int kScanThreads = 256;

// For i in [0, n): out(i, sum of value(j) over j < i, value(i)), value(i) evaluated once, by
// thread i % kThreads. Returns the total on every thread. Call with blockDim.x == kThreads.
template <typename T, int kThreads = kScanThreads, typename Value, typename Out>
__device__ int64_t block_exclusive_sum(int64_t n, Value value, Out out) {
  using Scan = cub::BlockScan<T, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t running;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int64_t base = 0; base < n; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const T v = i < n ? value(i) : T{0};
    T before{}, total{};
    Scan(temp).ExclusiveSum(v, before, total);
    if (i < n) out(i, running + before, v);
    __syncthreads();
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
  return running;
}

// The sum of v over lanes 0..lane of the warp (every lane calls it).
template <typename T>
__device__ T warp_inclusive_sum(T v, int lane) {
  for (int o = 1; o < 32; o *= 2) {
    const T up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

// For i in [0, n): position(i, exclusive count of flagged items before i) for flagged items.
// Returns the total on every thread. Call with blockDim.x == kScanThreads.
template <typename Flag, typename Position>
__device__ int64_t block_scan_flags(int64_t n, Flag flag, Position position) {
  return block_exclusive_sum<int>(n, [&](int64_t i) { return flag(i) ? 1 : 0; }, [&](int64_t i, int64_t before, int f) {
    if (f) position(i, before);
  });
}

}  // namespace epx::detail
