// How fast a few SMs can write local memory, by store kind
// (docs/lab/2026-12-01-performance-diary.md, "The floor of each op"): epx-bench's `local_write`
// baseline measured ~55-60 GB/s per SM at 24 SMs, about half what an SM reads, and that rate
// bounds the expert-major receiver. Each variant writes the same bytes with the same blocks; if
// one of them writes faster per SM, the floor is the store kind's, not the SM's. Prints one line
// per (variant, blocks): median us of 20, TB/s, GB/s per block.
//   usage: epx-store-probe [MiB (default 224)] [blocks... (default 8 24 132)]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kThreads = 1024;

// One 16-byte store per thread and step, the grid striding over the buffer (`local_write`); the
// vector index is masked by `wrap` (all ones, or a smaller buffer's size minus one: the same
// stores into a buffer that stays in L2).
template <bool kStreaming>
__global__ void __launch_bounds__(kThreads) plain_stores(int4* dst, size_t n, size_t wrap) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const int4 v{static_cast<int>(threadIdx.x), 1, 2, 3};
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (kStreaming) __stcs(dst + (i & wrap), v);  // evict-first: lines need not stay in L2
    else dst[i & wrap] = v;
  }
}

// Each block writes its own contiguous part, a warp 2 KiB at a time (four stores per lane): the
// receiver's pattern (a warp writes whole rows), not the grid-wide stride.
__global__ void __launch_bounds__(kThreads) block_part_stores(int4* dst, size_t n) {
  const size_t per_block = (n + gridDim.x - 1) / gridDim.x;
  const size_t begin = blockIdx.x * per_block, end = begin + per_block < n ? begin + per_block : n;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int4 v{lane, 1, 2, 3};
  for (size_t at = begin + (threadIdx.x / 32) * 128; at < end; at += static_cast<size_t>(warps) * 128) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (at + k * 32 + lane < end) dst[at + k * 32 + lane] = v;
  }
}

// The bulk-copy (TMA) engine: each warp stores a 4 KiB piece of shared memory to successive 4 KiB
// pieces of its block's part, up to kInFlight bulk groups outstanding.
constexpr int kPiece = 4096;
constexpr int kBulkSmem = (kThreads / 32) * kPiece;  // a piece per warp
template <int kInFlight>
__global__ void __launch_bounds__(kThreads) bulk_stores(char* dst, size_t bytes) {
  extern __shared__ __align__(128) char stage[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  char* mine = stage + warp * kPiece;
  for (int i = lane * 16; i < kPiece; i += 32 * 16) *reinterpret_cast<int4*>(mine + i) = int4{i, 1, 2, 3};
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores above, seen by the engine
  __syncwarp();
  const size_t pieces = bytes / kPiece;
  const size_t per_block = (pieces + gridDim.x - 1) / gridDim.x;
  const size_t begin = blockIdx.x * per_block, end = begin + per_block < pieces ? begin + per_block : pieces;
  if (lane == 0) {
    const auto from = static_cast<unsigned>(__cvta_generic_to_shared(mine));
    for (size_t p = begin + warp; p < end; p += warps) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + p * kPiece), "r"(from),
                   "n"(kPiece)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kInFlight) : "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "epx-store-probe: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

enum class Store { plain, plain_512, streaming, plain_in_l2, block_parts, bulk_2, bulk_8 };
struct Variant {
  const char* name;
  Store store;
};

void launch(Store store, int blocks, char* dst, size_t bytes) {
  constexpr size_t kAll = ~size_t{0}, kL2 = (16 << 20) / 16 - 1;  // masks: the whole buffer, its first 16 MiB
  auto* vectors = reinterpret_cast<int4*>(dst);
  const size_t n = bytes / 16;
  switch (store) {
    case Store::plain: plain_stores<false><<<blocks, kThreads>>>(vectors, n, kAll); break;
    case Store::plain_512: plain_stores<false><<<blocks, 512>>>(vectors, n, kAll); break;
    case Store::streaming: plain_stores<true><<<blocks, kThreads>>>(vectors, n, kAll); break;
    case Store::plain_in_l2: plain_stores<false><<<blocks, kThreads>>>(vectors, n, kL2); break;
    case Store::block_parts: block_part_stores<<<blocks, kThreads>>>(vectors, n); break;
    case Store::bulk_2: bulk_stores<2><<<blocks, kThreads, kBulkSmem>>>(dst, bytes); break;
    case Store::bulk_8: bulk_stores<8><<<blocks, kThreads, kBulkSmem>>>(dst, bytes); break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 224) << 20;
  std::vector<int> block_counts;
  for (int i = 2; i < argc; ++i) block_counts.push_back(std::atoi(argv[i]));
  if (block_counts.empty()) block_counts = {8, 24, 132};
  char* dst = nullptr;
  check(cudaMalloc(&dst, bytes), "cudaMalloc");
  check(cudaFuncSetAttribute(bulk_stores<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem), "smem");
  check(cudaFuncSetAttribute(bulk_stores<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem), "smem");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");

  const Variant variants[] = {{"plain (local_write)", Store::plain},
                               {"plain, 512 threads", Store::plain_512},
                               {"streaming (st.cs)", Store::streaming},
                               {"plain, 16 MiB kept in L2", Store::plain_in_l2},
                               {"block parts, 2 KiB per warp", Store::block_parts},
                               {"bulk (TMA), 2 in flight", Store::bulk_2},
                               {"bulk (TMA), 8 in flight", Store::bulk_8}};
  std::printf("%-32s %6s %10s %8s %12s\n", "variant", "blocks", "median_us", "TB/s", "GB/s/block");
  for (const Variant& v : variants) {
    for (int blocks : block_counts) {
      std::vector<float> times;
      for (int i = 0; i < 23; ++i) {
        check(cudaEventRecord(start), "record");
        launch(v.store, blocks, dst, bytes);
        check(cudaGetLastError(), v.name);
        check(cudaEventRecord(stop), "record");
        check(cudaEventSynchronize(stop), v.name);
        float ms = 0;
        check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
        if (i >= 3) times.push_back(ms * 1000.0f);
      }
      std::sort(times.begin(), times.end());
      const double us = times[times.size() / 2];
      std::printf("%-32s %6d %10.1f %8.2f %12.1f\n", v.name, blocks, us, bytes / us / 1e6, bytes / us / 1e3 / blocks);
    }
  }
  check(cudaFree(dst), "cudaFree");
  return 0;
}
