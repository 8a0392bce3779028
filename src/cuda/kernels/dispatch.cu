// Dispatch's transfer. The sender moves each token once to every other destination rank's
// window (quantizing on the way when the wire says so) and flags every finished chunk there; the
// receiver, running at the same time on other SMs, places each flagged chunk's rows into the
// outputs at positions fixed by the plans, copying this rank's own tokens straight from the
// input when the wire needs no quantizing (docs/lab/2026-12-01-performance-diary.md). With a
// copy-engine broadcast (broadcast.cu) there is no sender: the receiver takes every source's
// tokens from the copies of its rows and placing data, each once flagged.
#include "cuda/cuda_check.hpp"
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/chunk_bases.cuh"
#include "cuda/kernels/empty_rows.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"
#include "cuda/kernels/wire_encode.cuh"

namespace epx::detail::kernels {

namespace {

constexpr int kSendWarps = 16;  // copy warps of a send block; one more warp flags finished chunks
constexpr int kSendThreads = (kSendWarps + 1) * 32;
// Receive warps per block: the copy-engine receiver works out each row's place itself and needs
// more registers than 24 warps leave (80 a thread), so it runs 16 (128).
template <bool kBroadcast>
constexpr int kRecvWarps = kBroadcast ? 16 : 24;

constexpr int kRowGroup = 8;  // output rows one read of a received row is written to at once

__device__ int64_t stream_slot(const Shape& s, int source, int64_t pos) {
  return source * s.max_tokens + pos;
}

// Own tokens skip the window when their wire row is a plain copy of the input (bf16, or fp8
// given pre-quantized): the receiver copies them from x. Quantized on send (fp8, nvfp4), they
// still go through the window: a quantizer in the receive loop would spill its registers (24
// warps per block leave 80 registers a thread).
__device__ bool own_rows_from_input(const SendRows& rows) { return rows.x_scales || rows.wire == WireFormat::bf16; }

// One warp: token t of chunk c to every rank that holds one of its slots (this rank only when its
// wire row is quantized here: see own_rows_from_input), and the row's placing data to every such rank.
__device__ void send_token(const PeerWindows& w, const WindowMap& m, const Shape& s, const SendRows& rows,
                           const SendPlan& plan, int64_t c, int64_t t, int lane) {
  const ChunkPositions& p = plan.pos;
  const int64_t width = s.experts + s.ranks;
  const ChunkBases base = chunk_bases(p, width, c);
  char* dst[kMaxRanks];
  int64_t at[kMaxRanks];
  int to[kMaxRanks];
  int n = 0, payloads = 0;
  for (int d = 0; d < s.ranks; ++d) {
    const int32_t in_chunk = p.send_pos[t * s.ranks + d];
    if (in_chunk < 0) continue;
    const int64_t pos = base[s.experts + d] + in_chunk;
    at[n] = stream_slot(s, w.rank, pos);
    to[n] = d;
    if (d != w.rank || !own_rows_from_input(rows))
      dst[payloads++] = at_window<char>(w, d, m.fwd_payload + at[n] * m.payload_stride);
    ++n;
  }
  __syncwarp();  // every lane read send_pos before lane 0 turns it into stream positions
  if (lane == 0)
    for (int i = 0; i < n; ++i) p.send_pos[t * s.ranks + to[i]] = static_cast<int32_t>(at[i] - w.rank * s.max_tokens);
  if (payloads > 0) encode_wire_row(rows, t, s.hidden, dst, payloads, lane);
  for (int i = 0; i < n; ++i) {  // what the receiver needs to place the row
    const int r = to[i];
    if (lane == 0) at_window<int32_t>(w, r, m.fwd_token)[at[i]] = static_cast<int32_t>(t);
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int32_t e = plan.slot_expert[t * s.topk + k];
      const bool here = e >= 0 && e / s.local_experts == r;
      const int64_t slot = at[i] * s.topk + k;
      at_window<int32_t>(w, r, m.fwd_slot_expert)[slot] = here ? static_cast<int32_t>(e % s.local_experts) : -1;
      at_window<float>(w, r, m.fwd_slot_weight)[slot] = here ? plan.slot_weight[t * s.topk + k] : 0.0f;
      at_window<int32_t>(w, r, m.fwd_slot_index)[slot] = here ? base[e] + p.slot_pos[t * s.topk + k] : 0;
    }
  }
}

// Block per chunk (strided): copy warps take its tokens; the flag warp then publishes the
// chunk's rows to each destination while the copy warps go on with the next chunk.
__global__ void __launch_bounds__(kSendThreads) dispatch_send_kernel(PeerWindows w, WindowMap m, Shape s, SendRows rows,
                                                                    int64_t tokens, SendPlan plan, const CallState* cs,
                                                                    const DeviceStatus* st) {
  const uint32_t epoch = call_epoch(cs);
  if (block_sees_failure(st)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens, width = s.experts + s.ranks;
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    if (warp < kSendWarps)
      for (int64_t t = c * kChunkTokens + warp; t < min((c + 1) * kChunkTokens, tokens); t += kSendWarps)
        send_token(w, m, s, rows, plan, c, t, lane);
    __syncthreads();
    if (warp == kSendWarps && lane == 0) {
      __threadfence_system();  // the chunk's rows (all warps', seen through the barrier) before its flags
      const ChunkBases base = chunk_bases(plan.pos, width, c);
      for (int d = 0; d < s.ranks; ++d) {
        const uint64_t range = static_cast<uint64_t>(base[s.experts + d]) << kRangeCountBits |
                               static_cast<uint64_t>(plan.pos.chunk_count[c * width + s.experts + d]);
        set_flag(at_window<uint64_t>(w, d, m.fwd_chunk_flag) + w.rank * m.max_chunks + c,
                 static_cast<uint64_t>(epoch) << 32 | range);
      }
    }
  }
}

// Output rows that hold no token are zero, with no source.
__device__ void fill_empty_rows(const Shape& s, const RecvArrays& r, const RecvOutputs& out, Layout layout,
                                int64_t warp, int64_t warps, int lane) {
  for_each_empty_row(s, r, layout, warp, warps, [&](int64_t row) {
    char* x = out.x + row * out.x_bytes;
    zero_row(&x, 1, out.x_bytes, lane);
    if (out.scales) {
      char* sc = out.scales + row * out.scale_bytes;
      zero_row(&sc, 1, out.scale_bytes, lane);
    }
    if (lane == 0) {
      if (out.global) reinterpret_cast<float*>(out.global)[row] = 0.0f;
      out.src[2 * row] = -1;
      out.src[2 * row + 1] = -1;
      if (layout == Layout::expert_major) out.weights[row] = 0.0f;
    }
    if (layout == Layout::rank_major)
      for (int64_t k = lane; k < s.topk; k += 32) {
        out.topk_idx[row * s.topk + k] = -1;
        out.topk_weights[row * s.topk + k] = 0.0f;
      }
  });
}

// A row's codes, scales and 1/g (each null when the wire has none) into n output rows at once.
__device__ void place_parts(const char* codes, const char* scales, const char* global, const RecvOutputs& out,
                            const int64_t* rows, int n, int lane) {
  char* dst[kRowGroup];
  for (int j = 0; j < n; ++j) dst[j] = out.x + rows[j] * out.x_bytes;
  if (out.bulk && bulk_copyable(codes, dst, n, out.x_bytes)) bulk_copy_row(codes, dst, n, out.x_bytes, lane);
  else copy_row(codes, dst, n, out.x_bytes, lane);
  if (out.scales) {
    for (int j = 0; j < n; ++j) dst[j] = out.scales + rows[j] * out.scale_bytes;
    copy_row(scales, dst, n, out.scale_bytes, lane);
  }
  if (out.global) {
    for (int j = 0; j < n; ++j) dst[j] = out.global + rows[j] * 4;
    copy_row(global, dst, n, 4, lane);
  }
}

// The row of `token` into n output rows at once: the payload in the window (codes, scales and
// 1/g back to back), or (own != null) the input row and its given scales.
__device__ void place_row(const SendRows* own, const char* payload, int32_t token, const RecvOutputs& out,
                          const int64_t* rows, int n, int lane) {
  const char* codes = own ? own->x + token * own->x_stride_bytes : payload;
  const char* scales = own ? reinterpret_cast<const char*>(own->x_scales + token * own->scales_stride)
                           : payload + out.x_bytes;  // own: read only when the wire has scales (x_scales set)
  place_parts(codes, scales, payload + out.x_bytes + out.scale_bytes, out, rows, n, lane);
}

// A received row's slots: the stream's arrays (the sender wrote local experts, -1 elsewhere), or
// a source's Placing (global ids: this rank keeps those of its own experts).
struct RowSlots {
  const int32_t* expert;
  const float* weight;
  const int32_t* index;
  int64_t first;  // the row's first slot in the arrays
  int local_of;   // -1: ids are local already; else the rank whose experts count as local
};

__device__ RowSlots stream_slots(const PeerWindows& w, const WindowMap& m, const Shape& s, int64_t f) {
  return {at_window<const int32_t>(w, w.rank, m.fwd_slot_expert), at_window<const float>(w, w.rank, m.fwd_slot_weight),
          at_window<const int32_t>(w, w.rank, m.fwd_slot_index), f * s.topk, -1};
}

// Slot k: local expert (or -1), weight (0 when not here) and index among the source's pairs of it.
__device__ void slot_of(const RowSlots& rs, const Shape& s, int64_t k, int32_t& l, float& weight, int32_t& index) {
  l = rs.expert[rs.first + k];
  weight = rs.weight[rs.first + k];
  index = rs.index[rs.first + k];
  if (rs.local_of >= 0) {
    const bool here = l >= 0 && l / s.local_experts == rs.local_of;
    l = here ? static_cast<int32_t>(l % s.local_experts) : -1;
    weight = here ? weight : 0.0f;
    index = here ? index : 0;
  }
}

// Rank-major, one warp: received row `pos` of `source`'s stream to output row i. Every load is
// issued before the row is copied and every store after, so their latencies overlap the copy.
__device__ void receive_row_rank_major(const Shape& s, const RecvArrays& r, const RecvOutputs& out, const SendRows* own,
                                       const char* payload, int32_t token, const RowSlots& slots, int source,
                                       int64_t pos, int lane) {
  const int64_t i = r.rank_offsets[source] + pos;
  constexpr int kBlocks = 2;  // topk <= 64: lane k holds slots k and 32 + k
  int32_t l[kBlocks];
  float weight[kBlocks];
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t k = b * 32 + lane;
    int32_t index;
    l[b] = -1;
    weight[b] = 0.0f;
    if (k < s.topk) slot_of(slots, s, k, l[b], weight[b], index);
  }
  const bool kept = i < r.info[2];
  if (kept) place_row(own, payload, token, out, &i, 1, lane);
  if (lane == 0) {
    r.src_rank[i] = source;
    r.src_token[i] = token;
    if (kept) {
      out.src[2 * i] = source;
      out.src[2 * i + 1] = token;
    }
  }
  for (int b = 0; b < kBlocks; ++b) {
    const int64_t k = b * 32 + lane;
    if (k >= s.topk) break;
    r.slot_expert[i * s.topk + k] = l[b];
    r.slot_weight[i * s.topk + k] = weight[b];
    r.slot_row[i * s.topk + k] = l[b] >= 0 ? i : -1;
    if (kept) {
      out.topk_idx[i * s.topk + k] = l[b];
      out.topk_weights[i * s.topk + k] = weight[b];
    }
  }
}

// Expert-major, one warp: received row `pos` of `source`'s stream into the handle and the
// row of each of its local experts. Lane k holds slot k (in blocks of 32 slots); the rows to
// fill travel by ballot and shuffle, kRowGroup at a time per read of the row.
__device__ void receive_row_expert_major(const Shape& s, const RecvArrays& r, const RecvOutputs& out, const SendRows* own,
                                         const char* payload, int32_t token, const RowSlots& slots, int source,
                                         int64_t pos, int lane) {
  const int64_t i = r.rank_offsets[source] + pos, capacity = r.info[2];
  if (lane == 0) {
    r.src_rank[i] = source;
    r.src_token[i] = token;
  }
  for (int64_t k0 = 0; k0 < s.topk; k0 += 32) {
    const int64_t k = k0 + lane;
    int32_t l = -1;
    float weight = 0.0f;
    int64_t row = -1;
    if (k < s.topk) {
      int32_t index;
      slot_of(slots, s, k, l, weight, index);
      if (l >= 0) row = r.expert_offsets[l] + r.expert_base[source * s.local_experts + l] + index;
      r.slot_expert[i * s.topk + k] = l;
      r.slot_weight[i * s.topk + k] = weight;
      r.slot_row[i * s.topk + k] = row;
    }
    uint32_t todo = __ballot_sync(0xffffffffu, row >= 0 && row < capacity);
    while (todo) {
      int64_t rows[kRowGroup];
      int n = 0;
      for (; todo && n < kRowGroup; todo &= todo - 1) {
        const int b = __ffs(static_cast<int>(todo)) - 1;
        rows[n] = __shfl_sync(0xffffffffu, row, b);
        const float wb = __shfl_sync(0xffffffffu, weight, b);
        if (lane == 0) {
          out.src[2 * rows[n]] = source;
          out.src[2 * rows[n] + 1] = token;
          out.weights[rows[n]] = wb;
        }
        ++n;
      }
      place_row(own, payload, token, out, rows, n, lane);
    }
  }
}

// Places one received row (rank-major or expert-major).
__device__ void receive_row(const Shape& s, const RecvArrays& r, const RecvOutputs& out, Layout layout,
                            const SendRows* own, const char* payload, int32_t token, const RowSlots& slots, int source,
                            int64_t pos, int lane) {
  if (layout == Layout::rank_major) receive_row_rank_major(s, r, out, own, payload, token, slots, source, pos, lane);
  else receive_row_expert_major(s, r, out, own, payload, token, slots, source, pos, lane);
}

// SM engine, one warp: row j of chunk c of `source`'s stream, once the sender flagged the chunk.
// False: the wait failed.
__device__ bool receive_streamed(const PeerWindows& w, const WindowMap& m, const Shape& s, const RecvArrays& r,
                                 const RecvOutputs& out, Layout layout, const SendRows& own, int source, int64_t c,
                                 int64_t j, uint32_t epoch, uint64_t timeout_ns, DeviceStatus* st, int lane) {
  const int64_t at = source * m.max_chunks + c;
  uint64_t flag = 0;
  if (!warp_wait_flags(at_window<uint64_t>(w, w.rank, m.fwd_chunk_flag) + at, 0, 1, source, epoch, timeout_ns, st,
                       kSignalForward, lane, &flag))
    return false;
  const ChunkRange range{static_cast<int32_t>((flag & 0xffffffffu) >> kRangeCountBits),
                         static_cast<int32_t>(flag & ((1u << kRangeCountBits) - 1))};
  if (j == 0 && lane == 0) r.chunk_range[at] = range;
  if (j >= range.count) return true;
  const int64_t pos = range.start + j, f = stream_slot(s, source, pos);
  const int32_t token = at_window<const int32_t>(w, w.rank, m.fwd_token)[f];
  const char* payload = at_window<const char>(w, w.rank, m.fwd_payload + f * m.payload_stride);
  const SendRows* mine = source == w.rank && own_rows_from_input(own) ? &own : nullptr;
  receive_row(s, r, out, layout, mine, payload, token, stream_slots(w, m, s, f), source, pos, lane);
  return true;
}

// What one warp of the copy-engine receiver has already waited for and read of the source it
// is on: warps take the sources one after another, so one source's worth is enough. Each wait
// is an acquire load at system scope, which also empties the SM's L1 cache; done once per
// source (placing data, plan) and once per piece instead of for every row, the row's own loads
// are all that is left before its copy.
struct SourceSeen {
  int source = -1;
  bool placing = false;  // the source's placing data is here
  uint32_t pieces = 0;   // bit q: piece q of its rows is here
  int64_t tokens = 0;    // its token count (its plan header)
};

// Copy-engine dispatch, one warp: token t of chunk c of `source`, from the copies of its placing
// data and row (this rank's own: its arrays and x). The chunk's first warp also records how many
// of its tokens come here. False: a wait failed.
__device__ bool receive_broadcast(const PeerWindows& w, const WindowMap& m, const Shape& s, const RecvArrays& r,
                                  const RecvOutputs& out, Layout layout, const SendRows& own, const Placing& mine,
                                  int source, int slot, int64_t c, int64_t j, uint32_t epoch, uint64_t timeout_ns,
                                  DeviceStatus* st, SourceSeen& seen, int lane) {
  if (seen.source != source) {
    seen = SourceSeen{source, source == w.rank, 0u,
                      at_window<const PlanHeader>(w, w.rank, m.plans + (slot * w.ranks + source) * m.plan_stride)->tokens};
  }
  const int64_t tokens = seen.tokens;
  Placing p = mine;
  if (source != w.rank) {
    if (!seen.placing && !warp_wait_flags(at_window<uint32_t>(w, w.rank, m.meta_flag) + source, 0, 1, source, epoch,
                                          timeout_ns, st, kSignalForward, lane))
      return false;
    seen.placing = true;
    const int64_t at = source * s.max_tokens;
    p = {at_window<const int32_t>(w, w.rank, m.meta_expert) + at * s.topk,
         at_window<const float>(w, w.rank, m.meta_weight) + at * s.topk,
         at_window<const int32_t>(w, w.rank, m.meta_pos) + at * s.ranks,
         at_window<const int32_t>(w, w.rank, m.meta_index) + at * s.topk};
  }
  if (j == 0) {  // the chunk's range in the stream to this rank, for the reverse transfer
    const int64_t t = c * kChunkTokens + lane;
    const int32_t pos = lane < kChunkTokens && t < tokens ? p.pos[t * s.ranks + w.rank] : -1;
    const uint32_t here = __ballot_sync(0xffffffffu, pos >= 0);
    const int32_t first = here ? __shfl_sync(0xffffffffu, pos, __ffs(static_cast<int>(here)) - 1) : 0;
    if (lane == 0) r.chunk_range[source * m.max_chunks + c] = ChunkRange{first, __popc(here)};
  }
  const int64_t t = c * kChunkTokens + j;
  if (t >= tokens) return true;
  const int32_t pos = p.pos[t * s.ranks + w.rank];
  if (pos < 0) return true;
  // Own tokens' bf16 rows come from x; every other row (and own quantized rows, which encode_rows
  // wrote before this kernel) from bcast_rows.
  const bool from_x = source == w.rank && own.wire == WireFormat::bf16;
  const char* payload = at_window<const char>(w, w.rank, m.bcast_rows + (source * s.max_tokens + t) * m.bcast_stride);
  const int64_t q = t / m.piece_tokens;
  if (source != w.rank && !(seen.pieces >> q & 1u)) {
    uint32_t* piece = at_window<uint32_t>(w, w.rank, m.bcast_flag) + source * kMaxPieces + q;
    if (!warp_wait_flags(piece, 0, 1, source, epoch, timeout_ns, st, kSignalForward, lane)) return false;
    seen.pieces |= 1u << q;
  }
  const RowSlots slots{p.expert, p.weight, p.index, t * s.topk, w.rank};
  receive_row(s, r, out, layout, from_x ? &own : nullptr, payload, static_cast<int32_t>(t), slots, source, pos, lane);
  return true;
}

// Warps take rows (chunk, source, row in chunk) in chunk order, so they follow the senders;
// each waits for its chunk's flag. With a broadcast (kBroadcast, one instance each so neither
// path pays the other's registers) they take this rank's own tokens first (they are in x
// already) and then each source's tokens in order, the order its pieces land.
template <bool kBroadcast>
__global__ void __launch_bounds__(kRecvWarps<kBroadcast> * 32) dispatch_receive_kernel(PeerWindows w, WindowMap m, Shape s,
                                                                          RecvArrays r, RecvOutputs given, Layout layout,
                                                                          SendRows own, Placing mine, int phase,
                                                                          CallState* cs, uint64_t timeout_ns,
                                                                          DeviceStatus* st) {
  const uint32_t epoch = call_epoch(cs);
  RecvOutputs out = given;
  if constexpr (!kBroadcast) out.bulk = false;  // compiled out of the SM engine's receiver
  const int lane = threadIdx.x % 32;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kRecvWarps<kBroadcast>) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRecvWarps<kBroadcast>;
  if (out.bulk) init_bulk_stage(lane);
  fill_empty_rows(s, r, out, layout, warp, warps, lane);
  int64_t chunks = 0;
  for (int p = 0; p < w.ranks; ++p) chunks = max(chunks, static_cast<int64_t>(r.chunks_from[p]));
  const int64_t per_source = chunks * kChunkTokens;
  const int slot = plan_slot(cs, phase);
  SourceSeen seen;
  for (int64_t u = warp; u < per_source * w.ranks; u += warps) {
    const int64_t j = u % kChunkTokens;
    const int64_t c = kBroadcast ? u % per_source / kChunkTokens : u / kChunkTokens / w.ranks;
    const int source = static_cast<int>(kBroadcast ? (w.rank + u / per_source) % w.ranks : u / kChunkTokens % w.ranks);
    if (c >= r.chunks_from[source]) continue;
    if constexpr (kBroadcast) {
      if (!receive_broadcast(w, m, s, r, out, layout, own, mine, source, slot, c, j, epoch, timeout_ns, st, seen, lane))
        break;
    } else if (!receive_streamed(w, m, s, r, out, layout, own, source, c, j, epoch, timeout_ns, st, lane)) {
      break;
    }
  }
  if (out.bulk) finish_bulk_copies(lane);
  if constexpr (!kBroadcast) return;
  // The last block to finish tells every source that its broadcast rows here are read (also in
  // a failed call: the sources' next broadcasts wait for it).
  if (!last_block(&cs->recv_blocks_done) || threadIdx.x >= 32) return;
  __threadfence_system();
  release_broadcast_rows(w, m, epoch, lane);
}

}  // namespace

void dispatch_send(const Ctx& ctx, int blocks, const SendRows& rows, int64_t tokens, const SendPlan& plan) {
  if (tokens == 0) return;
  dispatch_send_kernel<<<blocks, kSendThreads, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, rows, tokens, plan,
                                                                 ctx.state, ctx.status);
}

void dispatch_receive(const Ctx& ctx, int blocks, const RecvArrays& r, const RecvOutputs& out, Layout layout,
                      const SendRows& own, const Placing& mine, int phase) {
  auto* kernel = own.broadcast ? dispatch_receive_kernel<true> : dispatch_receive_kernel<false>;
  const int threads = 32 * (own.broadcast ? kRecvWarps<true> : kRecvWarps<false>);
  RecvOutputs o = out;
  o.bulk = own.broadcast;
  const size_t smem = o.bulk ? static_cast<size_t>(bulk_stage_smem(kRecvWarps<true>)) : 0;
  kernel<<<blocks, threads, smem, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, r, o, layout, own, mine, phase,
                                                ctx.state, ctx.timeout_ns, ctx.status);
}

void preload_dispatch_kernels() {
  preload(dispatch_send_kernel, dispatch_receive_kernel<false>, dispatch_receive_kernel<true>);
  EPX_CUDA(cudaFuncSetAttribute(dispatch_receive_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(bulk_stage_smem(kRecvWarps<true>))));
}

}  // namespace epx::detail::kernels
