// Dispatch's transfer. SM engine: one kernel whose first blocks to start send and the others
// receive. Senders move each token once to every other destination rank's window (quantizing on
// the way when the wire says so) and flag every finished chunk there; receivers place each
// flagged chunk's rows into the outputs at positions fixed by the plans, and this rank's own
// tokens straight from the input and the plan when the wire needs no quantizing (no sender
// touches them: at one rank with such a wire every block receives). With a copy-engine broadcast
// (broadcast.cu) there is no sender: the receiver takes every source's tokens from the copies of
// its rows and placing data, each once flagged. The last block of either kernel copies the
// call's small outputs and publishes its status.
#include "cuda/cuda_check.hpp"
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/chunk_bases.cuh"
#include "cuda/kernels/empty_rows.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"
#include "cuda/kernels/wire_encode.cuh"

namespace epx::detail::kernels {

namespace {

// Warps of a block of either kernel: a sender's copy warps and its flag warp, or a receiver's
// warps. 16 leave 128 registers a thread and room for a bulk-copy stage per warp (bulk_copy.cuh).
constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kSendWarps = kWarps - 1;  // the last warp flags finished chunks

constexpr int kRowGroup = 8;  // output rows one read of a received row is written to at once

__device__ int64_t stream_slot(const Shape& s, int source, int64_t pos) {
  return source * s.max_tokens + pos;
}

// How this rank's own rows reach its outputs: copied from x by the receivers (their wire row is
// x's, own_rows_from_input), encoded by the receivers into their warp's stage first (a quantized
// wire row that fits one), or else through the window like every other rank's.
enum class OwnRows { copied, encoded, sent };
__host__ __device__ OwnRows own_rows(const SendRows& rows, int64_t wire_row_bytes) {
  if (own_rows_from_input(rows)) return OwnRows::copied;
  return wire_row_bytes <= kBulkStageBytes ? OwnRows::encoded : OwnRows::sent;
}
__device__ int64_t wire_row_bytes(const RecvOutputs& out) { return out.x_bytes + out.scale_bytes + out.global_bytes; }

// Whether the sender moves rows to rank d (this rank's own only when OwnRows::sent).
__device__ bool sends_to(const PeerWindows& w, OwnRows own, int d) { return d != w.rank || own == OwnRows::sent; }

// One warp: token t of chunk c to every rank the sender serves that holds one of its slots, with
// the row's placing data.
__device__ void send_token(const PeerWindows& w, const WindowMap& m, const Shape& s, const SendRows& rows,
                           OwnRows own, const SendPlan& plan, int64_t c, int64_t t, int lane) {
  const ChunkPositions& p = plan.pos;
  const int64_t width = s.experts + s.ranks;
  const ChunkBases base = chunk_bases(p, width, c);
  char* dst[kMaxRanks];
  int64_t at[kMaxRanks];
  int to[kMaxRanks];
  int n = 0;
  for (int d = 0; d < s.ranks; ++d) {
    if (!sends_to(w, own, d)) continue;  // the receiver places it and owns its send_pos entry
    const int32_t in_chunk = p.send_pos[t * s.ranks + d];
    if (in_chunk < 0) continue;
    const int64_t pos = base[s.experts + d] + in_chunk;
    at[n] = stream_slot(s, w.rank, pos);
    to[n] = d;
    dst[n] = at_window<char>(w, d, m.fwd_payload + at[n] * m.payload_stride);
    ++n;
  }
  __syncwarp();  // every lane read send_pos before lane 0 turns it into stream positions
  if (lane == 0)
    for (int i = 0; i < n; ++i) p.send_pos[t * s.ranks + to[i]] = static_cast<int32_t>(at[i] - w.rank * s.max_tokens);
  if (n > 0) encode_wire_row(rows, t, s.hidden, dst, n, lane);
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

// Send block `block` of `blocks`, a chunk at a time (strided): copy warps take its tokens; the
// flag warp then publishes the chunk's rows to each destination while the copy warps go on with
// the next chunk.
__device__ void send_chunks(const PeerWindows& w, const WindowMap& m, const Shape& s, const SendRows& rows,
                            OwnRows own, int64_t tokens, const SendPlan& plan, uint32_t epoch, int block, int blocks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens, width = s.experts + s.ranks;
  for (int64_t c = block; c < chunks; c += blocks) {
    if (warp < kSendWarps)
      for (int64_t t = c * kChunkTokens + warp; t < min((c + 1) * kChunkTokens, tokens); t += kSendWarps)
        send_token(w, m, s, rows, own, plan, c, t, lane);
    __syncthreads();
    if (warp == kSendWarps && lane == 0) {
      __threadfence_system();  // the chunk's rows (all warps', seen through the barrier) before its flags
      const ChunkBases base = chunk_bases(plan.pos, width, c);
      for (int d = 0; d < s.ranks; ++d) {
        if (!sends_to(w, own, d)) continue;
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
  place_parts(codes, scales, own ? nullptr : payload + out.x_bytes + out.scale_bytes, out, rows, n, lane);
}

// A received row's slots: the stream's arrays (the sender wrote local experts, -1 elsewhere), or
// a source's Placing (global ids: this rank keeps those of its own experts).
struct RowSlots {
  const int32_t* expert;
  const float* weight;
  const int32_t* index;
  int64_t first;  // the row's first slot in the arrays
  int local_of;   // -1: ids are local already; else the rank whose experts count as local
  // Set (in_block not null): indices are places in the token's chunk (this rank's own plan), to
  // which the chunk's base for the expert is added.
  ChunkBases index_base = {nullptr, nullptr};
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
  if (rs.index_base.in_block && l >= 0) index += rs.index_base[l];
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
                                 const RecvOutputs& out, Layout layout, int source, int64_t c, int64_t j, uint32_t epoch, uint64_t timeout_ns, DeviceStatus* st, int lane) {
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
  receive_row(s, r, out, layout, nullptr, payload, token, stream_slots(w, m, s, f), source, pos, lane);
  return true;
}

// The fused shared expert (SharedRows), one warp: token t's row t of the outputs, from its wire
// row `payload` (codes, scales and 1/g back to back) or (own != null) the input row and its
// given scales, with recv_src = (rank, t) and its weight, which the handle keeps too (combine's
// shared term). No bulk copy: the warp's stage may hold the payload. Its padding rows are empty
// rows (fill_empty_rows).
__device__ void place_shared_row(const Shape& s, const RecvOutputs& out, const SendRows* own, const char* payload,
                                 int64_t t, int lane) {
  RecvOutputs direct = out;
  direct.bulk = false;
  place_row(own, payload, static_cast<int32_t>(t), direct, &t, 1, lane);
  if (lane != 0) return;
  const SharedRows& shared = out.shared;
  const float weight = shared.gate ? shared.gate[t * shared.gate_stride] : 1.0f;
  out.src[2 * t] = s.rank;
  out.src[2 * t + 1] = static_cast<int32_t>(t);
  out.weights[t] = weight;
  shared.weight[t] = weight;
}

// Every shared row whose wire row is the input's (own_rows_from_input), or (encoded != null)
// in this rank's encoded rows, `stride` bytes apart; the receiving warps' share.
__device__ void place_shared_rows(const Shape& s, const RecvOutputs& out, const SendRows& own, const char* encoded,
                                  int64_t stride, int64_t warp, int64_t warps) {
  const int lane = threadIdx.x % 32;
  for (int64_t t = warp; t < out.shared.tokens; t += warps)
    place_shared_row(s, out, encoded ? nullptr : &own, encoded ? encoded + t * stride : nullptr, t, lane);
}

// SM engine, one warp: token j of this rank's own chunk c, straight from x and the plan (no
// sender moves it): copied (kEncode false: its wire row is x's, own_rows_from_input), or encoded
// by the warp into its bulk-copy stage first (the sender's encoder: the same bits) and copied
// from there with register copies. Like a sender, the warp turns the token's place in the chunk
// into its stream position in send_pos (combine reads it), and records the chunk's range.
template <bool kEncode>
__device__ void receive_own(const WindowMap& m, const Shape& s, const RecvArrays& r, const RecvOutputs& out,
                            Layout layout, const SendRows& own, const SendPlan& plan, int64_t tokens, int64_t c,
                            int64_t j, int lane) {
  const ChunkPositions& p = plan.pos;
  const int64_t width = s.experts + s.ranks;
  const ChunkBases base = chunk_bases(p, width, c);
  const int32_t first = base[s.experts + s.rank];
  if (j == 0 && lane == 0)
    r.chunk_range[s.rank * m.max_chunks + c] = ChunkRange{first, p.chunk_count[c * width + s.experts + s.rank]};
  const int64_t t = c * kChunkTokens + j;
  if (t >= tokens) return;
  int32_t* const send_pos = p.send_pos + t * s.ranks + s.rank;
  const int32_t in_chunk = *send_pos;
  const bool shared = kEncode && out.shared.on();  // encoded here: its shared row too, from the same encoding
  if (in_chunk < 0 && !shared) return;
  const int64_t pos = first + in_chunk;
  __syncwarp();  // every lane read send_pos before lane 0 overwrites it
  if (lane == 0 && in_chunk >= 0) *send_pos = static_cast<int32_t>(pos);
  const RowSlots slots{plan.slot_expert, plan.slot_weight, p.slot_pos, t * s.topk, s.rank, base};
  if constexpr (!kEncode) {
    receive_row(s, r, out, layout, &own, nullptr, static_cast<int32_t>(t), slots, s.rank, pos, lane);
  } else {
    char* stage = warp_bulk_stage().buf;
    encode_wire_row(own, t, s.hidden, &stage, 1, lane);
    __syncwarp();  // every lane's part of the row, for every lane's copy
    if (shared) place_shared_row(s, out, nullptr, stage, t, lane);
    RecvOutputs from_stage = out;
    from_stage.bulk = false;  // a bulk copy reads global memory, not the stage
    if (in_chunk >= 0)
      receive_row(s, r, from_stage, layout, nullptr, stage, static_cast<int32_t>(t), slots, s.rank, pos, lane);
    __syncwarp();  // the copies read the stage before the next row's encoding writes it
  }
}

// A receiving block's warps, before any bulk copy uses their stages: every one of this rank's
// own tokens when its wire row is encoded here (receive_own<true>; its shared row too), then a
// proxy fence, so the stages' later bulk writes follow these generic accesses. In a loop of its
// own, apart from the receive loop's, so the encoder's registers do not add to that loop's.
__device__ void encode_own_rows(const WindowMap& m, const Shape& s, const RecvArrays& r, const RecvOutputs& out,
                                Layout layout, const SendRows& own, const SendPlan& plan, int64_t tokens, int block,
                                int blocks) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = block * static_cast<int64_t>(kWarps) + threadIdx.x / 32, warps = static_cast<int64_t>(blocks) * kWarps;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens;
  for (int64_t u = warp; u < chunks * kChunkTokens; u += warps)
    receive_own<true>(m, s, r, out, layout, own, plan, tokens, u / kChunkTokens, u % kChunkTokens, lane);
  cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);
  __syncwarp();
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

// Calls place(source, c, j) for every (source, chunk c, row j) this receiving warp owns until it
// returns false (a failed wait): rows strided over `warps` warps in chunk order, sources of each
// chunk in turn, so warps follow the senders; or (source_major) this rank's own tokens first
// (they are in x already) and then each source's in order, the order a broadcast's pieces land.
template <typename Place>
__device__ void for_each_received_row(const PeerWindows& w, const RecvArrays& r, bool source_major, int64_t warp,
                                      int64_t warps, Place place) {
  int64_t chunks = 0;
  for (int p = 0; p < w.ranks; ++p) chunks = max(chunks, static_cast<int64_t>(r.chunks_from[p]));
  const int64_t per_source = chunks * kChunkTokens;
  for (int64_t u = warp; u < per_source * w.ranks; u += warps) {
    const int64_t j = u % kChunkTokens;
    const int64_t c = source_major ? u % per_source / kChunkTokens : u / kChunkTokens / w.ranks;
    const int source = static_cast<int>(source_major ? (w.rank + u / per_source) % w.ranks : u / kChunkTokens % w.ranks);
    if (c >= r.chunks_from[source]) continue;
    if (!place(source, c, j)) return;
  }
}

// A receiving block's warps: empty rows zeroed, then every row placed (place, as above), each
// through the warp's bulk-copy stage when out.bulk.
template <typename Place>
__device__ void receive_rows(const PeerWindows& w, const Shape& s, const RecvArrays& r, const RecvOutputs& out,
                             Layout layout, bool source_major, int block, int blocks, Place place) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = block * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(blocks) * kWarps;
  if (out.bulk) init_bulk_stage(lane);
  fill_empty_rows(s, r, out, layout, warp, warps, lane);
  for_each_received_row(w, r, source_major, warp, warps, place);
  if (out.bulk) finish_bulk_copies(lane);
}

// The last block of a dispatch's transfer to finish: the call's small outputs (a copy of the
// handle's layout words, so that no output aliases what later calls on the handle read) and
// its status, for the host.
__device__ void end_dispatch(const CallEnd& end, const DeviceStatus* st) {
  for (int64_t i = threadIdx.x; i < end.word_count; i += blockDim.x) end.words_out[i] = end.words[i];
  if (threadIdx.x == 0) publish(st, end.host_status);
}

// SM engine: blocks take their roles in the order they start (arrival_order), the first
// `senders` sending, so a receiver, which may wait for this rank's senders, runs only once every
// sender has started.
__global__ void __launch_bounds__(kThreads, 1) dispatch_transfer_kernel(PeerWindows w, WindowMap m, Shape s,
                                                                       SendRows rows, int64_t tokens, SendPlan plan,
                                                                       RecvArrays r, RecvOutputs out, Layout layout,
                                                                       int senders, CallEnd end, CallState* cs,
                                                                       uint64_t timeout_ns, DeviceStatus* st) {
  wait_for_prior_kernel();  // the plan kernel's positions and layout
  const int role = arrival_order(&cs->transfer_arrivals);
  const uint32_t epoch = call_epoch(cs);
  const int lane = threadIdx.x % 32;
  const OwnRows own = own_rows(rows, wire_row_bytes(out));
  if (role < senders) {
    if (!block_sees_failure(st)) send_chunks(w, m, s, rows, own, tokens, plan, epoch, role, senders);
  } else {
    const int block = role - senders, blocks = static_cast<int>(gridDim.x) - senders;
    if (out.shared.on() && own == OwnRows::copied)  // encoded: by encode_own_rows
      place_shared_rows(s, out, rows, nullptr, 0, block * int64_t{kWarps} + threadIdx.x / 32, int64_t{blocks} * kWarps);
    if (own == OwnRows::encoded) encode_own_rows(m, s, r, out, layout, rows, plan, tokens, block, blocks);
    receive_rows(w, s, r, out, layout, false, block, blocks, [&](int source, int64_t c, int64_t j) {
      if (source == w.rank && own != OwnRows::sent) {  // placed already when encoded here
        if (own == OwnRows::copied) receive_own<false>(m, s, r, out, layout, rows, plan, tokens, c, j, lane);
        return true;
      }
      return receive_streamed(w, m, s, r, out, layout, source, c, j, epoch, timeout_ns, st, lane);
    });
  }
  if (last_block(&cs->transfer_blocks_done)) end_dispatch(end, st);
}

// Copy-engine receiver. Its last block also tells every source that its broadcast rows here are
// read (also in a failed call: the sources' next broadcasts wait for it).
__global__ void __launch_bounds__(kThreads, 1) dispatch_receive_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r,
                                                                      RecvOutputs out, Layout layout, SendRows own,
                                                                      Placing mine, int phase, CallEnd end, CallState* cs,
                                                                      uint64_t timeout_ns, DeviceStatus* st) {
  const uint32_t epoch = call_epoch(cs);
  const int slot = plan_slot(cs, phase);
  const int lane = threadIdx.x % 32;
  SourceSeen seen;
  if (out.shared.on()) {  // quantized rows: from this rank's encoded broadcast rows (encode_rows wrote them)
    const char* encoded = at_window<const char>(w, w.rank, m.bcast_rows + w.rank * s.max_tokens * m.bcast_stride);
    place_shared_rows(s, out, own, own_rows_from_input(own) ? nullptr : encoded, m.bcast_stride,
                      blockIdx.x * int64_t{kWarps} + threadIdx.x / 32, int64_t{gridDim.x} * kWarps);
  }
  receive_rows(w, s, r, out, layout, true, blockIdx.x, gridDim.x, [&](int source, int64_t c, int64_t j) {
    return receive_broadcast(w, m, s, r, out, layout, own, mine, source, slot, c, j, epoch, timeout_ns, st, seen, lane);
  });
  if (!last_block(&cs->transfer_blocks_done)) return;
  end_dispatch(end, st);
  if (threadIdx.x >= 32) return;
  __threadfence_system();
  release_broadcast_rows(w, m, epoch, lane);
}

const size_t kBulkSmem = static_cast<size_t>(bulk_stage_smem(kWarps));

}  // namespace

bool own_rows_sent(const SendRows& rows, int64_t wire_row_bytes) {
  return own_rows(rows, wire_row_bytes) == OwnRows::sent;
}

void dispatch_transfer(const Ctx& ctx, int senders, const SendRows& rows, int64_t tokens, const SendPlan& plan,
                       const RecvArrays& r, const RecvOutputs& out, Layout layout, const CallEnd& end) {
  RecvOutputs o = out;
  o.bulk = true;
  EPX_CUDA(launch_after_prior(dispatch_transfer_kernel, ctx.blocks, kThreads, kBulkSmem, ctx.stream, ctx.peers, ctx.map,
                              ctx.shape, rows, tokens, plan, r, o, layout, senders, end, ctx.state, ctx.timeout_ns,
                              ctx.status));
}

void dispatch_receive(const Ctx& ctx, const RecvArrays& r, const RecvOutputs& out, Layout layout, const SendRows& own,
                      const Placing& mine, int phase, const CallEnd& end) {
  RecvOutputs o = out;
  o.bulk = true;
  dispatch_receive_kernel<<<ctx.blocks, kThreads, kBulkSmem, ctx.stream>>>(
      ctx.peers, ctx.map, ctx.shape, r, o, layout, own, mine, phase, end, ctx.state, ctx.timeout_ns, ctx.status);
}

void preload_dispatch_kernels() {
  preload(dispatch_transfer_kernel, dispatch_receive_kernel);
  for (const void* kernel : {reinterpret_cast<const void*>(dispatch_transfer_kernel),
                             reinterpret_cast<const void*>(dispatch_receive_kernel)})
    EPX_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBulkSmem)));
}

}  // namespace epx::detail::kernels
