// Combine and dispatch_backward: each expert rank sums a received token's rows (slot order)
// into one bf16 row and writes it back into the source's window, a chunk at a time, flagging
// each chunk; the source's reduce warps, in the same kernel on other SMs, add a token's rows in
// rank order (then the shared expert) as soon as its chunk is back from every rank. Sums follow
// docs/semantics.md, so results equal the CPU backend's bit for bit.
// Copy-engine return (a.by_copy): the expert ranks' copy engines bring y's rows, or expert-major
// the partials reduce_partials_kernel summed into a rank-major buffer first (return_pieces,
// copy_return.cpp), and every block reduces, waiting per piece. The rows arrive as y holds them, -0
// included, where the returning warps write bf16(0 + y): the same sums, since a sum from +0 never
// tells -0 from +0.
#include "cuda/cuda_check.hpp"
#include "cuda/kernels/fp8_partials.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"
#include "cuda/kernels/staged_sum.cuh"

namespace epx::detail::kernels {

namespace {

// Of a returning block; one more warp flags finished chunks. 15 + 1 warps: at 16 warps a block a
// thread may hold 128 registers (at 17, 96), room for the reducers' two terms' loads in flight.
constexpr int kSendWarps = 15;
constexpr int kThreads = (kSendWarps + 1) * 32;
// dst = bf16(0 + src) for a 16-byte aligned row (hidden % 8 == 0): the bits of src except that
// -0 becomes +0, as the fp32 sum from 0 gives; zeros when src is null (a row lost to overflow).
__device__ void copy_bf16_plus_zero(const uint16_t* src, uint16_t* dst, int64_t hidden, int lane) {
  const int64_t vectors = hidden / 8;
  for (int64_t base = 0; base < vectors; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      v[u] = src && i < vectors ? reinterpret_cast<const int4*>(src)[i] : int4{0, 0, 0, 0};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i >= vectors) continue;
      uint32_t* word = reinterpret_cast<uint32_t*>(&v[u]);
      for (int j = 0; j < 4; ++j) {  // each half: 0x8000 (-0) -> 0
        const uint32_t x = word[j];
        word[j] = x & ~(((x & 0xffffu) == 0x8000u ? 0xffffu : 0u) | ((x >> 16) == 0x8000u ? 0xffff0000u : 0u));
      }
      reinterpret_cast<int4*>(dst)[i] = v[u];
    }
  }
}

// Expert side, one warp, the fp8 combine wire: received row i's partial (the sum partial_row
// makes, rounded to bf16) quantized into dst: codes [H], then f32 scales [H/128]. Staged, the
// terms' loads (a rank-major row's one term too) come through the warp's stage, a whole 14 KiB
// row in flight; else one term's 64 bytes per lane at a time (two made the kernel spill).
__device__ void fp8_partial_row(const Shape& s, const RecvArrays& r, Layout layout, const CombineArgs& a, bool staged,
                                int64_t i, char* dst, int lane) {
  const int64_t capacity = r.info[2];
  const Fp8Partial store{dst, reinterpret_cast<float*>(dst + s.hidden), a.wire == WireFormat::fp8_ue8m0};
  const bool rank_major = layout == Layout::rank_major;
  auto term = [&](int k, const uint16_t*& row, float& weight) {
    if (rank_major) {  // one term: 0 + y
      row = a.y + i * a.y_stride;
      weight = 1.0f;
      return i < capacity;
    }
    const int64_t out_row = r.slot_row[i * s.topk + k];
    row = a.y + out_row * a.y_stride;
    weight = r.slot_weight[i * s.topk + k];
    return out_row >= 0 && out_row < capacity;
  };
  const int n = rank_major ? 1 : static_cast<int>(s.topk);
  const bool weighted = !rank_major && a.weighted;
  if (staged) sum_rows_staged_to(n, term, weighted, s.hidden, lane, store);
  else sum_rows_wide<1>(n, term, weighted, s.hidden, lane, store);
}

// Expert side, one warp: the partial of received row i (rank-major order): the bf16 row (or
// combine_wire's fp8 codes and scales) into dst (when y is given) and the token's K slot values
// into dst_slots (when a.slot_values is). staged: an expert-major sum's terms come through the
// warp's stage (staged_sum.cuh).
template <bool kFp8>
__device__ void partial_row(const Shape& s, const RecvArrays& r, Layout layout, const CombineArgs& a, bool wide,
                            bool staged, int64_t i, uint16_t* dst, float* dst_slots, int lane) {
  const int64_t capacity = r.info[2];
  if (kFp8 && a.y) {
    fp8_partial_row(s, r, layout, a, staged, i, reinterpret_cast<char*>(dst), lane);
  } else if (a.y) {
    if (layout == Layout::rank_major && wide) {  // one term: 0 + y, a copy that turns -0 into +0
      copy_bf16_plus_zero(i < capacity ? a.y + i * a.y_stride : nullptr, dst, s.hidden, lane);
    } else if (layout == Layout::rank_major) {
      sum_rows(1, [&](int, const uint16_t*& row, float& weight) {
        row = a.y + i * a.y_stride;
        weight = 1.0f;
        return i < capacity;
      }, false, dst, s.hidden, wide, lane);
    } else {
      auto term = [&](int k, const uint16_t*& row, float& weight) {
        const int64_t out_row = r.slot_row[i * s.topk + k];
        row = a.y + out_row * a.y_stride;
        weight = r.slot_weight[i * s.topk + k];
        return out_row >= 0 && out_row < capacity;
      };
      if (staged) sum_rows_staged(static_cast<int>(s.topk), term, a.weighted, dst, s.hidden, lane);
      else sum_rows(static_cast<int>(s.topk), term, a.weighted, dst, s.hidden, wide, lane);
    }
  }
  if (a.slot_values) {
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int64_t row = r.slot_row[i * s.topk + k];
      float v = 0.0f;
      if (row >= 0 && row < capacity)
        v = layout == Layout::rank_major ? a.slot_values[row * a.slot_values_stride + k] : a.slot_values[row * a.slot_values_stride];
      dst_slots[k] = v;
    }
  }
}

// Expert side, one warp: received row `pos` of `source`'s stream back into its window. An
// expert-major partial's terms come through the warp's stage, as reduce_partials_kernel's do (the
// same partial_row: the same sums), where the register loop kept too few bytes in flight.
template <bool kFp8>
__device__ void return_row(const PeerWindows& w, const WindowMap& m, const Shape& s, const RecvArrays& r, Layout layout,
                           const CombineArgs& a, bool wide, int source, int64_t pos, int lane) {
  const int64_t at = w.rank * s.max_tokens + pos;
  const bool staged = wide && s.topk <= 32;  // a term per lane
  partial_row<kFp8>(s, r, layout, a, wide, staged, r.rank_offsets[source] + pos,
              at_window<uint16_t>(w, source, m.rev_rows + at * s.hidden * 2),
              at_window<float>(w, source, m.rev_slots + at * s.topk * 4), lane);
}

// Where a reducer finds this rank's own term of a token at stream position pos: outside the
// window (outside), rows [pos] (and slot values [pos], slot_stride apart) for pos < end; else in
// the window like every other rank's. `outside` is its own flag: rows may be null when this rank
// received no rows (an empty y without data), and its own chunks are still never returned.
struct OwnTerms {
  bool outside = false;
  const uint16_t* rows = nullptr;
  const float* slot_values = nullptr;
  int64_t end = 0;
};

__device__ OwnTerms own_terms(const PeerWindows& w, const RecvArrays& r, const CombineArgs& a) {
  if (a.by_copy) return {true, a.own_rows, a.own_slot_values, INT64_MAX};
  if (!a.own_in_place) return {};
  if (!a.y) return {true, nullptr, nullptr, 0};  // no rows received: no own term
  const int64_t first = r.rank_offsets[w.rank];
  return {true, a.y + first * a.y_stride, a.slot_values ? a.slot_values + first * a.slot_values_stride : nullptr,
          r.info[2] - first};  // rows past the capacity were dropped: no term
}

// Source side, one warp: token t from every rank's returned row (rank order; this rank's own
// where `own` says), then the shared expert's row (times its weight), then shared_out. staged:
// the rows come through the warp's stage (staged_sum.cuh).
template <bool kFp8>
__device__ void reduce_token(const PeerWindows& w, const WindowMap& m, const Shape& s, const int32_t* send_pos,
                             const int32_t* slot_expert, const CombineArgs& a, const OwnTerms& own, bool wide,
                             bool staged, int64_t t, int lane) {
  const uint16_t* rev = at_window<const uint16_t>(w, w.rank, m.rev_rows);
  const uint16_t* shared_row = a.shared.rows ? a.shared.rows + t * a.shared.stride : nullptr;
  const float shared_weight = a.shared.weight ? a.shared.weight[t] : 1.0f;
  const uint16_t* shared_out = a.shared_out ? a.shared_out + t * a.shared_out_stride : nullptr;
  if (kFp8 && a.out) {  // rank d's fp8 partial in its 2H-byte row
    auto slot = [&](int d) -> const char* {
      const int32_t pos = send_pos[t * w.ranks + d];
      return pos >= 0 ? reinterpret_cast<const char*>(rev + (d * s.max_tokens + pos) * s.hidden) : nullptr;
    };
    const ExtraRows extra = shared_row ? ExtraRows{{shared_row, shared_out}, shared_weight} : ExtraRows{{shared_out, nullptr}};
    if (staged) sum_fp8_partials_staged(slot, w.ranks, s.hidden, extra, a.out + t * s.hidden, lane);
    else sum_fp8_partials(slot, w.ranks, s.hidden, 0, s.hidden, extra, a.out + t * s.hidden, lane);
  } else if (!kFp8 && a.out) {
    // Weighted when the shared row has a weight: the other terms' weight 1 (fma(1, v, acc) is acc + v).
    auto term = [&](int d, const uint16_t*& row, float& weight) {
      weight = 1.0f;
      if (d == w.ranks && shared_row) {
        row = shared_row;
        weight = shared_weight;
        return true;
      }
      if (d >= w.ranks) {
        row = shared_out;
        return shared_out != nullptr;
      }
      const int32_t pos = send_pos[t * w.ranks + d];
      if (own.outside && d == w.rank) {
        row = own.rows + pos * a.y_stride;
        return pos >= 0 && pos < own.end;
      }
      row = rev + (d * s.max_tokens + pos) * s.hidden;
      return pos >= 0;
    };
    const int terms = w.ranks + (shared_row ? 2 : 1);
    const bool weighted = a.shared.weight != nullptr;
    if (staged) sum_rows_staged(terms, term, weighted, a.out + t * s.hidden, s.hidden, lane);
    else sum_rows<2>(terms, term, weighted, a.out + t * s.hidden, s.hidden, wide, lane);
  }
  if (a.shared_gate_out && lane == 0) a.shared_gate_out[t] = a.gate_grads[t * a.gate_grads_stride];
  if (a.slot_out) {
    const float* rev_slots = at_window<const float>(w, w.rank, m.rev_slots);
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int32_t e = slot_expert[t * s.topk + k];
      float v = 0.0f;
      if (e >= 0) {
        const int d = static_cast<int>(e / s.local_experts);
        const int32_t pos = send_pos[t * w.ranks + d];
        if (own.outside && d == w.rank) v = pos < own.end ? own.slot_values[pos * a.slot_values_stride + k] : 0.0f;
        else v = rev_slots[(d * s.max_tokens + pos) * s.topk + k];
      }
      a.slot_out[t * s.topk + k] = v;
    }
  }
}

// Returning blocks, each a chunk at a time: its rows back to their source, then its flag there.
template <bool kFp8>
__device__ void return_chunks(const PeerWindows& w, const WindowMap& m, const Shape& s, const RecvArrays& r,
                              Layout layout, const CombineArgs& a, bool wide, uint32_t epoch, int block, int blocks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t chunks = 0;
  for (int p = 0; p < w.ranks; ++p) chunks = max(chunks, static_cast<int64_t>(r.chunks_from[p]));
  for (int64_t item = block; item < chunks * w.ranks; item += blocks) {
    const int64_t c = item / w.ranks;
    const int source = static_cast<int>(item % w.ranks);
    if (c >= r.chunks_from[source] || (a.own_in_place && source == w.rank)) continue;  // own: read in place
    const ChunkRange range = r.chunk_range[source * m.max_chunks + c];
    if (warp < kSendWarps)
      for (int64_t j = warp; j < range.count; j += kSendWarps)
        return_row<kFp8>(w, m, s, r, layout, a, wide, source, range.start + j, lane);
    __syncthreads();
    if (warp == kSendWarps && lane == 0) {
      __threadfence_system();
      set_flag(at_window<uint32_t>(w, source, m.rev_chunk_flag) + w.rank * m.max_chunks + c, epoch);  // no data: epoch only
    }
  }
}

// Reducing warps: each of this rank's tokens once its rows are back from every rank. The rows
// come through the warp's shared memory (14 KiB in flight per warp instead of two rows' 4 KiB;
// docs/lab/2026-12-01-performance-diary.md), a term per lane.
template <bool kFp8>
__device__ void reduce_tokens(const PeerWindows& w, const WindowMap& m, const Shape& s, const RecvArrays& r,
                              int64_t tokens, const int32_t* send_pos, const int32_t* slot_expert, const CombineArgs& a,
                              bool wide, uint32_t epoch, uint64_t timeout_ns, DeviceStatus* st, int block, int blocks) {
  const int lane = threadIdx.x % 32;
  const OwnTerms own = own_terms(w, r, a);
  const bool staged = wide && w.ranks + (a.shared.rows ? 2 : 1) <= 32;  // a term per lane
  const int64_t reducer = block * static_cast<int64_t>(kThreads / 32) + threadIdx.x / 32;
  const int64_t reducers = static_cast<int64_t>(blocks) * (kThreads / 32);
  for (int64_t t = reducer; t < tokens; t += reducers) {
    if (a.by_copy) {  // lane d waits for the piece of rank d that holds token t's row (none from this rank)
      const int32_t pos = lane < w.ranks && lane != w.rank ? send_pos[t * w.ranks + lane] : -1;
      int q = 0;  // the piece of stream position pos
      while (q + 1 < kMaxPieces && pos >= m.return_start[q + 1]) ++q;
      uint32_t* piece = pos < 0 ? nullptr : at_window<uint32_t>(w, w.rank, m.rev_piece_flag) + lane * kMaxPieces + q;
      if (!warp_wait_lane_flags(piece, lane, epoch, timeout_ns, st, kSignalReverse)) return;
    } else {  // every rank returns every chunk, empty ones too; lane d waits for rank d (not this rank's own in place)
      uint32_t* flags = at_window<uint32_t>(w, w.rank, m.rev_chunk_flag) + t / kChunkTokens;
      const bool waits = lane < w.ranks && !(own.outside && lane == w.rank);
      if (!warp_wait_lane_flags(waits ? flags + lane * m.max_chunks : nullptr, lane, epoch, timeout_ns, st, kSignalReverse))
        return;
    }
    reduce_token<kFp8>(w, m, s, send_pos, slot_expert, a, own, wide, staged, t, lane);
  }
}

// The first send_blocks blocks return, the others reduce; the last block to finish publishes the
// call's status for the host.
template <bool kFp8>
__global__ void __launch_bounds__(kThreads) combine_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r,
                                                           Layout layout, int64_t tokens, const int32_t* send_pos,
                                                           const int32_t* slot_expert, CombineArgs a, int send_blocks,
                                                           CallState* cs, uint64_t timeout_ns, DeviceStatus* st) {
  wait_for_prior_kernel();  // the plan exchange's checks
  const uint32_t epoch = call_epoch(cs);
  auto rows_aligned = [&](const void* p, int64_t stride_elems) {
    return aligned16(p) && stride_elems % 8 == 0;
  };
  const bool wide = s.hidden % 8 == 0 && (!a.y || rows_aligned(a.y, a.y_stride)) &&
                    (!a.shared_out || rows_aligned(a.shared_out, a.shared_out_stride)) &&
                    (!a.shared.rows || rows_aligned(a.shared.rows, a.shared.stride)) && (!a.out || aligned16(a.out));
  const int block = static_cast<int>(blockIdx.x);
  if (!block_sees_failure(st)) {
    if (block < send_blocks)
      return_chunks<kFp8>(w, m, s, r, layout, a, wide, epoch, block, send_blocks);
    else
      reduce_tokens<kFp8>(w, m, s, r, tokens, send_pos, slot_expert, a, wide, epoch, timeout_ns, st, block - send_blocks,
                    static_cast<int>(gridDim.x) - send_blocks);
  }
  if (last_block(&cs->transfer_blocks_done) && threadIdx.x == 0) publish(st, a.host_status);
}

// Copy-engine return of the expert-major layout: every warp of the grid sums received rows'
// partials into a local buffer in rank-major order (partials [M, H], partial_slots [M, K]), which
// the copy engines then return like a rank-major y. Warp j takes row first + j, skipping `gap`
// rows at gap_at (this rank's own rows while the other ranks' are reduced first). The sums are
// bound by the bytes an SM keeps in flight and the instructions per value: 16 warps stage 14 KiB
// each in shared memory where the rows allow it (through registers, 24 warps of 2 KiB each, the
// most without spills, were slower: docs/lab/2026-12-01-experiments.md).
constexpr int kPartialWarps = 16;
__global__ void __launch_bounds__(kPartialWarps * 32) reduce_partials_kernel(Shape s, RecvArrays r, CombineArgs a,
                                                                             PartialRows p, const DeviceStatus* st) {
  if (failed(st)) return;
  const int lane = threadIdx.x % 32;
  const bool wide = s.hidden % 8 == 0 && aligned16(a.y) && a.y_stride % 8 == 0 && aligned16(p.rows);
  const bool staged = wide && s.topk <= 32;  // a term per lane
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kPartialWarps;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(kPartialWarps) + threadIdx.x / 32; j < p.count; j += warps) {
    const int64_t i = p.first + j + (j >= p.gap_at ? p.gap : 0);
    partial_row<false>(s, r, Layout::expert_major, a, wide, staged, i, p.rows + i * s.hidden,
                       p.slots ? p.slots + i * s.topk : nullptr, lane);
  }
}

}  // namespace

void combine(const Ctx& ctx, int send_blocks, const RecvArrays& r, Layout layout, int64_t tokens,
             const int32_t* send_pos, const int32_t* slot_expert, const CombineArgs& a) {
  const size_t smem = static_cast<size_t>(bulk_stage_smem(kThreads / 32));
  // The fp8 wire's own kernel: the bf16 one keeps its registers (together they spilled).
  auto* kernel = a.wire == WireFormat::bf16 ? combine_kernel<false> : combine_kernel<true>;
  EPX_CUDA(launch_after_prior(kernel, ctx.blocks, kThreads, smem, ctx.stream, ctx.peers, ctx.map, ctx.shape, r, layout,
                              tokens, send_pos, slot_expert, a, send_blocks, ctx.state, ctx.timeout_ns, ctx.status));
}

void reduce_partials(const Ctx& ctx, const RecvArrays& r, const CombineArgs& a, const PartialRows& p) {
  if (p.count == 0) return;
  reduce_partials_kernel<<<ctx.blocks, kPartialWarps * 32, bulk_stage_smem(kPartialWarps), ctx.stream>>>(ctx.shape, r, a,
                                                                                                         p, ctx.status);
}

void preload_combine_kernels() {
  preload(combine_kernel<false>, combine_kernel<true>, reduce_partials_kernel);
  for (auto* kernel : {combine_kernel<false>, combine_kernel<true>})
    EPX_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bulk_stage_smem(kThreads / 32))));
  EPX_CUDA(cudaFuncSetAttribute(reduce_partials_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(bulk_stage_smem(kPartialWarps))));
}

}  // namespace epx::detail::kernels
