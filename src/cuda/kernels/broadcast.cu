// Copy-engine dispatch: each rank's whole input goes to every other rank's window through the
// copy engines, so no SM moves a byte across the link. The rows go in pieces, each followed by a
// 4-byte copy of the call's epoch into the destination's flag of that piece, so the receivers
// place a piece's rows while later pieces are still on the way; once its positions are known, each
// rank's placing data (expert ids, weights, positions) follows by SM stores from a small kernel
// and the receivers work out every row's place themselves. bf16 rows go straight from x; other
// wire formats are first encoded (quantized, or fp8 codes and scales as given) into this rank's own
// part of bcast_rows, and go from there. It pays where nearly every token goes to every rank (EP2 at
// top-8 of 256: 99.6%); docs/lab/2026-12-01-performance-diary.md.
#include <algorithm>

#include "cuda/kernels/chunk_bases.cuh"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/wire_encode.cuh"
#include "cuda/cuda_check.hpp"

namespace epx::detail::kernels {

namespace {

constexpr int64_t kPlacingBlocks = 8;  // ~400 KB per peer at V3: a few microseconds

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

// Warp per token: this rank's wire rows (quantized from bf16 x, or fp8 codes and scales as given)
// into its own part of bcast_rows, from where the copy engines send them and its receivers read
// its own tokens.
__global__ void encode_rows_kernel(PeerWindows w, WindowMap m, Shape s, SendRows rows, int64_t tokens) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t row_bytes = 2 * s.hidden;
  const bool prefetch = !rows.x_scales && rows.x_stride_bytes % 16 == 0 && row_bytes % 16 == 0 && aligned16(rows.x);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; t < tokens; t += warps) {
    if (prefetch && lane == 0 && t + warps < tokens)  // the warp's next row into L2 while it encodes this one
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(rows.x + (t + warps) * rows.x_stride_bytes),
                   "r"(static_cast<uint32_t>(row_bytes)) : "memory");
    char* dst = at_window<char>(w, w.rank, m.bcast_rows + (w.rank * s.max_tokens + t) * m.bcast_stride);
    encode_wire_row(rows, t, s.hidden, &dst, 1, lane);
  }
}

// Thread per token: the positions the SM sender would have written, in place: send_pos becomes
// each token's stream position at each rank, slot_pos each pair's index among this rank's pairs
// of its expert (what combine and the receivers read). Values are loaded 8 at a time before any
// store (the arrays might alias for the compiler, which would keep each load behind the last store).
__global__ void finalize_positions_kernel(Shape s, int64_t tokens, const int32_t* slot_expert, ChunkPositions p) {
  constexpr int kGroup = 8;
  const int64_t width = s.experts + s.ranks;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const ChunkBases base = chunk_bases(p, width, t / kChunkTokens);
    for (int d0 = 0; d0 < s.ranks; d0 += kGroup) {
      int32_t pos[kGroup], add[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        pos[i] = d0 + i < s.ranks ? p.send_pos[t * s.ranks + d0 + i] : -1;
        add[i] = d0 + i < s.ranks ? base[s.experts + d0 + i] : 0;
      }
#pragma unroll
      for (int i = 0; i < kGroup; ++i)
        if (pos[i] >= 0) p.send_pos[t * s.ranks + d0 + i] = pos[i] + add[i];
    }
    for (int64_t k0 = 0; k0 < s.topk; k0 += kGroup) {
      int32_t e[kGroup], pos[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        e[i] = k0 + i < s.topk ? slot_expert[t * s.topk + k0 + i] : -1;
        pos[i] = k0 + i < s.topk ? p.slot_pos[t * s.topk + k0 + i] : 0;
      }
#pragma unroll
      for (int i = 0; i < kGroup; ++i)
        if (e[i] >= 0) pos[i] += base[e[i]];
#pragma unroll
      for (int i = 0; i < kGroup; ++i)
        if (e[i] >= 0) p.slot_pos[t * s.topk + k0 + i] = pos[i];
    }
  }
}

// This rank's placing data into every other rank's meta_* arrays with coalesced stores, then its
// meta_flag there (by the last block to finish). Not the copy engines: a copy would queue behind
// the rows' pieces on the same engines, and no receiver could start before the last piece landed.
__global__ void push_placing_kernel(PeerWindows w, WindowMap m, Shape s, Placing mine, int64_t tokens, CallState* cs) {
  const int64_t pairs = tokens * s.topk, positions = tokens * s.ranks;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int k = 1; k < w.ranks; ++k) {
    const int d = (w.rank + k) % w.ranks;
    const int64_t at = w.rank * s.max_tokens;  // this rank's part of d's arrays
    int32_t* expert = at_window<int32_t>(w, d, m.meta_expert) + at * s.topk;
    float* weight = at_window<float>(w, d, m.meta_weight) + at * s.topk;
    int32_t* index = at_window<int32_t>(w, d, m.meta_index) + at * s.topk;
    int32_t* pos = at_window<int32_t>(w, d, m.meta_pos) + at * s.ranks;
    for (int64_t i = first; i < pairs; i += stride) {
      expert[i] = mine.expert[i];
      weight[i] = mine.weight[i];
      index[i] = mine.index[i];
    }
    for (int64_t i = first; i < positions; i += stride) pos[i] = mine.pos[i];
  }
  if (!last_block<true>(&cs->placing_blocks_done) || threadIdx.x >= 32) return;
  __threadfence_system();
  const int d = threadIdx.x;
  if (d < w.ranks && d != w.rank) set_flag(at_window<uint32_t>(w, d, m.meta_flag) + w.rank, call_epoch(cs));
}

__global__ void broadcast_release_kernel(PeerWindows w, WindowMap m, const CallState* cs) {
  release_broadcast_rows(w, m, call_epoch(cs), threadIdx.x);
}

}  // namespace

void begin_broadcast(const Ctx& ctx, cudaStream_t copies) {
  broadcast_begin_kernel<<<1, 32, 0, copies>>>(ctx.peers, ctx.map, ctx.state, ctx.timeout_ns, ctx.status);
  EPX_CUDA(cudaGetLastError());
}

void encode_rows(const Ctx& ctx, const SendRows& rows, int64_t tokens) {
  if (tokens == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ctx.blocks, (tokens + 15) / 16));
  encode_rows_kernel<<<blocks, 512, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, rows, tokens);
  EPX_CUDA(cudaGetLastError());
}

std::vector<FlaggedPiece> broadcast_pieces(const Ctx& ctx, const char* x, int64_t x_stride_bytes, int64_t row_bytes,
                                           int64_t tokens, int64_t first_piece, int64_t end_piece) {
  const PeerWindows& w = ctx.peers;
  const WindowMap& m = ctx.map;
  const char* epoch = w.base[w.rank] + m.bcast_epoch_src;
  std::vector<FlaggedPiece> pieces;
  for (int64_t piece = first_piece, first = first_piece * m.piece_tokens; first < tokens && piece < end_piece;
       first += m.piece_tokens, ++piece)
    for (int k = 1; k < w.ranks; ++k) {
      const int d = (w.rank + k) % w.ranks;
      const int64_t rows = std::min(m.piece_tokens, tokens - first);
      char* dst = w.base[d] + m.bcast_rows + (w.rank * ctx.shape.max_tokens + first) * m.bcast_stride;
      char* flag = w.base[d] + m.bcast_flag + (w.rank * kMaxPieces + piece) * sizeof(uint32_t);
      FlaggedPiece p{};
      p.part[0] = {dst, m.bcast_stride, x + first * x_stride_bytes, x_stride_bytes, row_bytes, rows};
      p.parts = 1;
      p.flag = flag;
      p.epoch = epoch;
      pieces.push_back(p);
    }
  return pieces;
}

void finalize_positions(const Ctx& ctx, int64_t tokens, const int32_t* slot_expert, const ChunkPositions& p) {
  if (tokens == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ctx.blocks, (tokens + 255) / 256));
  finalize_positions_kernel<<<blocks, 256, 0, ctx.stream>>>(ctx.shape, tokens, slot_expert, p);
}

void broadcast_placing(const Ctx& ctx, const Placing& mine, int64_t tokens) {
  const int blocks = static_cast<int>(std::clamp<int64_t>((tokens * ctx.shape.topk + 4095) / 4096, 1, kPlacingBlocks));
  push_placing_kernel<<<blocks, 512, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, mine, tokens, ctx.state);
  EPX_CUDA(cudaGetLastError());
}

void release_broadcast(const Ctx& ctx) {
  broadcast_release_kernel<<<1, 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.state);
}

void preload_broadcast_kernels() {
  preload(broadcast_begin_kernel, encode_rows_kernel, finalize_positions_kernel, push_placing_kernel,
          broadcast_release_kernel);
}

}  // namespace epx::detail::kernels
