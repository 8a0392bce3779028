// Row copies by the SM's bulk-copy (TMA) engine: one lane of a warp loads a row into the warp's
// stage in shared memory with one cp.async.bulk, waits on the stage's mbarrier, then stores it to
// each destination with one bulk store per destination and moves on while the stores drain. A
// row in flight costs shared memory, not registers, so 16 warps of a block keep 16 whole rows in
// flight where register copies keep ~4 KiB per warp (docs/performance.md).
//
// Layout of the block's dynamic shared memory: [warps][kBulkStageBytes] stages, then one mbarrier
// (8 bytes) and one phase word (4 bytes) per warp.
#pragma once
#include <cstdint>

namespace epx::detail {

constexpr int64_t kBulkStageBytes = 14336;  // a bf16 row of hidden 7168; longer rows go in pieces

constexpr int64_t bulk_stage_smem(int warps) { return warps * (kBulkStageBytes + 8 + 4); }

struct BulkStage {
  char* buf;
  uint64_t* bar;
  uint32_t* phase;
};

__device__ inline uint32_t smem_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

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
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(st.bar)) : "memory");
    *st.phase = 0;
    // The initialized barrier is visible to the bulk-copy (async) proxy.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
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
  if (lane == 0) {
    const BulkStage st = warp_bulk_stage();
    const uint32_t buf = smem_address(st.buf), bar = smem_address(st.bar);
    // Reads of global memory by the async proxy after this thread's generic acquire.
    asm volatile("fence.proxy.async.global;" ::: "memory");
    for (int64_t at = 0; at < bytes; at += kBulkStageBytes) {
      const uint32_t piece = static_cast<uint32_t>(bytes - at < kBulkStageBytes ? bytes - at : kBulkStageBytes);
      // The stage's previous stores have read it.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(piece) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(buf),
                   "l"(src + at), "r"(piece), "r"(bar)
                   : "memory");
      const uint32_t phase = *st.phase;
      uint32_t done = 0;
      while (!done)
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(phase)
            : "memory");
      *st.phase = phase ^ 1u;
      for (int d = 0; d < n; ++d)
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst[d] + at), "r"(buf),
                     "r"(piece)
                     : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  __syncwarp();
}

// Once per warp at its end: its bulk stores are complete.
__device__ inline void finish_bulk_copies(int lane) {
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  __syncwarp();
}

}  // namespace epx::detail
