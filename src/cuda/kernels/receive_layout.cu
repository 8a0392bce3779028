// The receiver's half of the layout, from every rank's dispatch plan alone: where each
// source's rows start (rank-major), how many rows each local expert gets and from whom
// (expert-major), the output sizes. Known before any row arrives, so rows can be placed as
// they land.
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

namespace {

constexpr int kThreads = 256;

// A plan's counts: pairs per expert [E], then tokens per destination rank [R].
__device__ const int64_t* plan_totals(const PeerWindows& w, const WindowMap& m, int slot, int p) {
  return at_window<const int64_t>(w, w.rank, m.plans + (slot * w.ranks + p) * m.plan_stride + sizeof(PlanHeader));
}

__global__ void __launch_bounds__(kThreads) receive_layout_kernel(PeerWindows w, WindowMap m, Shape s, int phase,
                                                                 RecvArrays r, Layout layout, int64_t alignment,
                                                                 int64_t capacity_rows, const CallState* cs,
                                                                 const DeviceStatus* st) {
  const bool ok = !failed(st);  // a failed call receives nothing
  const int slot = plan_slot(cs, phase);
  for (int64_t l = threadIdx.x; l < s.local_experts; l += kThreads) {
    int64_t n = 0;
    for (int p = 0; p < w.ranks; ++p) {
      r.expert_base[p * s.local_experts + l] = n;
      n += ok ? plan_totals(w, m, slot, p)[w.rank * s.local_experts + l] : 0;
    }
    r.tokens_per_expert[l] = n;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  r.rank_offsets[0] = 0;
  for (int p = 0; p < w.ranks; ++p) {
    const PlanHeader* h = at_window<const PlanHeader>(w, w.rank, m.plans + (slot * w.ranks + p) * m.plan_stride);
    r.rank_offsets[p + 1] = r.rank_offsets[p] + (ok ? plan_totals(w, m, slot, p)[s.experts + w.rank] : 0);
    r.chunks_from[p] = ok ? static_cast<int32_t>((h->tokens + kChunkTokens - 1) / kChunkTokens) : 0;
  }
  r.expert_offsets[0] = 0;
  for (int64_t l = 0; l < s.local_experts; ++l)
    r.expert_offsets[l + 1] = r.expert_offsets[l] + (r.tokens_per_expert[l] + alignment - 1) / alignment * alignment;
  const int64_t received = r.rank_offsets[w.ranks];
  const int64_t rows = layout == Layout::expert_major ? r.expert_offsets[s.local_experts] : received;
  r.info[0] = received;
  r.info[1] = rows;
  r.info[2] = capacity_rows > 0 ? capacity_rows : rows;
  r.info[3] = rows > r.info[2];
}

}  // namespace

void receive_layout(const Ctx& ctx, int phase, const RecvArrays& r, Layout layout, int64_t alignment,
                    int64_t capacity_rows) {
  receive_layout_kernel<<<1, kThreads, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, phase, r, layout, alignment,
                                                        capacity_rows, ctx.state, ctx.status);
}

void preload_receive_layout_kernels() { preload(receive_layout_kernel); }

}  // namespace epx::detail::kernels
