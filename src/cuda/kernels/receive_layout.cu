// The receiver's layout as a kernel of its own (receive_layout.cuh says what it computes).
#include "cuda/kernels/receive_layout.cuh"

namespace epx::detail::kernels {

namespace {

constexpr int kThreads = kScanThreads;  // receive_layout_block scans with the whole block

__global__ void __launch_bounds__(kThreads) receive_layout_kernel(PeerWindows w, WindowMap m, Shape s, int phase,
                                                                 LayoutJob job, const CallState* cs,
                                                                 const DeviceStatus* st) {
  receive_layout_block(w, m, s, phase, job, cs, st);
}

}  // namespace

void receive_layout(const Ctx& ctx, int phase, const LayoutJob& job) {
  receive_layout_kernel<<<1, kThreads, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, phase, job, ctx.state,
                                                        ctx.status);
}

void preload_receive_layout_kernels() { preload(receive_layout_kernel); }

}  // namespace epx::detail::kernels
