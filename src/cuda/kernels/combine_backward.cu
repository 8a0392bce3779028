// combine_backward's (and cached_dispatch's) transfer, one kernel: rows of 2H bytes (grad_out,
// or a cached dispatch's encoded wire rows) go to the expert ranks at each token's dispatch stream
// position, a chunk at a time and flagged (each token once per rank, like dispatch), become grad_y
// rows there (times the slot weight when weighted), and the weight gradients (lane-order dots of
// docs/semantics.md) come back to the sources, flagged per chunk, where the same kernel gathers
// them. A rank's own rows are read from the input by its expanders (no sender moves them).
#include "cuda/cuda_check.hpp"
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/cp_async.cuh"
#include "cuda/kernels/empty_rows.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail::kernels {

namespace {

constexpr int kWarps = 16;              // a block's: 128 registers a thread, a bulk stage per warp
constexpr int kSendWarps = kWarps - 1;  // a sender's copy warps; the last flags finished chunks
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 8;         // channels per lane step: 16 bytes of bf16
constexpr int kDotUnroll = 4;     // 16-byte vectors per lane and row loaded at once
constexpr int kRowGroup = 8;      // grad_y rows one read of grad_out is written to at once

__device__ void load_chunk(const uint16_t* row, int64_t h, int64_t hidden, float* v) {
  if (h + kChunk <= hidden && (reinterpret_cast<uintptr_t>(row + h) % 16) == 0) {
    const int4 raw = *reinterpret_cast<const int4*>(row + h);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(&raw);
    for (int i = 0; i < kChunk; ++i) v[i] = bf16_to_float(b[i]);
    return;
  }
  for (int i = 0; i < kChunk; ++i) v[i] = h + i < hidden ? bf16_to_float(row[h + i]) : 0.0f;
}

__device__ void store_chunk(uint16_t* row, int64_t h, int64_t hidden, const float* v) {
  for (int i = 0; i < kChunk && h + i < hidden; ++i) row[h + i] = float_to_bf16(v[i]);
}

// Send block `block` of `blocks`, a chunk at a time: copy warps move each token's row to every
// other rank that holds one of its slots, then the flag warp flags the chunk at each of them.
__device__ void send_chunks(const PeerWindows& w, const WindowMap& m, const Shape& s, const SendRows& rows,
                            int64_t tokens, const int32_t* send_pos, uint32_t epoch, int block, int blocks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens;
  for (int64_t c = block; c < chunks; c += blocks) {
    if (warp < kSendWarps)
      for (int64_t t = c * kChunkTokens + warp; t < min((c + 1) * kChunkTokens, tokens); t += kSendWarps) {
        char* dst[kMaxRanks];
        int n = 0;
        for (int d = 0; d < w.ranks; ++d) {
          const int32_t pos = send_pos[t * w.ranks + d];
          if (d != w.rank && pos >= 0)
            dst[n++] = at_window<char>(w, d, m.fwd_payload + (w.rank * s.max_tokens + pos) * m.payload_stride);
        }
        if (n > 0) copy_row<true>(rows.x + t * rows.x_stride_bytes, dst, n, 2 * s.hidden, lane);
      }
    __syncthreads();
    if (warp == kSendWarps && lane == 0) {
      __threadfence_system();  // the chunk's rows (all warps', seen through the barrier) before its flags
      for (int d = 0; d < w.ranks; ++d)
        if (d != w.rank)
          set_flag(at_window<uint64_t>(w, d, m.fwd_chunk_flag) + w.rank * m.max_chunks + c, static_cast<uint64_t>(epoch) << 32);
    }
  }
}

// One 16-byte vector (8 channels) of g and of y: dot += g * y channel by channel in order (fma),
// and the vector of bf16(w * g), rounded by the hardware (row_copy.cuh).
__device__ inline int4 scale_and_dot_vector(const int4& g, const int4& y, float w, float& dot) {
  const uint16_t* gb = reinterpret_cast<const uint16_t*>(&g);
  const uint16_t* yb = reinterpret_cast<const uint16_t*>(&y);
  float scaled[kChunk];
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    const float gf = bf16_to_float(gb[c]);
    dot = __fmaf_rn(gf, bf16_to_float(yb[c]), dot);
    scaled[c] = __fmul_rn(w, gf);
  }
  return pack_bf16x8(scaled);
}

// One slot's grad_y row, out = bf16(w * g), and the specified lane-order dot(g, y): lane l takes
// the 8-channel vectors l, l + 32, ... in increasing order (fma per channel), then the warp's
// xor-shuffle sum (docs/semantics.md). kDotUnroll vectors of each row are loaded before any is
// used, so a warp keeps 2 x 2 KiB in flight instead of one 16-byte pair per round trip.
__device__ float scale_and_dot(const uint16_t* g, const uint16_t* y, uint16_t* out, float w, int64_t hidden, int lane) {
  float dot = 0.0f;
  if (hidden % 8 == 0 && aligned16(g) && aligned16(y) && aligned16(out)) {
    const int64_t vectors = hidden / 8;
    for (int64_t base = 0; base < vectors; base += 32 * kDotUnroll) {
      int4 gv[kDotUnroll], yv[kDotUnroll];
#pragma unroll
      for (int u = 0; u < kDotUnroll; ++u) {
        const int64_t v = base + u * 32 + lane;
        if (v < vectors) {
          gv[u] = reinterpret_cast<const int4*>(g)[v];
          yv[u] = reinterpret_cast<const int4*>(y)[v];
        }
      }
#pragma unroll
      for (int u = 0; u < kDotUnroll; ++u) {
        const int64_t v = base + u * 32 + lane;
        if (v >= vectors) continue;
        reinterpret_cast<int4*>(out)[v] = scale_and_dot_vector(gv[u], yv[u], w, dot);
      }
    }
  } else {  // any hidden and alignment: the same order, one vector at a time
    for (int64_t h = lane * kChunk; h < hidden; h += 32 * kChunk) {
      float gv[kChunk], yv[kChunk], o[kChunk];
      load_chunk(g, h, hidden, gv);
      load_chunk(y, h, hidden, yv);
      for (int c = 0; c < kChunk && h + c < hidden; ++c) dot = __fmaf_rn(gv[c], yv[c], dot);
      for (int c = 0; c < kChunk; ++c) o[c] = __fmul_rn(w, gv[c]);
      store_chunk(out, h, hidden, o);
    }
  }
  for (int o = 16; o >= 1; o /= 2) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
  return dot;
}

// The same rows and dots as scale_and_dot for every slot in `todo` (lanes whose slot has a row
// here; lane b gives its slot's y row, grad_y row and weight), through the warp's stage: a ring of
// kRing entries (CpAsyncRing), each a 2 KiB slice of g and the same slice of one slot's y, loaded
// by cp.async in (slot, slice) order, so kRing x 4 KiB per warp stay in flight without registers
// (scale_and_dot keeps 4 KiB in registers; this form measured 4-6% faster,
// docs/lab/2026-12-01-performance-diary.md). A slot's slices are consumed in order, so each
// lane's dot takes its vectors in the same order as scale_and_dot's. Rows 16-byte aligned,
// hidden % 8 == 0.
// Returns lane b's slot's dot to lane b.
constexpr int kRing = 3;
static_assert(kRing * 2 * kSlotBytes <= kBulkStageBytes, "the ring fits the warp's stage");
__device__ float scale_and_dot_staged(const uint16_t* g, unsigned todo, const uint16_t* my_y, uint16_t* my_out,
                                      float my_w, int64_t hidden, int lane) {
  char* const ring_base = warp_bulk_stage().buf;
  const int count = __popc(todo);
  // Lane j holds the j-th slot's rows and weight (slots in lane order).
  const int from = lane < count ? static_cast<int>(__fns(todo, 0, lane + 1)) : 0;
  const char* y_row = shfl_ptr(my_y, from);
  char* out_row = const_cast<char*>(shfl_ptr(my_out, from));
  const float w_row = __shfl_sync(0xffffffffu, my_w, from);
  const int row_bytes = static_cast<int>(hidden * 2), slice_bytes = static_cast<int>(kSlotBytes);
  const int slices = (row_bytes + slice_bytes - 1) / slice_bytes;
  const int items = count * slices;
  int issue_slot = 0, issue_slice = 0;
  // This lane's vectors of the next (slot, slice) into an entry: g's slice, then y's.
  auto load = [&](char* entry) {
    const int at = issue_slice * slice_bytes + lane * 16;
    const char* y = shfl_ptr(y_row, issue_slot) + at;
    const char* gs = reinterpret_cast<const char*>(g) + at;
    char* dst = entry + lane * 16;
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      if (u * 32 * 16 < row_bytes - at) {
        cp_async16(dst + u * 32 * 16, gs + u * 32 * 16);
        cp_async16(dst + slice_bytes + u * 32 * 16, y + u * 32 * 16);
      }
    }
    if (++issue_slice == slices) issue_slice = 0, ++issue_slot;
  };
  CpAsyncRing<kRing> ring(ring_base, 2 * slice_bytes, items);
  ring.fill(load);
  float dot = 0.0f, mine = 0.0f;
  int slot = 0, slice = 0;
  for (int item = 0; item < items; ++item) {
    const char* entry = ring.oldest();
    const float w = __shfl_sync(0xffffffffu, w_row, slot);
    char* out = const_cast<char*>(shfl_ptr(out_row, slot)) + slice * slice_bytes;
    const int vectors = min(slice_bytes, row_bytes - slice * slice_bytes) / 16;
    const int4* gs = reinterpret_cast<const int4*>(entry);
    const int4* ys = reinterpret_cast<const int4*>(entry + slice_bytes);
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const int v = u * 32 + lane;
      if (v >= vectors) continue;
      reinterpret_cast<int4*>(out)[v] = scale_and_dot_vector(gs[v], ys[v], w, dot);
    }
    ring.refill(load);  // the item kRing ahead, into the entry just read (by this lane only)
    if (++slice == slices) {  // the slot's last slice: its dot is complete
      for (int o = 16; o >= 1; o /= 2) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
      if (lane == static_cast<int>(__fns(todo, 0, slot + 1))) mine = dot;  // the slot's own lane
      dot = 0.0f;
      slice = 0;
      ++slot;
    }
  }
  return mine;
}

// One warp, received row i (the row g of token src_token[i] from its source): its grad_y rows,
// and (weighted, expert-major only) each local slot's weight gradient into the source's window
// (slot_dst). Rank-major: row i is g as is. Expert-major unweighted: g to every slot's row,
// kRowGroup rows per read. Expert-major weighted: per slot, bf16(w * g) and the dot with y.
__device__ void expand_row(const Shape& s, const RecvArrays& r, const Expansion& e, bool wide, int64_t i,
                           const uint16_t* g, float* slot_dst, int lane) {
  const int64_t capacity = r.info[2];
  if (e.layout == Layout::rank_major) {  // every local slot's row is i (and weighted is refused)
    bool any = false;
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int64_t row = r.slot_row[i * s.topk + k];
      any |= row >= 0 && row < capacity;
    }
    if (__any_sync(0xffffffffu, any)) {
      char* dst = reinterpret_cast<char*>(e.out + i * s.hidden);
      copy_row(reinterpret_cast<const char*>(g), &dst, 1, 2 * s.hidden, lane);
    }
    return;
  }
  // The staged expansion needs 16-byte rows and vectors.
  const bool staged = e.weighted && wide && aligned16(g);
  for (int64_t k0 = 0; k0 < s.topk; k0 += 32) {
    const int64_t k = k0 + lane;
    const int64_t row = k < s.topk ? r.slot_row[i * s.topk + k] : -1;
    uint32_t todo = __ballot_sync(0xffffffffu, row >= 0 && row < capacity);
    if (!e.weighted) {
      while (todo) {
        char* dst[kRowGroup];
        int n = 0;
        for (; todo && n < kRowGroup; todo &= todo - 1)
          dst[n++] = reinterpret_cast<char*>(e.out + __shfl_sync(0xffffffffu, row, __ffs(static_cast<int>(todo)) - 1) * s.hidden);
        copy_row(reinterpret_cast<const char*>(g), dst, n, 2 * s.hidden, lane);
      }
      continue;
    }
    const float weight = k < s.topk ? r.slot_weight[i * s.topk + k] : 0.0f;
    float mine = 0.0f;  // lane k's slot's dot
    if (staged) {
      const bool has_row = (todo >> lane) & 1u;
      mine = scale_and_dot_staged(g, todo, has_row ? e.y + row * e.y_stride : nullptr,
                                  has_row ? e.out + row * s.hidden : nullptr, weight, s.hidden, lane);
      todo = 0;
    }
    for (; todo; todo &= todo - 1) {
      const int b = __ffs(static_cast<int>(todo)) - 1;
      const int64_t row_b = __shfl_sync(0xffffffffu, row, b);
      const float dot = scale_and_dot(g, e.y + row_b * e.y_stride, e.out + row_b * s.hidden,
                                      __shfl_sync(0xffffffffu, weight, b), s.hidden, lane);
      if (lane == b) mine = dot;
    }
    if (k < s.topk) slot_dst[k] = mine;  // 0 for a slot without a row here
  }
}

// The fused shared expert's rows of e.out (Expansion::shared), from this rank's own input rows:
// row t of `own` into row t, or weighted bf16(weight[t] * g) and, with e.shared_gate_out, its dot
// with y row t there (the routed slots' forms: the same rounding and order).
__device__ void expand_shared_rows(const Shape& s, const SendRows& own, const Expansion& e, int64_t warp, int64_t warps,
                                   int lane) {
  for (int64_t t = warp; t < e.shared.tokens; t += warps) {
    const char* g = own.x + t * own.x_stride_bytes;
    uint16_t* out = e.out + t * s.hidden;
    if (!e.weighted) {
      char* dst = reinterpret_cast<char*>(out);
      copy_row(g, &dst, 1, 2 * s.hidden, lane);
      continue;
    }
    const float dot = scale_and_dot(reinterpret_cast<const uint16_t*>(g), e.y + t * e.y_stride, out, e.shared.weight[t],
                                    s.hidden, lane);
    if (e.shared_gate_out && lane == 0) e.shared_gate_out[t] = dot;
  }
}

// Expanding block `block` of `blocks`: the empty output rows zeroed and the shared expert's rows
// written, then a received chunk at a time (chunk c of a source, in chunk order): once its
// source's sender flagged it (this rank's own rows: read from `own`, no flag), each warp expands a
// row of it; weighted, the chunk's weight gradients are then flagged back to the source. False: a
// wait failed.
__device__ bool expand_chunks(const PeerWindows& w, const WindowMap& m, const Shape& s, const SendRows& own,
                              const RecvArrays& r, const Expansion& e, uint32_t epoch, uint64_t timeout_ns,
                              DeviceStatus* st, int block, int blocks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool wide = s.hidden % 8 == 0 && (!e.y || (aligned16(e.y) && e.y_stride % 8 == 0)) && aligned16(e.out);
  for_each_empty_row(s, r, e.layout, block * static_cast<int64_t>(kWarps) + warp, static_cast<int64_t>(blocks) * kWarps,
                     [&](int64_t row) {
                       char* dst = reinterpret_cast<char*>(e.out + row * s.hidden);
                       zero_row(&dst, 1, 2 * s.hidden, lane);
                     });
  expand_shared_rows(s, own, e, block * static_cast<int64_t>(kWarps) + warp, static_cast<int64_t>(blocks) * kWarps, lane);
  int64_t chunks = 0;
  for (int p = 0; p < w.ranks; ++p) chunks = max(chunks, static_cast<int64_t>(r.chunks_from[p]));
  // One warp waits for a chunk's flag and the barrier gives its verdict to the block; verdicts
  // alternate between two words, so warp 0 may write the next one (after its row of this chunk)
  // while a slower warp still reads this one: the barrier between them is the next chunk's.
  __shared__ bool arrived[2];
  int turn = 0;
  for (int64_t item = block; item < chunks * w.ranks; item += blocks) {
    const int64_t c = item / w.ranks;
    const int source = static_cast<int>(item % w.ranks);
    if (c >= r.chunks_from[source]) continue;
    const int64_t at = source * m.max_chunks + c;
    if (warp == 0) {
      const bool ok = source == w.rank || warp_wait_flags(at_window<uint64_t>(w, w.rank, m.fwd_chunk_flag) + at, 0, 1,
                                                          source, epoch, timeout_ns, st, kSignalForward, lane);
      if (lane == 0) arrived[turn] = ok;
    }
    __syncthreads();
    if (!arrived[turn]) return false;
    turn ^= 1;
    const ChunkRange range = r.chunk_range[at];
    for (int64_t j = warp; j < range.count; j += kWarps) {
      const int64_t pos = range.start + j, i = r.rank_offsets[source] + pos;
      const uint16_t* g = source == w.rank
                              ? reinterpret_cast<const uint16_t*>(own.x + r.src_token[i] * own.x_stride_bytes)
                              : at_window<const uint16_t>(w, w.rank, m.fwd_payload + (source * s.max_tokens + pos) * m.payload_stride);
      expand_row(s, r, e, wide, i, g, at_window<float>(w, source, m.rev_slots + (w.rank * s.max_tokens + pos) * s.topk * 4),
                 lane);
    }
    if (!e.weighted) continue;
    __syncthreads();  // every warp's weight gradients of the chunk, then its flag at the source
    if (threadIdx.x == 0) {
      __threadfence_system();
      set_flag(at_window<uint32_t>(w, source, m.rev_chunk_flag) + w.rank * m.max_chunks + c, epoch);
    }
  }
  return true;
}

// Warp per token of this rank: each slot's weight gradient, once the chunk is back from every rank
// the token went to (lane d waits for rank d); 0 for unused slots.
__device__ void gather_slot_values(const PeerWindows& w, const WindowMap& m, const Shape& s, int64_t tokens,
                                   const int32_t* send_pos, const int32_t* slot_expert, float* slot_out, uint32_t epoch,
                                   uint64_t timeout_ns, DeviceStatus* st, int64_t warp, int64_t warps) {
  const int lane = threadIdx.x % 32;
  const float* rev_slots = at_window<const float>(w, w.rank, m.rev_slots);
  for (int64_t t = warp; t < tokens; t += warps) {
    const bool went = lane < w.ranks && send_pos[t * w.ranks + lane] >= 0;
    uint32_t* flag = went ? at_window<uint32_t>(w, w.rank, m.rev_chunk_flag) + lane * m.max_chunks + t / kChunkTokens : nullptr;
    if (!warp_wait_lane_flags(flag, lane, epoch, timeout_ns, st, kSignalReverse)) return;
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int32_t e = slot_expert[t * s.topk + k];
      float v = 0.0f;
      if (e >= 0) {
        const int d = static_cast<int>(e / s.local_experts);
        v = rev_slots[(d * s.max_tokens + send_pos[t * w.ranks + d]) * s.topk + k];
      }
      slot_out[t * s.topk + k] = v;
    }
  }
}

// Roles by arrival (arrival_order): the first `senders` blocks send, the others expand and then
// (weighted) gather. The last block to finish publishes the status (when e.host_status is set).
// A gathering block waits for every rank's expanders, this rank's later blocks included: like
// every transfer kernel, this one needs all its blocks resident at once (the buffer's num_sms
// rule, docs/cuda.md).
__global__ void __launch_bounds__(kThreads, 1) expand_transfer_kernel(PeerWindows w, WindowMap m, Shape s,
                                                                     SendRows rows, int64_t tokens,
                                                                     const int32_t* send_pos, const int32_t* slot_expert,
                                                                     RecvArrays r, Expansion e, int senders,
                                                                     CallState* cs, uint64_t timeout_ns,
                                                                     DeviceStatus* st) {
  const int role = arrival_order(&cs->transfer_arrivals);
  const uint32_t epoch = call_epoch(cs);
  if (!block_sees_failure(st)) {
    if (role < senders) {
      send_chunks(w, m, s, rows, tokens, send_pos, epoch, role, senders);
    } else {
      const int block = role - senders, blocks = static_cast<int>(gridDim.x) - senders;
      if (expand_chunks(w, m, s, rows, r, e, epoch, timeout_ns, st, block, blocks) && e.weighted)
        gather_slot_values(w, m, s, tokens, send_pos, slot_expert, e.slot_out, epoch, timeout_ns, st,
                           block * static_cast<int64_t>(kWarps) + threadIdx.x / 32, static_cast<int64_t>(blocks) * kWarps);
    }
  }
  if (last_block(&cs->transfer_blocks_done) && threadIdx.x == 0 && e.host_status) publish(st, e.host_status);
}

}  // namespace

void expand_transfer(const Ctx& ctx, int senders, const SendRows& rows, int64_t tokens, const int32_t* send_pos,
                     const int32_t* slot_expert, const RecvArrays& r, const Expansion& e) {
  // The weighted expansion stages its rows in each warp's 14 KiB of shared memory.
  const size_t smem = e.weighted ? static_cast<size_t>(bulk_stage_smem(kWarps)) : 0;
  expand_transfer_kernel<<<ctx.blocks, kThreads, smem, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, rows, tokens,
                                                                     send_pos, slot_expert, r, e, senders, ctx.state,
                                                                     ctx.timeout_ns, ctx.status);
}

void preload_combine_backward_kernels() {
  preload(expand_transfer_kernel);
  EPX_CUDA(cudaFuncSetAttribute(expand_transfer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(bulk_stage_smem(kWarps))));
}

}  // namespace epx::detail::kernels
