// Combine and the backward passes: partial sums on the expert rank, one bf16 row per
// (token, rank) back to the source, the final sum there; sums in the order of
// docs/semantics.md so results equal the CPU backend's bit for bit.
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

namespace {

constexpr int kWarps = 8;
constexpr int kChunk = 8;  // channels per lane step: 16 bytes of bf16

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

__device__ int64_t source_position(const RecvArrays& r, int64_t i) { return i - r.rank_offsets[r.src_rank[i]]; }

// Warp per received row: partial sum over its slots in slot order, to the source's reverse area.
__global__ void __launch_bounds__(kWarps * 32) combine_send_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r,
                                                                  Layout layout, const uint16_t* y, int64_t y_stride,
                                                                  bool weighted, const float* slot_values,
                                                                  int64_t slot_values_stride, DeviceStatus* st) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = failed(st) ? 0 : r.info[0], capacity = r.info[2];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; i < rows;
       i += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int src = r.src_rank[i];
    const int64_t at = w.rank * s.max_tokens + source_position(r, i);
    if (y) {
      uint16_t* dst = at_window<uint16_t>(w, src, m.rev_rows + at * s.hidden * 2);
      for (int64_t h = lane * kChunk; h < s.hidden; h += 32 * kChunk) {
        float acc[kChunk] = {};
        float v[kChunk];
        if (layout == Layout::rank_major) {
          if (i < capacity) {
            load_chunk(y + i * y_stride, h, s.hidden, v);
            for (int c = 0; c < kChunk; ++c) acc[c] = acc[c] + v[c];
          }
        } else {
          for (int64_t k = 0; k < s.topk; ++k) {
            const int64_t row = r.slot_row[i * s.topk + k];
            if (row < 0 || row >= capacity) continue;
            load_chunk(y + row * y_stride, h, s.hidden, v);
            const float wk = r.slot_weight[i * s.topk + k];
            for (int c = 0; c < kChunk; ++c) acc[c] = weighted ? __fmaf_rn(wk, v[c], acc[c]) : __fadd_rn(acc[c], v[c]);
          }
        }
        store_chunk(dst, h, s.hidden, acc);
      }
    }
    if (slot_values) {
      float* dst = at_window<float>(w, src, m.rev_slots + at * s.topk * 4);
      for (int64_t k = lane; k < s.topk; k += 32) {
        const int64_t row = r.slot_row[i * s.topk + k];
        float v = 0.0f;
        if (row >= 0 && row < capacity)
          v = layout == Layout::rank_major ? slot_values[row * slot_values_stride + k] : slot_values[row * slot_values_stride];
        dst[k] = v;
      }
    }
  }
  block_done_signal(w, m, kSignalReverse);
}

// Warp per source token: rows returned by each rank, in rank order, then the shared expert.
__global__ void __launch_bounds__(kWarps * 32) combine_reduce_kernel(PeerWindows w, WindowMap m, Shape s, int64_t tokens,
                                                                    const int32_t* send_pos, const int32_t* slot_expert,
                                                                    const uint16_t* shared, int64_t shared_stride,
                                                                    uint16_t* out, float* slot_out, const DeviceStatus* st) {
  if (failed(st)) return;
  const int lane = threadIdx.x % 32;
  const uint16_t* rev = at_window<const uint16_t>(w, w.rank, m.rev_rows);
  const float* rev_slots = at_window<const float>(w, w.rank, m.rev_slots);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    if (out) {
      for (int64_t h = lane * kChunk; h < s.hidden; h += 32 * kChunk) {
        float acc[kChunk] = {};
        float v[kChunk];
        for (int d = 0; d < w.ranks; ++d) {
          const int32_t pos = send_pos[t * w.ranks + d];
          if (pos < 0) continue;
          load_chunk(rev + (d * s.max_tokens + pos) * s.hidden, h, s.hidden, v);
          for (int c = 0; c < kChunk; ++c) acc[c] = __fadd_rn(acc[c], v[c]);
        }
        if (shared) {
          load_chunk(shared + t * shared_stride, h, s.hidden, v);
          for (int c = 0; c < kChunk; ++c) acc[c] = __fadd_rn(acc[c], v[c]);
        }
        store_chunk(out + t * s.hidden, h, s.hidden, acc);
      }
    }
    if (slot_out)
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

// combine_backward on the expert rank: warp per received row; grad_y rows from the forwarded
// grad_out, and (weighted) the weight gradient of each slot as the specified lane-order dot.
__global__ void __launch_bounds__(kWarps * 32) expand_grad_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r,
                                                                 Layout layout, bool weighted, const uint16_t* y,
                                                                 int64_t y_stride, uint16_t* grad_y, DeviceStatus* st) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = failed(st) ? 0 : r.info[0], capacity = r.info[2];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; i < rows;
       i += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int src = r.src_rank[i];
    const int64_t pos = source_position(r, i);  // this row's place in the stream from src
    const int64_t at = w.rank * s.max_tokens + pos;
    const uint16_t* g = at_window<const uint16_t>(w, w.rank, m.fwd_payload + (src * s.max_tokens + pos) * m.payload_stride);
    float* slot_dst = at_window<float>(w, src, m.rev_slots + at * s.topk * 4);
    for (int64_t k = 0; k < s.topk; ++k) {
      const int64_t row = r.slot_row[i * s.topk + k];
      const bool valid = row >= 0 && row < capacity;
      if (valid) {  // rank-major: every local slot shares row i and writes the same grad_out
        const float wk = r.slot_weight[i * s.topk + k];
        float dot = 0.0f;
        for (int64_t h = lane * kChunk; h < s.hidden; h += 32 * kChunk) {
          float gv[kChunk], out[kChunk];
          load_chunk(g, h, s.hidden, gv);
          if (weighted) {
            float yv[kChunk];
            load_chunk(y + row * y_stride, h, s.hidden, yv);
            for (int c = 0; c < kChunk && h + c < s.hidden; ++c) dot = __fmaf_rn(gv[c], yv[c], dot);
            for (int c = 0; c < kChunk; ++c) out[c] = __fmul_rn(wk, gv[c]);
          } else {
            for (int c = 0; c < kChunk; ++c) out[c] = gv[c];
          }
          store_chunk(grad_y + row * s.hidden, h, s.hidden, out);
        }
        for (int o = 16; o >= 1; o /= 2) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
        if (lane == 0 && weighted) slot_dst[k] = dot;
      } else if (lane == 0 && weighted) {
        slot_dst[k] = 0.0f;
      }
    }
  }
  block_done_signal(w, m, kSignalReverse);
}

}  // namespace

void combine_send(const Ctx& ctx, const RecvArrays& r, Layout layout, const uint16_t* y, int64_t y_stride, bool weighted,
                  const float* slot_values, int64_t slot_values_stride) {
  combine_send_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, r, layout, y, y_stride,
                                                                   weighted, slot_values, slot_values_stride, ctx.status);
}

void combine_reduce(const Ctx& ctx, int64_t tokens, const int32_t* send_pos, const int32_t* slot_expert,
                    const uint16_t* shared, int64_t shared_stride, uint16_t* out, float* slot_out) {
  if (tokens == 0) return;
  combine_reduce_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, tokens, send_pos,
                                                                     slot_expert, shared, shared_stride, out, slot_out,
                                                                     ctx.status);
}

void expand_grad(const Ctx& ctx, const RecvArrays& r, Layout layout, bool weighted, const uint16_t* y, int64_t y_stride,
                 uint16_t* grad_y) {
  expand_grad_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, r, layout, weighted, y,
                                                                  y_stride, grad_y, ctx.status);
}

}  // namespace epx::detail::kernels
