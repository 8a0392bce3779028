// The fp8 combine wire (docs/semantics.md, "Combine wire") on the device, for both combines: the
// expert rank's partial of a (token, rank) quantized as sum_rows_wide's store, and the source's
// sum of the returned partials in rank order. Codes [H] at a slot's start, f32 scales [H/128]
// after them.
#pragma once
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail {

// sum_rows_wide's store: a span's sums rounded to bf16, then quantized per 128-channel block as
// the fp8 dispatch wire is (the 16 lanes of a block, lanes 16j..16j+15 of a round, agree on its
// amax): vector v's 8 codes at codes + 8v, the block's f32 scale at scales[v / 16].
struct Fp8Partial {
  char* codes;
  float* scales;
  bool ue8m0;
  __device__ void operator()(int64_t v, const float (&acc)[8], bool on) const {
    float p[8];
    unpack_bf16x8(pack_bf16x8(acc), p);
    const float amax = fp8_block_amax<8, 16>(p, on);
    if (!on) return;
    const float scale = fp8_scale(amax, ue8m0);
    *reinterpret_cast<uint2*>(codes + 8 * v) = e4m3x8(p, 1.0f / scale);
    if (v % 16 == 0) scales[v / 16] = scale;
  }
};

// One warp, channels [h0, h0 + len) of a token's `out`: each rank's partial (slot(r): its slot,
// or null where the token has none) as code * scale (one fp32 product), added in rank order from
// 0, then `extra` (a bf16 row, or null), rounded to bf16. Each lane holds kFp8SumUnroll 8-byte
// loads of a partial in flight (64 bytes, as sum_rows_wide's 16-byte ones): one at a time left
// the sum bound by load latency (700 us for a V3 rank-major combine at one rank, docs/lab).
constexpr int kFp8SumUnroll = 1;
template <class Slot>
__device__ void sum_fp8_partials(Slot slot, int ranks, int64_t hidden, int64_t h0, int64_t len,
                                 const uint16_t* extra, uint16_t* out, int lane) {
  constexpr int kU = kFp8SumUnroll;
  for (int64_t base = h0 + 8 * lane; base < h0 + len; base += 8 * 32 * kU) {
    float acc[kU][8] = {};
    for (int r = 0; r < ranks; ++r) {
      const char* from = slot(r);
      if (!from) continue;
      uint2 q[kU];
      float scale[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t h = base + 8 * 32 * u;
        if (h >= h0 + len) continue;
        q[u] = *reinterpret_cast<const uint2*>(from + h);
        scale[u] = reinterpret_cast<const float*>(from + hidden)[h / kFp8Block];
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (base + 8 * 32 * u >= h0 + len) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint8_t code = static_cast<uint8_t>((i < 4 ? q[u].x : q[u].y) >> (8 * (i % 4)));
          acc[u][i] = __fadd_rn(acc[u][i], __fmul_rn(e4m3_to_float(code), scale[u]));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t h = base + 8 * 32 * u;
      if (h >= h0 + len) continue;
      if (extra)
        for (int i = 0; i < 8; ++i) acc[u][i] = __fadd_rn(acc[u][i], bf16_to_float(extra[h + i]));
      if (aligned16(out + h)) {
        *reinterpret_cast<int4*>(out + h) = pack_bf16x8(acc[u]);
      } else {
        for (int i = 0; i < 8; ++i) out[h + i] = float_to_bf16(acc[u][i]);
      }
    }
  }
}

}  // namespace epx::detail
