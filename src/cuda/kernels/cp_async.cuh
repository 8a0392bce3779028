// The load/store unit's asynchronous copy from global to shared memory (cp.async): the bytes land
// in shared memory without holding registers while in flight, so a warp keeps far more loads in
// flight than its registers allow (the staged sums, staged_sum.cuh; combine_backward's expansion).
#pragma once
#include <cstdint>

namespace epx::detail {

// 16 bytes from global to shared memory, L1 bypassed; a later cp_async_wait of this thread makes
// them visible to it.
__device__ inline void cp_async16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
               "l"(global)
               : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Until at most `kPending` of this thread's most recent commit groups are still in flight.
template <int kPending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace epx::detail
