// The receiver's half of the layout, from every rank's dispatch plan alone: where each source's
// rows start (rank-major), how many rows each local expert gets and from whom (expert-major), the
// output sizes. Known before any row arrives, so rows can be placed as they land. One block; the
// plan exchange's kernel runs it right after checking the plans (no launch of its own on the
// dispatch's critical path), receive_layout_kernel where the plans were exchanged earlier.
#pragma once
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

// A plan's counts: pairs per expert [E], then tokens per destination rank [R].
__device__ inline const int64_t* plan_totals(const PeerWindows& w, const WindowMap& m, int slot, int p) {
  return at_window<const int64_t>(w, w.rank, m.plans + (slot * w.ranks + p) * m.plan_stride + sizeof(PlanHeader));
}

// Every thread of the block calls it; a failed call receives nothing.
__device__ inline void receive_layout_block(const PeerWindows& w, const WindowMap& m, const Shape& s, int phase,
                                            const LayoutJob& job, const CallState* cs, const DeviceStatus* st) {
  const RecvArrays& r = job.r;
  const bool ok = !failed(st);
  const int slot = plan_slot(cs, phase);
  for (int64_t l = threadIdx.x; l < s.local_experts; l += blockDim.x) {
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
    r.expert_offsets[l + 1] =
        r.expert_offsets[l] + (r.tokens_per_expert[l] + job.alignment - 1) / job.alignment * job.alignment;
  const int64_t received = r.rank_offsets[w.ranks];
  const int64_t rows = job.layout == Layout::expert_major ? r.expert_offsets[s.local_experts] : received;
  r.info[0] = received;
  r.info[1] = rows;
  r.info[2] = job.capacity_rows > 0 ? job.capacity_rows : rows;
  r.info[3] = rows > r.info[2];
}

}  // namespace epx::detail::kernels
