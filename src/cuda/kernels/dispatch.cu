// Dispatch's transfer and the receiver's layout: each token crosses once per destination
// rank (quantized on the way when the wire says so) and is expanded on arrival.
#include "cuda/kernels/block_scan.cuh"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

namespace {

constexpr int kWarps = 8;

// Writes `bytes` at `offset` of token row `pos` from this rank, on every destination rank.
struct Destinations {
  char* row[kMaxRanks];
  int count = 0;
};

// fp8 block-128: lane handles 4 channels of each block.
__device__ void send_fp8(const uint16_t* x, int64_t hidden, bool ue8m0, const Destinations& dst, int lane) {
  for (int64_t b = 0; b < hidden / kFp8Block; ++b) {
    const uint16_t* xb = x + b * kFp8Block + lane * 4;
    float v[4];
    float amax = 0.0f;
    for (int i = 0; i < 4; ++i) {
      v[i] = bf16_to_float(xb[i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
    const float scale = fp8_scale(warp_max(amax), ue8m0);
    const float inv = 1.0f / scale;
    uint32_t packed = 0;
    for (int i = 0; i < 4; ++i) packed |= static_cast<uint32_t>(float_to_e4m3(v[i] * inv)) << (8 * i);
    for (int d = 0; d < dst.count; ++d) {
      reinterpret_cast<uint32_t*>(dst.row[d] + b * kFp8Block)[lane] = packed;
      if (lane == 0) reinterpret_cast<float*>(dst.row[d] + hidden)[b] = scale;
    }
  }
}

// nvfp4: lane handles whole 16-channel blocks.
__device__ void send_nvfp4(const uint16_t* x, int64_t hidden, float given_scale, const Destinations& dst, int lane) {
  float g = given_scale;
  if (!(g > 0.0f)) {
    float m = 0.0f;
    for (int64_t h = lane; h < hidden; h += 32) m = fmaxf(m, fabsf(bf16_to_float(x[h])));
    g = nvfp4_token_global_scale(warp_max(m));
  }
  for (int64_t b = lane; b < hidden / kNvfp4Block; b += 32) {
    float v[kNvfp4Block];
    float bmax = 0.0f;
    for (int i = 0; i < kNvfp4Block; ++i) {
      v[i] = bf16_to_float(x[b * kNvfp4Block + i]);
      bmax = fmaxf(bmax, fabsf(v[i]));
    }
    const uint8_t s = nvfp4_block_scale(bmax, g);
    const float f = nvfp4_encode_factor(s, g);
    uint8_t packed[kNvfp4Block / 2];
    for (int i = 0; i < kNvfp4Block; i += 2)
      packed[i / 2] = static_cast<uint8_t>(float_to_e2m1(v[i] * f) | (float_to_e2m1(v[i + 1] * f) << 4));
    for (int d = 0; d < dst.count; ++d) {
      for (int i = 0; i < kNvfp4Block / 2; ++i) dst.row[d][b * (kNvfp4Block / 2) + i] = packed[i];
      dst.row[d][hidden / 2 + b] = static_cast<char>(s);
    }
  }
  if (lane == 0) {
    const float inv = 1.0f / g;
    for (int d = 0; d < dst.count; ++d)
      for (int i = 0; i < 4; ++i) dst.row[d][hidden / 2 + hidden / kNvfp4Block + i] = reinterpret_cast<const char*>(&inv)[i];
  }
}

__global__ void __launch_bounds__(kWarps * 32) send_tokens_kernel(PeerWindows w, WindowMap m, Shape s, SendRows rows,
                                                                 int64_t tokens, const int32_t* slot_expert,
                                                                 const float* slot_weight, const int32_t* send_pos,
                                                                 const int64_t* tokens_to_rank, DeviceStatus* st) {
  const int lane = threadIdx.x % 32;
  const bool skip = failed(st);
  if (!skip && blockIdx.x == 0 && threadIdx.x < w.ranks)  // how many rows each rank gets from us
    at_window<int64_t>(w, threadIdx.x, m.fwd_rows)[w.rank] = tokens_to_rank[threadIdx.x];
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  for (int64_t t = skip ? tokens : warp; t < tokens; t += static_cast<int64_t>(gridDim.x) * kWarps) {
    Destinations dst;
    int64_t at[kMaxRanks];
    int to_rank[kMaxRanks];
    for (int d = 0; d < w.ranks; ++d) {
      const int32_t pos = send_pos[t * w.ranks + d];
      if (pos < 0) continue;
      const int n = dst.count++;
      at[n] = w.rank * s.max_tokens + pos;
      to_rank[n] = d;
      dst.row[n] = at_window<char>(w, d, m.fwd_payload + at[n] * m.payload_stride);
    }
    if (dst.count == 0) continue;
    const char* x = rows.x + t * rows.x_stride_bytes;
    if (rows.x_scales) {  // pre-quantized fp8: codes and scales as given
      for (int d = 0; d < dst.count; ++d) {
        warp_copy(dst.row[d], x, s.hidden, lane);
        warp_copy(dst.row[d] + s.hidden, reinterpret_cast<const char*>(rows.x_scales + t * rows.scales_stride),
                  4 * (s.hidden / kFp8Block), lane);
      }
    } else if (rows.wire == WireFormat::bf16) {
      for (int d = 0; d < dst.count; ++d) warp_copy(dst.row[d], x, 2 * s.hidden, lane);
    } else if (rows.wire == WireFormat::nvfp4) {
      send_nvfp4(reinterpret_cast<const uint16_t*>(x), s.hidden, rows.nvfp4_global_scale, dst, lane);
    } else {
      send_fp8(reinterpret_cast<const uint16_t*>(x), s.hidden, rows.wire == WireFormat::fp8_ue8m0, dst, lane);
    }
    if (!rows.with_meta) continue;
    for (int d = 0; d < dst.count; ++d) {
      const int r = to_rank[d];
      if (lane == 0) at_window<int32_t>(w, r, m.fwd_token)[at[d]] = static_cast<int32_t>(t);
      for (int64_t k = lane; k < s.topk; k += 32) {
        const int32_t e = slot_expert[t * s.topk + k];
        const bool here = e >= 0 && e / s.local_experts == r;
        at_window<int32_t>(w, r, m.fwd_slot_expert)[at[d] * s.topk + k] = here ? static_cast<int32_t>(e % s.local_experts) : -1;
        at_window<float>(w, r, m.fwd_slot_weight)[at[d] * s.topk + k] = here ? slot_weight[t * s.topk + k] : 0.0f;
      }
    }
  }
  block_done_signal(w, m, kSignalForward);
}

// Where received row i (rank-major order) sits in this rank's forward area.
__device__ int64_t forward_slot(const int64_t* rank_offsets, int ranks, int64_t max_tokens, int64_t i, int* src) {
  int s = 0;
  while (s + 1 < ranks && rank_offsets[s + 1] <= i) ++s;
  *src = s;
  return s * max_tokens + (i - rank_offsets[s]);
}

// Block 0 first fixes rank offsets; every block l then scans the rows for local expert l.
__global__ void rank_offsets_kernel(PeerWindows w, WindowMap m, RecvArrays r, const DeviceStatus* st) {
  if (threadIdx.x != 0) return;
  const int64_t* rows = at_window<const int64_t>(w, w.rank, m.fwd_rows);
  r.rank_offsets[0] = 0;
  for (int p = 0; p < w.ranks; ++p) r.rank_offsets[p + 1] = r.rank_offsets[p] + (failed(st) ? 0 : rows[p]);
  r.info[0] = r.rank_offsets[w.ranks];
}

__global__ void expert_scan_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r) {
  const int32_t l = blockIdx.x;
  const int32_t* slots = at_window<const int32_t>(w, w.rank, m.fwd_slot_expert);
  const int64_t rows = r.info[0];
  auto slot_of = [&](int64_t i) {  // the slot of row i holding expert l, or -1
    int src;
    const int64_t f = forward_slot(r.rank_offsets, w.ranks, s.max_tokens, i, &src);
    for (int64_t k = 0; k < s.topk; ++k)
      if (slots[f * s.topk + k] == l) return k;
    return int64_t{-1};
  };
  const int64_t n = block_scan_flags(rows, [&](int64_t i) { return slot_of(i) >= 0; },
                                     [&](int64_t i, int64_t pos) { r.slot_row[i * s.topk + slot_of(i)] = pos; });
  if (threadIdx.x == 0) r.tokens_per_expert[l] = n;
}

__global__ void finalize_layout_kernel(Shape s, RecvArrays r, Layout layout, int64_t alignment, int64_t capacity_rows) {
  if (threadIdx.x != 0) return;
  r.expert_offsets[0] = 0;
  for (int64_t l = 0; l < s.local_experts; ++l)
    r.expert_offsets[l + 1] = r.expert_offsets[l] + (r.tokens_per_expert[l] + alignment - 1) / alignment * alignment;
  const int64_t rows = layout == Layout::expert_major ? r.expert_offsets[s.local_experts] : r.info[0];
  r.info[1] = rows;
  r.info[2] = capacity_rows > 0 ? capacity_rows : rows;
  r.info[3] = rows > r.info[2];
}

// Warp per received row: handle arrays, then the row into every output row it fills.
__global__ void __launch_bounds__(kWarps * 32) expand_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r,
                                                            RecvOutputs out, Layout layout) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = r.info[0], capacity = r.info[2];
  const int32_t* tokens = at_window<const int32_t>(w, w.rank, m.fwd_token);
  const int32_t* slots = at_window<const int32_t>(w, w.rank, m.fwd_slot_expert);
  const float* weights = at_window<const float>(w, w.rank, m.fwd_slot_weight);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; i < rows;
       i += static_cast<int64_t>(gridDim.x) * kWarps) {
    int src;
    const int64_t f = forward_slot(r.rank_offsets, w.ranks, s.max_tokens, i, &src);
    const char* payload = at_window<const char>(w, w.rank, m.fwd_payload + f * m.payload_stride);
    if (lane == 0) {
      r.src_rank[i] = src;
      r.src_token[i] = tokens[f];
    }
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int32_t l = slots[f * s.topk + k];
      r.slot_expert[i * s.topk + k] = l;
      r.slot_weight[i * s.topk + k] = weights[f * s.topk + k];
      int64_t row = -1;
      if (l >= 0) row = layout == Layout::rank_major ? i : r.expert_offsets[l] + r.slot_row[i * s.topk + k];
      r.slot_row[i * s.topk + k] = row;
    }
    __syncwarp();
    for (int64_t k = 0; k < s.topk; ++k) {
      const int64_t row = r.slot_row[i * s.topk + k];
      if (row < 0 || row >= capacity) continue;
      if (layout == Layout::rank_major && k > 0) {  // the token's row once, at its first local slot
        bool first = true;
        for (int64_t j = 0; j < k; ++j) first &= r.slot_row[i * s.topk + j] < 0;
        if (!first) continue;
      }
      warp_copy(out.x + row * out.x_bytes, payload, out.x_bytes, lane);
      if (out.scales) warp_copy(out.scales + row * out.scale_bytes, payload + out.x_bytes, out.scale_bytes, lane);
      if (out.global) warp_copy(out.global + row * 4, payload + out.x_bytes + out.scale_bytes, 4, lane);
      if (lane == 0) {
        out.src[2 * row] = src;
        out.src[2 * row + 1] = tokens[f];
        if (layout == Layout::expert_major) out.weights[row] = weights[f * s.topk + k];
      }
      if (layout == Layout::rank_major)
        for (int64_t j = lane; j < s.topk; j += 32) {
          out.topk_idx[row * s.topk + j] = slots[f * s.topk + j];
          out.topk_weights[row * s.topk + j] = weights[f * s.topk + j];
        }
    }
  }
}

}  // namespace

void send_tokens(const Ctx& ctx, const SendRows& rows, int64_t tokens, const int32_t* slot_expert,
                 const float* slot_weight, const int32_t* send_pos, const int64_t* tokens_to_rank) {
  send_tokens_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, rows, tokens, slot_expert,
                                                                  slot_weight, send_pos, tokens_to_rank, ctx.status);
}

void receive_layout(const Ctx& ctx, const RecvArrays& r, Layout layout, int64_t alignment, int64_t capacity_rows) {
  rank_offsets_kernel<<<1, 32, 0, ctx.stream>>>(ctx.peers, ctx.map, r, ctx.status);
  expert_scan_kernel<<<static_cast<unsigned>(ctx.shape.local_experts), kScanThreads, 0, ctx.stream>>>(ctx.peers, ctx.map,
                                                                                                       ctx.shape, r);
  finalize_layout_kernel<<<1, 32, 0, ctx.stream>>>(ctx.shape, r, layout, alignment, capacity_rows);
}

void expand_rows(const Ctx& ctx, const RecvArrays& r, const RecvOutputs& out, Layout layout) {
  expand_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, r, out, layout);
}

}  // namespace epx::detail::kernels
