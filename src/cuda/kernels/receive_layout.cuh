// The receiver's half of the layout, from every rank's dispatch plan alone: where each source's
// rows start (rank-major), how many rows each local expert gets and from whom (expert-major), the
// output sizes. Known before any row arrives, so rows can be placed as they land. One block; the
// plan exchange's kernel runs it right after checking the plans (no launch of its own on the
// dispatch's critical path).
#pragma once
#include "cuda/kernels/block_scan.cuh"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

// A plan's counts: pairs per expert [E], then tokens per destination rank [R].
__device__ inline const int64_t* plan_totals(const PeerWindows& w, const WindowMap& m, int slot, int p) {
  return at_window<const int64_t>(w, w.rank, m.plans + (slot * w.ranks + p) * m.plan_stride + kPlanCountsAt);
}

// Every thread of the block calls it (blockDim.x == kThreads); a failed call receives nothing.
// Scans in parallel, not a thread's loop over the experts: each step of such a loop waited for
// the previous one's store (256 steps at one rank: ~30 us on every dispatch's critical path).
template <int kThreads>
__device__ inline void receive_layout_block(const PeerWindows& w, const WindowMap& m, const Shape& s, int phase,
                                            const LayoutJob& job, const CallState* cs, const DeviceStatus* st) {
  const RecvArrays& r = job.r;
  const bool ok = !failed(st);
  const int slot = plan_slot(cs, phase);
  // The shared segment (this rank's own tokens, padded like every segment) before the routed ones.
  const int64_t shared_rows =
      job.shared_tokens < 0 ? 0 : (job.shared_tokens + job.alignment - 1) / job.alignment * job.alignment;
  // Each local expert's rows from each source (expert-major bases), then its aligned rows' offset.
  const int64_t aligned_rows = shared_rows + block_exclusive_sum<int64_t, kThreads>(
      s.local_experts,
      [&](int64_t l) {
        int64_t n = 0;
        for (int p = 0; p < w.ranks; ++p) {
          r.expert_base[p * s.local_experts + l] = n;
          n += ok ? plan_totals(w, m, slot, p)[w.rank * s.local_experts + l] : 0;
        }
        r.tokens_per_expert[l] = n;
        if (job.load) job.load[l] += n;  // Buffer::expert_load (a failed call's n is 0: it counts nothing)
        return (n + job.alignment - 1) / job.alignment * job.alignment;
      },
      [&](int64_t l, int64_t before, int64_t) { r.expert_offsets[l] = shared_rows + before; });
  // Each source's rows here (rank-major offsets): lane p holds source p's (ranks <= 32).
  __shared__ int64_t received;
  if (threadIdx.x < 32) {
    const int p = static_cast<int>(threadIdx.x);
    int64_t rows = 0;
    if (p < w.ranks && ok) {
      const PlanHeader* h = at_window<const PlanHeader>(w, w.rank, m.plans + (slot * w.ranks + p) * m.plan_stride);
      rows = plan_totals(w, m, slot, p)[s.experts + w.rank];
      r.chunks_from[p] = static_cast<int32_t>((h->tokens + kChunkTokens - 1) / kChunkTokens);
    } else if (p < w.ranks) {
      r.chunks_from[p] = 0;
    }
    const int64_t inclusive = warp_inclusive_sum(rows, p);
    if (p < w.ranks) r.rank_offsets[p + 1] = inclusive;
    if (p == 0) r.rank_offsets[0] = 0;
    if (p == 31) received = inclusive;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  r.expert_offsets[s.local_experts] = aligned_rows;
  if (job.shared_tokens >= 0) {
    r.tokens_per_expert[-1] = job.shared_tokens;
    r.expert_offsets[-1] = 0;
  }
  const int64_t rows = job.layout == Layout::expert_major ? aligned_rows : received;
  r.info[0] = received;
  r.info[1] = rows;
  r.info[2] = job.capacity_rows > 0 ? job.capacity_rows : rows;
  r.info[3] = rows > r.info[2];
}

}  // namespace epx::detail::kernels
