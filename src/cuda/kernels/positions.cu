// Where every token and every (token, slot) pair of this rank goes, before the transfer: the
// sender's half of the layout. Tokens are cut into chunks of kChunkTokens; a chunk's counts
// are scanned across chunks, so a position is (the chunk's base) + (its place in the chunk),
// both in token order, which keeps the layout deterministic.
#include "cuda/kernels/block_scan.cuh"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

namespace {

constexpr int kWarps = 16;  // with 24 blocks, a warp per chunk (256 at V3) and per column in one pass

// Warp per chunk. Lanes 0..15 own its tokens for the destination ranks (ballots); the chunk's
// (token, slot) pairs go 32 at a time (a group) for the experts: a pair's place among the chunk's
// pairs of its expert counts its expert in the lower lanes of its group (a match: in token order,
// since a token holds an expert once) and in earlier groups (their ids, one shuffle per pair),
// so no pair reads the ids of every earlier pair; the lowest lane of each match adds the group's
// pairs of its expert to the chunk's count.
__global__ void __launch_bounds__(kWarps * 32) count_chunks_kernel(Shape s, int64_t tokens, const int32_t* slot_expert,
                                                                  ChunkPositions p, const DeviceStatus* st) {
  if (failed(st)) return;
  const int lane = threadIdx.x % 32;
  const unsigned lower = (1u << lane) - 1u;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens, width = s.experts + s.ranks;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t first = c * kChunkTokens, t = first + lane;
    const bool mine = lane < kChunkTokens && t < tokens;
    uint32_t dests = 0;
    if (mine)
      for (int64_t k = 0; k < s.topk; ++k) {
        const int32_t e = slot_expert[t * s.topk + k];
        if (e >= 0) dests |= 1u << (e / s.local_experts);
      }
    for (int d = 0; d < s.ranks; ++d) {
      const uint32_t to_d = __ballot_sync(0xffffffffu, (dests >> d) & 1u);
      if (mine) p.send_pos[t * s.ranks + d] = (dests >> d) & 1u ? __popc(to_d & lower) : -1;
      if (lane == 0) p.chunk_count[c * width + s.experts + d] = __popc(to_d);
    }
    const int64_t pairs = (min(first + kChunkTokens, tokens) - first) * s.topk;
    const int32_t* ids = slot_expert + first * s.topk;
    for (int64_t g = 0; g < pairs; g += 32) {
      const int32_t e = g + lane < pairs ? ids[g + lane] : -1;
      const unsigned same = __match_any_sync(0xffffffffu, e);
      int32_t before = __popc(same & lower);
      for (int64_t h = 0; h < g; h += 32) {
        const int32_t other = ids[h + lane];  // h + 32 <= g < pairs: a whole earlier group
        for (int j = 0; j < 32; ++j) before += __shfl_sync(0xffffffffu, other, j) == e;
      }
      if (e < 0) continue;
      p.slot_pos[first * s.topk + g + lane] = before;
      if ((same & lower) == 0) atomicAdd(&p.chunk_count[c * width + e], __popc(same));
    }
  }
}

// Warp per column (expert, then destination rank): exclusive scan of the chunk counts, each lane
// loading kLoads chunks' counts before any is scanned (one load round per 32 x kLoads chunks, not
// one per 32: the chunk_base stores would otherwise keep each round behind the last).
__global__ void __launch_bounds__(kWarps * 32) scan_chunks_kernel(Shape s, int64_t tokens, ChunkPositions p,
                                                                 const DeviceStatus* st) {
  constexpr int kLoads = 8;
  const int lane = threadIdx.x % 32;
  const int64_t chunks = failed(st) ? 0 : (tokens + kChunkTokens - 1) / kChunkTokens, width = s.experts + s.ranks;
  for (int64_t col = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; col < width;
       col += static_cast<int64_t>(gridDim.x) * kWarps) {
    int64_t running = 0;
    for (int64_t base = 0; base < chunks; base += 32 * kLoads) {
      int32_t v[kLoads];
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int64_t c = base + 32 * i + lane;
        v[i] = c < chunks ? p.chunk_count[c * width + col] : 0;
      }
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int64_t c = base + 32 * i + lane;
        const int32_t inclusive = warp_inclusive_sum(v[i], lane);
        if (c < chunks) p.chunk_base[c * width + col] = static_cast<int32_t>(running) + inclusive - v[i];
        running += __shfl_sync(0xffffffffu, inclusive, 31);
      }
    }
    if (lane == 0) p.totals[col] = running;
  }
}

}  // namespace

void chunk_positions(const Ctx& ctx, int64_t tokens, const int32_t* slot_expert, const ChunkPositions& p) {
  if (tokens > 0)
    count_chunks_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.shape, tokens, slot_expert, p, ctx.status);
  scan_chunks_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.shape, tokens, p, ctx.status);
}

void preload_positions_kernels() { preload(count_chunks_kernel, scan_chunks_kernel); }

}  // namespace epx::detail::kernels
