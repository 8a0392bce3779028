// Low-latency mode (docs/low-latency.md): what both calls' kernels share (ll_dispatch.cu,
// ll_combine.cu). Each call's send half writes into its peers' windows and counts its blocks in at
// every rank (block_arrived); each receive half waits until every source's blocks are in
// (wait_sources), and its last block resets the call's words (end_call).
#pragma once
#include "cuda/kernels/ll_launch.hpp"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail::ll {

constexpr int kWarps = 16;
constexpr unsigned kAll = 0xffffffffu;
// A source's arrival word at a receiver: blocks in (bits 0..19), the source grid's size (bits
// 20..39, added by its block 0). Complete when the size is there and every block is in.
constexpr int kGridShift = 20;
constexpr uint64_t kArrivedMask = (1ull << kGridShift) - 1;

__device__ inline int64_t chunks_of(const Ctx& c) { return (c.max_tokens + kChunk - 1) / kChunk; }

__device__ inline int64_t first_warp() { return blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; }
__device__ inline int64_t warps_in_grid() { return static_cast<int64_t>(gridDim.x) * kWarps; }

// EPX_PROFILE=ll: thread 0 of the block notes the global timer at `step` of this call (the host
// prints the last call's timeline when the buffer goes).
__device__ inline void stamp(const Ctx& c, Kind kind, int step) {
  if (c.stamps && threadIdx.x == 0)
    c.stamps[(static_cast<int64_t>(kind) * gridDim.x + blockIdx.x) * kStampSteps + step] = globaltimer_ns();
}

// Word `source` of one of the window's per-(kind, set) arrays at rank `owner`.
template <typename T>
__device__ inline T* word_of(const Ctx& c, int64_t offset, int owner, Kind kind, int set, int source) {
  return at_window<T>(c.peers, owner, offset) + (static_cast<int64_t>(kind) * 2 + set) * c.peers.ranks + source;
}

// Source `source`'s weights_in word of combine set `set` at rank `owner`.
__device__ inline uint32_t* weights_word(const Ctx& c, int owner, int set, int source) {
  return at_window<uint32_t>(c.peers, owner, c.map.weights_in) + set * c.peers.ranks + source;
}

// The calling block is done with this call's writes to every rank: after a system-scope fence
// (it orders the writes of all the block's threads, which __syncthreads made visible to thread 0),
// it raises the call's error word at each rank if this rank found an error, then counts itself in.
// Only blocks [0, arriving) count (block 0 says how many): the others wrote nothing to any rank.
// A peer's error that another block of this kernel already found (kStatusPeerRejected) is not
// passed on: every rank reads the failing rank's own word, and a relay could reach a peer after
// it had skipped the call, to fail its next good call.
__device__ inline void block_arrived(const Ctx& c, Kind kind, int set, int64_t arriving) {
  if (blockIdx.x >= arriving) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  // The status is read before the fence (the barrier put the block's own reports in), so its load
  // and the fence's wait for the block's remote writes overlap instead of adding up.
  int32_t code = *reinterpret_cast<volatile int32_t*>(&c.status->code);
  __threadfence_system();
  while (code == -1) code = *reinterpret_cast<volatile int32_t*>(&c.status->code);  // a report being written
  if (code > 0 && code != kStatusPeerRejected) {
    for (int d = 0; d < c.peers.ranks; ++d)
      atomicMax_system(word_of<uint32_t>(c, c.map.errors, d, kind, set, c.peers.rank), static_cast<uint32_t>(code));
    __threadfence_system();
  }
  const unsigned long long add = 1ull + (blockIdx.x == 0 ? static_cast<unsigned long long>(arriving) << kGridShift : 0ull);
  for (int d = 0; d < c.peers.ranks; ++d)
    atomicAdd_system(word_of<unsigned long long>(c, c.map.arrivals, d, kind, set, c.peers.rank), add);
}

// Threads 0..R-1 of the block wait until every counting block of source `threadIdx.x` is in; a
// source that found an error (or was rejected by its host) stops the call. The block's other
// threads wait at the barrier: one poller per source and block, not per warp (2112 warps polling
// one word queue behind each other at its L2 slice, and the atomics they wait for with them).
// A peer's rejection is reported only when this rank's own word is clear: a rank whose own input
// was bad names its own error (its word was raised before it counted itself in), whichever
// source came in first. Returns the same in every thread of the block.
__device__ inline bool wait_sources(const Ctx& c, Kind kind, int set) {
  __shared__ uint32_t codes[kMaxRanks];
  __shared__ uint64_t wait_start;
  int ok = 1;
  const int source = static_cast<int>(threadIdx.x);
  if (source < c.peers.ranks) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> word(*word_of<uint64_t>(c, c.map.arrivals, c.peers.rank, kind, set, source));
    const uint64_t start = globaltimer_ns();
    const TimeoutStep step = kind == kDispatch ? kDispatchArrivals : kCombineArrivals;
    for (uint64_t v = word.load(cuda::memory_order_acquire);
         (v >> kGridShift) == 0 || (v & kArrivedMask) != (v >> kGridShift); v = word.load(cuda::memory_order_acquire)) {
      if (globaltimer_ns() - start > c.timeout_ns) {
        report(c.status, kStatusTimeout, source, timeout_where(c.call, step), 0, 0, static_cast<int64_t>(start));
        ok = 0;
        break;
      }
      // An earlier wait of this call ran out (the combine's weights): one timeout is enough. (Only a
      // timeout: after an input error the arrival words must still be consumed.)
      if (*reinterpret_cast<volatile int32_t*>(&c.status->code) == kStatusTimeout) {
        ok = 0;
        break;
      }
    }
    codes[source] = ok ? *reinterpret_cast<volatile uint32_t*>(word_of<uint32_t>(c, c.map.errors, c.peers.rank, kind, set, source)) : 0;
    if (source == 0) wait_start = start;
  }
  __syncthreads();
  bool rejected = false;
  for (int p = 0; p < c.peers.ranks; ++p) rejected |= codes[p] != 0;
  if (threadIdx.x == 0 && codes[c.peers.rank] == 0)
    for (int p = 0; p < c.peers.ranks; ++p)
      if (codes[p] != 0) {  // the lowest rejecting peer
        report(c.status, kStatusPeerRejected, p, codes[p], 0, 0, static_cast<int64_t>(wait_start));
        break;
      }
  return __syncthreads_and(ok && !rejected) != 0;
}

// Receiver's end of a call: every source's arrival and error words of this (kind, set) back to
// zero for the call after next on the set, and the status to the host if something went wrong
// (read at the host's next call; no call waits for the device).
__device__ inline void end_call(const Ctx& c, Kind kind, int set) {
  if (threadIdx.x < c.peers.ranks) {
    *word_of<uint64_t>(c, c.map.arrivals, c.peers.rank, kind, set, threadIdx.x) = 0;
    *word_of<uint32_t>(c, c.map.errors, c.peers.rank, kind, set, threadIdx.x) = 0;
    if (kind == kCombine) *weights_word(c, c.peers.rank, set, static_cast<int>(threadIdx.x)) = 0;
  }
  if (threadIdx.x == 0 && *reinterpret_cast<volatile int32_t*>(&c.status->code) != 0) publish(c.status, c.host_status);
}


// When the call's send half began, in mapped host memory: timeout messages compare ranks' starts
// (docs/cuda.md: on the shared GPU every rank reads the same timer).
__device__ inline void note_start(const Ctx& c, Kind kind, int set, int phases) {
  if ((phases & kSendPhase) && blockIdx.x == 0 && threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(c.host_started + kind * 2 + set) = globaltimer_ns();
}

}  // namespace epx::detail::ll
