// combine_backward: grad_out rows go to the expert ranks (each token once per rank, like
// dispatch), become grad_y rows there (times the slot weight when weighted), and the weight
// gradients (lane-order dots of docs/semantics.md) come back to the sources.
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"

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

// Warp per token: its grad_out row to every rank that holds one of its slots, then signal.
__global__ void __launch_bounds__(kWarps * 32) send_tokens_kernel(PeerWindows w, WindowMap m, Shape s, SendRows rows,
                                                                 int64_t tokens, const int32_t* send_pos, DeviceStatus* st) {
  const int lane = threadIdx.x % 32;
  const bool skip = failed(st);
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  for (int64_t t = skip ? tokens : warp; t < tokens; t += static_cast<int64_t>(gridDim.x) * kWarps) {
    char* dst[kMaxRanks];
    int n = 0;
    for (int d = 0; d < w.ranks; ++d) {
      const int32_t pos = send_pos[t * w.ranks + d];
      if (pos >= 0) dst[n++] = at_window<char>(w, d, m.fwd_payload + (w.rank * s.max_tokens + pos) * m.payload_stride);
    }
    copy_row<true>(rows.x + t * rows.x_stride_bytes, dst, n, 2 * s.hidden, lane);
  }
  block_done_signal(w, m, kSignalForward);
}

__device__ int64_t source_position(const RecvArrays& r, int64_t i) { return i - r.rank_offsets[r.src_rank[i]]; }

// Warp per received row: grad_y rows from the forwarded grad_out, and (weighted) the weight
// gradient of each slot as the specified lane-order dot, back to the source.
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

// Thread per (token, slot): the value the slot's expert rank returned, 0 for unused slots.
__global__ void gather_slot_values_kernel(PeerWindows w, WindowMap m, Shape s, int64_t tokens, const int32_t* send_pos,
                                          const int32_t* slot_expert, float* slot_out, const DeviceStatus* st) {
  if (failed(st)) return;
  const float* rev_slots = at_window<const float>(w, w.rank, m.rev_slots);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < tokens * s.topk;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / s.topk, k = i % s.topk;
    const int32_t e = slot_expert[i];
    float v = 0.0f;
    if (e >= 0) {
      const int d = static_cast<int>(e / s.local_experts);
      v = rev_slots[(d * s.max_tokens + send_pos[t * w.ranks + d]) * s.topk + k];
    }
    slot_out[i] = v;
  }
}

}  // namespace

void send_tokens(const Ctx& ctx, const SendRows& rows, int64_t tokens, const int32_t* send_pos) {
  send_tokens_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, rows, tokens, send_pos,
                                                                  ctx.status);
}

void expand_grad(const Ctx& ctx, const RecvArrays& r, Layout layout, bool weighted, const uint16_t* y, int64_t y_stride,
                 uint16_t* grad_y) {
  expand_grad_kernel<<<ctx.blocks, kWarps * 32, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, r, layout, weighted, y,
                                                                  y_stride, grad_y, ctx.status);
}

void gather_slot_values(const Ctx& ctx, int64_t tokens, const int32_t* send_pos, const int32_t* slot_expert,
                        float* slot_out) {
  if (tokens == 0) return;
  gather_slot_values_kernel<<<ctx.blocks, 256, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, tokens, send_pos,
                                                                slot_expert, slot_out, ctx.status);
}

void preload_combine_backward_kernels() { preload(send_tokens_kernel, expand_grad_kernel, gather_slot_values_kernel); }

}  // namespace epx::detail::kernels
