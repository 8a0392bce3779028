// combine_backward: grad_out rows go to the expert ranks (each token once per rank, like
// dispatch), become grad_y rows there (times the slot weight when weighted), and the weight
// gradients (lane-order dots of docs/semantics.md) come back to the sources.
#include "cuda/cuda_check.hpp"
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/cp_async.cuh"
#include "cuda/kernels/empty_rows.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail::kernels {

namespace {

constexpr int kWarps = 8;         // send_tokens
constexpr int kExpandWarps = 16;  // expand_grad: more rows in flight per SM
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

// Warp per received row i (grad_out of token src_token[i], forwarded once to this rank): its
// grad_y rows, and (weighted, expert-major only) each local slot's weight gradient back to the
// source. Rank-major: row i is grad_out as is. Expert-major unweighted: grad_out to every slot's
// row, kRowGroup rows per read. Expert-major weighted: per slot, bf16(w * g) and the dot with y.
// Rows that hold no token are zeroed here too.
__global__ void __launch_bounds__(kExpandWarps * 32) expand_grad_kernel(PeerWindows w, WindowMap m, Shape s, RecvArrays r,
                                                                       Layout layout, bool weighted, const uint16_t* y,
                                                                       int64_t y_stride, uint16_t* grad_y,
                                                                       DeviceStatus* st) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kExpandWarps) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kExpandWarps;
  const int64_t rows = failed(st) ? 0 : r.info[0], capacity = r.info[2];
  const bool wide = s.hidden % 8 == 0 && aligned16(y) && y_stride % 8 == 0 && aligned16(grad_y);
  for_each_empty_row(s, r, layout, warp, warps, [&](int64_t row) {
    char* dst = reinterpret_cast<char*>(grad_y + row * s.hidden);
    zero_row(&dst, 1, 2 * s.hidden, lane);
  });
  for (int64_t i = warp; i < rows; i += warps) {
    const int src = r.src_rank[i];
    const int64_t pos = source_position(r, i);  // this row's place in the stream from src
    const uint16_t* g = at_window<const uint16_t>(w, w.rank, m.fwd_payload + (src * s.max_tokens + pos) * m.payload_stride);
    float* slot_dst = at_window<float>(w, src, m.rev_slots + (w.rank * s.max_tokens + pos) * s.topk * 4);
    if (layout == Layout::rank_major) {  // every local slot's row is i (and weighted is refused)
      bool any = false;
      for (int64_t k = lane; k < s.topk; k += 32) {
        const int64_t row = r.slot_row[i * s.topk + k];
        any |= row >= 0 && row < capacity;
      }
      if (__any_sync(0xffffffffu, any)) {
        char* dst = reinterpret_cast<char*>(grad_y + i * s.hidden);
        copy_row(reinterpret_cast<const char*>(g), &dst, 1, 2 * s.hidden, lane);
      }
      continue;
    }
    // The staged expansion needs 16-byte rows and vectors (g's row: a window payload row).
    const bool staged = weighted && wide && aligned16(g);
    for (int64_t k0 = 0; k0 < s.topk; k0 += 32) {
      const int64_t k = k0 + lane;
      const int64_t row = k < s.topk ? r.slot_row[i * s.topk + k] : -1;
      uint32_t todo = __ballot_sync(0xffffffffu, row >= 0 && row < capacity);
      if (!weighted) {
        while (todo) {
          char* dst[kRowGroup];
          int n = 0;
          for (; todo && n < kRowGroup; todo &= todo - 1)
            dst[n++] = reinterpret_cast<char*>(grad_y + __shfl_sync(0xffffffffu, row, __ffs(static_cast<int>(todo)) - 1) * s.hidden);
          copy_row(reinterpret_cast<const char*>(g), dst, n, 2 * s.hidden, lane);
        }
        continue;
      }
      const float weight = k < s.topk ? r.slot_weight[i * s.topk + k] : 0.0f;
      float mine = 0.0f;  // lane k's slot's dot
      if (staged) {
        const bool has_row = (todo >> lane) & 1u;
        mine = scale_and_dot_staged(g, todo, has_row ? y + row * y_stride : nullptr,
                                    has_row ? grad_y + row * s.hidden : nullptr, weight, s.hidden, lane);
        todo = 0;
      }
      for (; todo; todo &= todo - 1) {
        const int b = __ffs(static_cast<int>(todo)) - 1;
        const int64_t row_b = __shfl_sync(0xffffffffu, row, b);
        const float dot = scale_and_dot(g, y + row_b * y_stride, grad_y + row_b * s.hidden,
                                        __shfl_sync(0xffffffffu, weight, b), s.hidden, lane);
        if (lane == b) mine = dot;
      }
      if (k < s.topk) slot_dst[k] = mine;  // 0 for a slot without a row here
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
  // The weighted expansion stages its rows in each warp's 14 KiB of shared memory.
  const size_t smem = weighted ? static_cast<size_t>(bulk_stage_smem(kExpandWarps)) : 0;
  expand_grad_kernel<<<ctx.blocks, kExpandWarps * 32, smem, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, r, layout,
                                                                          weighted, y, y_stride, grad_y, ctx.status);
}

void gather_slot_values(const Ctx& ctx, int64_t tokens, const int32_t* send_pos, const int32_t* slot_expert,
                        float* slot_out) {
  if (tokens == 0) return;
  gather_slot_values_kernel<<<ctx.blocks, 256, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, tokens, send_pos,
                                                                slot_expert, slot_out, ctx.status);
}

void preload_combine_backward_kernels() {
  preload(send_tokens_kernel, expand_grad_kernel, gather_slot_values_kernel);
  EPX_CUDA(cudaFuncSetAttribute(expand_grad_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(bulk_stage_smem(kExpandWarps))));
}

}  // namespace epx::detail::kernels
