// Copy-engine dispatch: each rank's whole input goes to every other rank's window through the
// copy engines, so no SM moves a payload byte across the link. The copy runs in pieces, each
// followed by a 4-byte copy of the call's epoch into the destination's flag of that piece, so the
// receivers place a piece's rows while later pieces are still on the way. It pays where nearly
// every token goes to every rank (EP2 at top-8 of 256: 99.6%); docs/performance.md.
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/cuda_check.hpp"

namespace epx::detail::kernels {

namespace {

// One warp, before the copies: lanes d < R wait until rank d has read the rows of this rank's
// previous broadcast (it says so in bcast_free[d] here), then this broadcast's epoch goes where
// the flag copies read it. A failed call waits too: its copies still land in peers' windows.
__global__ void broadcast_begin_kernel(PeerWindows w, WindowMap m, CallState* cs, uint64_t timeout_ns, DeviceStatus* st) {
  const int lane = threadIdx.x;
  const uint32_t previous = cs->bcast_epoch;
  if (lane < w.ranks) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> freed(at_window<uint32_t>(w, w.rank, m.bcast_free)[lane]);
    const uint64_t start = globaltimer_ns();
    uint32_t v;
    while ((v = freed.load(cuda::memory_order_acquire)) < previous)
      if (globaltimer_ns() - start > timeout_ns) {
        report(st, kStatusTimeout, lane, kSignalForward, previous, v);
        break;
      }
  }
  __syncwarp();
  if (lane == 0) {
    cs->bcast_epoch = call_epoch(cs);
    *at_window<uint32_t>(w, w.rank, m.bcast_epoch_src) = call_epoch(cs);
  }
}

__global__ void broadcast_release_kernel(PeerWindows w, WindowMap m, const CallState* cs) {
  release_broadcast_rows(w, m, call_epoch(cs), threadIdx.x);
}

}  // namespace

void broadcast_rows(const Ctx& ctx, cudaStream_t copies, const char* x, int64_t x_stride_bytes, int64_t row_bytes,
                    int64_t tokens) {
  const PeerWindows& w = ctx.peers;
  const WindowMap& m = ctx.map;
  broadcast_begin_kernel<<<1, 32, 0, copies>>>(w, m, ctx.state, ctx.timeout_ns, ctx.status);
  EPX_CUDA(cudaGetLastError());
  const char* epoch = w.base[w.rank] + m.bcast_epoch_src;
  for (int64_t first = 0, piece = 0; first < tokens; first += m.piece_tokens, ++piece)
    for (int k = 1; k < w.ranks; ++k) {
      const int d = (w.rank + k) % w.ranks;
      const int64_t rows = std::min(m.piece_tokens, tokens - first);
      char* dst = w.base[d] + m.bcast_rows + (w.rank * ctx.shape.max_tokens + first) * m.bcast_stride;
      EPX_CUDA(cudaMemcpy2DAsync(dst, static_cast<size_t>(m.bcast_stride), x + first * x_stride_bytes,
                                 static_cast<size_t>(x_stride_bytes), static_cast<size_t>(row_bytes),
                                 static_cast<size_t>(rows), cudaMemcpyDefault, copies));
      char* flag = w.base[d] + m.bcast_flag + (w.rank * kMaxPieces + piece) * sizeof(uint32_t);
      EPX_CUDA(cudaMemcpyAsync(flag, epoch, sizeof(uint32_t), cudaMemcpyDefault, copies));
    }
}

void release_broadcast(const Ctx& ctx) {
  broadcast_release_kernel<<<1, 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.state);
}

void preload_broadcast_kernels() { preload(broadcast_begin_kernel, broadcast_release_kernel); }

}  // namespace epx::detail::kernels
