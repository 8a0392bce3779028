// Device helpers of the CUDA backend: signals with timeouts, status reports, row copies.
#pragma once
#include <cuda/atomic>

#include "cuda/kernels/device_types.hpp"
#include "cuda/kernels/kernel_frames.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

// Loads kernels now: CUDA loads a kernel lazily at its first launch, and loading may wait for
// every kernel running on the device (docs/cuda.md). Notes each one's stack frame (kernel_frames.hpp).
template <typename... Kernel>
void preload(Kernel... kernels) {
  cudaFuncAttributes attributes;
  ((cudaFuncGetAttributes(&attributes, kernels) == cudaSuccess ? note_kernel_frame(attributes.localSizeBytes) : void()),
   ...);
}

// Programmatic dependent launch (sm_90): a kernel launched by launch_after_prior may have its
// blocks made resident while the kernel ahead of it on the stream still runs, once every block of
// that one has called let_next_kernel_start() or ended; it must call wait_for_prior_kernel()
// before it reads anything the earlier kernel wrote (the wait returns once that kernel has
// completed and its writes are visible). It saves the gap between the two kernels (~1 us,
// lab/pdl_probe.cu). Either call is a no-op where the launch had no such attribute.
template <typename... Params, typename... Args>
cudaError_t launch_after_prior(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                               Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}
__device__ inline void wait_for_prior_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// Every thread of the block calls it (or the block ends).
__device__ inline void let_next_kernel_start() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ inline uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <typename T>
__device__ inline T* at_window(const PeerWindows& w, int owner, int64_t offset) {
  return reinterpret_cast<T*>(w.base[owner] + offset);
}

__device__ inline bool failed(const DeviceStatus* st) { return *reinterpret_cast<const volatile int32_t*>(&st->code) != 0; }

// Records the first error of the call; later ones are dropped.
__device__ inline void report(DeviceStatus* st, int32_t code, int32_t rank, int64_t a = 0, int64_t b = 0,
                              int64_t c = 0, int64_t d = 0) {
  if (atomicCAS(&st->code, 0, -1) != 0) return;  // -1: being written
  st->rank = rank;
  st->a = a;
  st->b = b;
  st->c = c;
  st->d = d;
  __threadfence();
  atomicExch(&st->code, code);
}

// Copies a failed status to the host's mapped copy (read by the host at the call's end, or at the
// start of a later call). An OK status writes nothing, nor does any while the host copy holds a
// finding: the first one stays until the host reads and clears it, whatever later calls publish.
__device__ inline void publish(const DeviceStatus* st, DeviceStatus* host) {
  if (*reinterpret_cast<const volatile int32_t*>(&st->code) == 0) return;
  volatile DeviceStatus* h = host;
  if (h->code != 0) return;  // the first finding stays until the host has read it
  h->rank = st->rank;
  h->a = st->a;
  h->b = st->b;
  h->c = st->c;
  h->d = st->d;
  h->code = st->code;
  __threadfence_system();
}

// Adds 1 to signal `kind` of every rank, from this rank. The caller fenced its writes
// (__threadfence_system) after a __syncthreads, so peers that see the count see the data.
__device__ inline void signal_all(const PeerWindows& w, const WindowMap& m, int kind) {
  for (int p = 0; p < w.ranks; ++p) {
    auto* slot = at_window<unsigned long long>(w, p, m.signals) + kind * w.ranks + w.rank;
    atomicAdd_system(slot, 1ull);
  }
}

// End of a block's share of a transfer: once all its threads' writes are done, fence them
// system-wide and signal every rank. Every block does this, even in a failed call, so every
// rank's counters stay in step.
__device__ inline void block_done_signal(const PeerWindows& w, const WindowMap& m, int kind) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    signal_all(w, m, kind);
  }
}

// Waits until every rank's signal `kind` here reached `target`; on timeout reports the first
// missing rank and returns false.
__device__ inline bool wait_all(const PeerWindows& w, const WindowMap& m, int kind, uint64_t target,
                                uint64_t timeout_ns, DeviceStatus* st) {
  const uint64_t start = globaltimer_ns();
  for (int p = 0; p < w.ranks; ++p) {
    auto* slot = at_window<uint64_t>(w, w.rank, m.signals) + kind * w.ranks + p;
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> counter(*slot);
    while (counter.load(cuda::memory_order_acquire) < target) {
      if (failed(st)) return false;
      if (globaltimer_ns() - start > timeout_ns) {
        report(st, kStatusTimeout, p, kind, static_cast<int64_t>(target), static_cast<int64_t>(counter.load()));
        return false;
      }
    }
  }
  return true;
}

// The current call's epoch (call number + 1, the same on every rank) and plan slot: plans are
// double-buffered by call parity, with two phases per call.
__device__ inline uint32_t call_epoch(const CallState* cs) { return static_cast<uint32_t>(cs->call); }
__device__ inline int plan_slot(const CallState* cs, int phase) { return static_cast<int>((cs->call - 1) % 2) * 2 + phase; }

// Chunk flags: a word in the receiver's window whose top 32 bits the sender sets to the call's
// epoch (call number + 1, the same on every rank) once the chunk's rows are there; the rest
// may carry data about the chunk. Epochs only grow, so flags are never reset and a flag left
// by an earlier or failed call never passes a wait.
template <typename Word>
__device__ inline uint32_t flag_epoch(Word v) {
  return static_cast<uint32_t>(v >> (8 * sizeof(Word) - 32));
}

template <typename Word>
__device__ inline void set_flag(Word* flag, Word value) {
  cuda::atomic_ref<Word, cuda::thread_scope_system>(*flag).store(value, cuda::memory_order_release);
}

// Each lane with a flag (non-null `mine`, the flag of peer `peer`) spins until it carries epoch,
// all at once; then the warp may read what the flags cover. Returns false (the whole warp) on a
// failed call or after timeout_ns, reporting which peer never came. *seen (if given) receives
// lane 0's flag word.
template <typename Word>
__device__ inline bool warp_wait_lane_flags(Word* mine, int peer, uint32_t epoch, uint64_t timeout_ns, DeviceStatus* st,
                                            int64_t kind, Word* seen = nullptr) {
  int ok = 1;
  Word v = 0;
  if (mine) {
    cuda::atomic_ref<Word, cuda::thread_scope_system> f(*mine);
    const uint64_t start = globaltimer_ns();
    while (flag_epoch(v = f.load(cuda::memory_order_acquire)) < epoch) {
      if (failed(st)) {
        ok = 0;
        break;
      }
      if (globaltimer_ns() - start > timeout_ns) {
        report(st, kStatusTimeout, peer, kind, epoch, flag_epoch(v));
        ok = 0;
        break;
      }
    }
  }
  ok = __all_sync(0xffffffffu, ok);
  if (seen) *seen = __shfl_sync(0xffffffffu, v, 0);
  __syncwarp();
  return ok != 0;
}

// Lanes 0..n-1 each wait for their flag (flags[lane * stride], the flag of peer first_peer + lane).
template <typename Word>
__device__ inline bool warp_wait_flags(Word* flags, int64_t stride, int n, int first_peer, uint32_t epoch,
                                       uint64_t timeout_ns, DeviceStatus* st, int64_t kind, int lane, Word* seen = nullptr) {
  return warp_wait_lane_flags(lane < n ? flags + lane * stride : nullptr, first_peer + lane, epoch, timeout_ns, st, kind,
                              seen);
}

// Every thread of a block calls it at the block's start: true (in every thread) when the call
// has failed already, so the block moves nothing (every rank knows the call failed).
__device__ inline bool block_sees_failure(const DeviceStatus* st) {
  __shared__ bool skip;
  if (threadIdx.x == 0) skip = failed(st);
  __syncthreads();
  return skip;
}

// Every thread of the call's first block: thread 0 advances the call's number and clears the
// status (begin_call's work), which the block's threads then see.
__device__ inline void begin_call_block(CallState* cs, DeviceStatus* st) {
  if (threadIdx.x == 0) {
    cs->call += 1;
    *st = DeviceStatus{};
  }
  __syncthreads();
}

// Every thread of a block calls it once at its start: the block's place (0, 1, ...) in the order
// the grid's blocks got here, which, unlike blockIdx, says which blocks run already. The last
// block resets *count for the next launch.
__device__ inline int arrival_order(uint32_t* count) {
  __shared__ int order;
  if (threadIdx.x == 0) {
    order = static_cast<int>(atomicAdd(count, 1u));
    if (order == static_cast<int>(gridDim.x) - 1) *count = 0;
  }
  __syncthreads();
  return order;
}

// Every thread of a block calls it once at its end: true in the last block of the grid to get
// here, whose threads then see every block's writes (each block fences them after a barrier
// before it counts itself in *count: at system scope when the blocks wrote into peers' memory
// that the last block then flags). That block resets *count for the next launch.
template <bool kSystemScope = false>
__device__ inline bool last_block(uint32_t* count) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    if constexpr (kSystemScope) __threadfence_system();
    else __threadfence();
    last = atomicAdd(count, 1u) == gridDim.x - 1;
    if (last) *count = 0;
  }
  __syncthreads();
  return last;
}

// Copy-engine dispatch: lanes d < R tell rank d that this rank has read every row of d's
// broadcasts up to `epoch` (d's next broadcast may overwrite them).
__device__ inline void release_broadcast_rows(const PeerWindows& w, const WindowMap& m, uint32_t epoch, int lane) {
  if (lane < w.ranks) set_flag(at_window<uint32_t>(w, lane, m.bcast_free) + w.rank, epoch);
}

__device__ inline float warp_max(float v) {
  for (int o = 16; o >= 1; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace epx::detail
