// Row copies by the SM's bulk-copy (TMA) engine: one lane of a warp loads a row into the warp's
// stage in shared memory with one cp.async.bulk, waits on the stage's mbarrier, then stores it to
// each destination with one bulk store per destination and moves on while the stores drain. A
// row in flight costs shared memory, not registers, so 16 warps of a block keep 16 whole rows in
// flight where register copies keep ~4 KiB per warp (docs/lab/2026-12-01-performance-diary.md).
//
// Layout of the block's dynamic shared memory: [warps][kBulkStageBytes] stages, then one mbarrier
// (8 bytes) and one phase word (4 bytes) per warp.
#pragma once
#include <cuda/ptx>

#include <cstdint>

namespace epx::detail {

constexpr int64_t kBulkStageBytes = 14336;  // a bf16 row of hidden 7168; longer rows go in pieces
// The staged sums (staged_sum.cuh) use a stage as a ring of 2 KiB slots.
constexpr int kStageSlots = 7;
constexpr int64_t kSlotBytes = kBulkStageBytes / kStageSlots;

constexpr int64_t bulk_stage_smem(int warps) { return warps * (kBulkStageBytes + 8 + 4); }

struct BulkStage {
  char* buf;
  uint64_t* bar;
  uint32_t* phase;
};

__device__ inline BulkStage warp_bulk_stage() {
  extern __shared__ __align__(128) char bulk_smem[];
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  char* bars = bulk_smem + warps * kBulkStageBytes;
  return {bulk_smem + warp * kBulkStageBytes, reinterpret_cast<uint64_t*>(bars) + warp,
          reinterpret_cast<uint32_t*>(bars + 8 * warps) + warp};
}

// Once per warp before its first bulk copy.
__device__ inline void init_bulk_stage(int lane) {
  const BulkStage st = warp_bulk_stage();
  if (lane == 0) {
    cuda::ptx::mbarrier_init(st.bar, 1);
    *st.phase = 0;
    // The initialized barrier is visible to the bulk-copy (async) proxy.
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __syncwarp();
}

// Whether a row can go by bulk copy: 16-byte aligned addresses and length.
__device__ inline bool bulk_copyable(const void* src, char* const* dst, int n, int64_t bytes) {
  bool ok = bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(src) & 15u) == 0;
  for (int d = 0; d < n; ++d) ok &= (reinterpret_cast<uintptr_t>(dst[d]) & 15u) == 0;
  return ok;
}

// bytes from src (global) to each of dst[0..n) (global), through the warp's stage. The caller
// made src's contents visible to this thread (an acquire of the flag that covers them).
__device__ inline void bulk_copy_row(const char* src, char* const* dst, int n, int64_t bytes, int lane) {
  namespace ptx = cuda::ptx;
  if (lane == 0) {
    const BulkStage st = warp_bulk_stage();
    // Reads of global memory by the async proxy after this thread's generic acquire.
    ptx::fence_proxy_async(ptx::space_global);
    for (int64_t at = 0; at < bytes; at += kBulkStageBytes) {
      const uint32_t piece = static_cast<uint32_t>(bytes - at < kBulkStageBytes ? bytes - at : kBulkStageBytes);
      ptx::cp_async_bulk_wait_group_read(ptx::n32_t<0>{});  // the stage's previous stores have read it
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, st.bar, piece);
      ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, st.buf, src + at, piece, st.bar);
      const uint32_t phase = *st.phase;
      while (!ptx::mbarrier_try_wait_parity(st.bar, phase)) {
      }
      *st.phase = phase ^ 1u;
      for (int d = 0; d < n; ++d) ptx::cp_async_bulk(ptx::space_global, ptx::space_shared, dst[d] + at, st.buf, piece);
      ptx::cp_async_bulk_commit_group();
    }
  }
  __syncwarp();
}

// Once per warp at its end: its bulk stores are complete.
__device__ inline void finish_bulk_copies(int lane) {
  if (lane == 0) cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});
  __syncwarp();
}

}  // namespace epx::detail
