// The load/store unit's asynchronous copy from global to shared memory (cp.async): the bytes land
// in shared memory without holding registers while in flight, so a warp keeps far more loads in
// flight than its registers allow (the staged sums, staged_sum.cuh; combine_backward's expansion),
// each through a CpAsyncRing.
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

// A lane's ring of kEntries entries of `entry_bytes` each at `base`, through which it streams
// `items` loads in order, kEntries in flight without registers:
//   ring.fill(load);                   // the first kEntries items
//   for each item: entry = ring.oldest();  read it;  ring.refill(load);  // the item kEntries ahead
// load(entry) issues this lane's cp.async copies of the next item into the entry (called in item
// order). Each lane reads only the vectors it loaded, so the lanes need no barrier.
template <int kEntries>
class CpAsyncRing {
 public:
  __device__ CpAsyncRing(char* base, int entry_bytes, int items) : base_(base), entry_bytes_(entry_bytes), items_(items) {}
  template <typename Load>
  __device__ void fill(Load load) {
    for (int e = 0; e < kEntries; ++e) issue(e, load);
  }
  // The entry of the oldest item not yet read, once its bytes are in.
  __device__ const char* oldest() {
    cp_async_wait<kEntries - 1>();
    return base_ + entry_ * entry_bytes_;
  }
  // That entry, read, now loads the item kEntries ahead.
  template <typename Load>
  __device__ void refill(Load load) {
    issue(entry_, load);
    entry_ = entry_ + 1 == kEntries ? 0 : entry_ + 1;
  }

 private:
  // One commit group per entry filled, an empty one once every item is issued, so that the group
  // of the oldest item is always kEntries back.
  template <typename Load>
  __device__ void issue(int e, Load& load) {
    if (issued_ < items_) {
      load(base_ + e * entry_bytes_);
      ++issued_;
    }
    cp_async_commit();
  }
  char* base_;
  int entry_bytes_, items_, issued_ = 0, entry_ = 0;
};

}  // namespace epx::detail
