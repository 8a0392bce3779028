// The fp8 combine wire (docs/semantics.md, "Combine wire") on the device, for both combines: the
// expert rank's partial of a (token, rank) quantized as sum_rows_wide's store, and the source's
// sum of the returned partials in rank order. Codes [H] at a slot's start, f32 scales [H/128]
// after them.
#pragma once
#include <cuda_fp16.h>

#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/cp_async.cuh"
#include "cuda/kernels/row_copy.cuh"
#include "cuda/kernels/staged_sum.cuh"

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

// Two e4m3 codes (the low byte first) as floats by the hardware's conversion, through f16 (which
// holds every e4m3 value exactly; a NaN stays a NaN, and the product after it makes every NaN
// the same one, whichever decoder ran): 2 instructions for what e4m3_to_float takes ~10 each.
__device__ inline float2 e4m3x2_to_float2(uint32_t pair) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<uint16_t>(pair)));
  __half2 h;
  memcpy(&h, &halves, sizeof h);
  return __half22float2(h);
}

// acc[i] + e4m3(code i of q) * scale: one fp32 product, then one fp32 add (the CPU backend's).
__device__ inline void add_fp8x8(float (&acc)[8], uint2 q, float scale) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 v = e4m3x2_to_float2((j < 2 ? q.x : q.y) >> (16 * (j % 2)));
    acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(v.x, scale));
    acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(v.y, scale));
  }
}

// The bf16 rows a token's sum adds after the ranks' partials, in order (null: none), the first
// times `weight`, the second plain (one fma: with 1, a plain add): the shared expert's row and
// shared_out, or shared_out alone.
struct ExtraRows {
  const uint16_t* row[2] = {nullptr, nullptr};
  float weight = 1.0f;
};

// One warp, channels [h0, h0 + len) of a token's `out`: each rank's partial (slot(r): its slot,
// or null where the token has none) as code * scale, added in rank order from 0, then the extra
// rows (each at the same channels as out), rounded to bf16. Each
// lane keeps kFp8SumUnroll 8-byte loads of a partial in flight (more made the combine kernels
// spill); sum_fp8_partials_staged keeps more.
constexpr int kFp8SumUnroll = 2;
template <class Slot>
__device__ void sum_fp8_partials(Slot slot, int ranks, int64_t hidden, int64_t h0, int64_t len,
                                 const ExtraRows& extra, uint16_t* out, int lane) {
  constexpr int kU = kFp8SumUnroll;
  for (int64_t base = h0 + 8 * lane; base < h0 + len; base += 8 * 32 * kU) {
    float acc[kU][8] = {};
    for (int r = 0; r < ranks; ++r) {
      const char* from = slot(r);
      if (!from) continue;
      uint2 q[kU];
      float scale[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {  // every load, then every add
        const int64_t h = base + 8 * 32 * u;
        if (h >= h0 + len) continue;
        q[u] = *reinterpret_cast<const uint2*>(from + h);
        scale[u] = reinterpret_cast<const float*>(from + hidden)[h / kFp8Block];
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (base + 8 * 32 * u < h0 + len) add_fp8x8(acc[u], q[u], scale[u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t h = base + 8 * 32 * u;
      if (h >= h0 + len) continue;
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (extra.row[e])
          for (int i = 0; i < 8; ++i) acc[u][i] = __fmaf_rn(e == 0 ? extra.weight : 1.0f, bf16_to_float(extra.row[e][h + i]), acc[u][i]);
      if (aligned16(out + h)) {
        *reinterpret_cast<int4*>(out + h) = pack_bf16x8(acc[u]);
      } else {
        for (int i = 0; i < 8; ++i) out[h + i] = float_to_bf16(acc[u][i]);
      }
    }
  }
}

// sum_fp8_partials over a whole row (out and the extra rows 16-byte aligned, at most 32 ranks; slot(r) is
// called by lane r only), the partials' bytes through the warp's stage as sum_rows_staged's rows
// (a CpAsyncRing of kStageSlots entries): one item is a 1024-channel slice of one rank's partial,
// its codes at entry[0, 1024) (lane l's 16 codes of half u at 512u + 16l) and, at 1024 + 32l,
// the two 16-byte groups of 4 scales that hold lane l's two scales (blocks 4u + l/8). A group
// may reach past the row's last scale, never past its slot's 2H bytes.
constexpr int kFp8Slice = 1024;
static_assert(2 * kFp8Slice <= kSlotBytes, "a stage entry holds a slice's codes and its lanes' scale groups");
template <class Slot>
__device__ void sum_fp8_partials_staged(Slot slot, int ranks, int64_t hidden, const ExtraRows& extra, uint16_t* out,
                                        int lane) {
  const char* mine = lane < ranks ? slot(lane) : nullptr;
  const unsigned held = __ballot_sync(0xffffffffu, mine != nullptr);  // in rank order, lowest first
  const int count = __popc(held);
  const char* from = shfl_ptr(mine, lane < count ? static_cast<int>(__fns(held, 0, lane + 1)) : 0);
  const int slices = static_cast<int>((hidden + kFp8Slice - 1) / kFp8Slice);
  int issue_slice = 0, issue_term = 0;
  auto load = [&](char* entry) {  // this lane's bytes of item (issue_slice, issue_term)
    const char* src = shfl_ptr(from, issue_term);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t c = int64_t{issue_slice} * kFp8Slice + 512 * u + 16 * lane;
      if (c >= hidden) continue;
      cp_async16(entry + 512 * u + 16 * lane, src + c);
      cp_async16(entry + kFp8Slice + 32 * lane + 16 * u, src + hidden + 4 * (c / kFp8Block / 4 * 4));
    }
    if (++issue_term == count) issue_term = 0, ++issue_slice;
  };
  CpAsyncRing<kStageSlots> ring(warp_bulk_stage().buf, static_cast<int>(kSlotBytes), slices * count);
  ring.fill(load);
  float acc[4][8] = {};  // half u's 16 channels in acc[2u], acc[2u + 1]
  auto store = [&](int slice) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t c = int64_t{slice} * kFp8Slice + 512 * u + 16 * lane;
      if (c >= hidden) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float(&a)[8] = acc[2 * u + half];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          if (extra.row[e]) fma_bf16x8(a, *reinterpret_cast<const int4*>(extra.row[e] + c + 8 * half), e == 0 ? extra.weight : 1.0f);
        *reinterpret_cast<int4*>(out + c + 8 * half) = pack_bf16x8(a);
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = 0.0f;
      }
    }
  };
  for (int slice = 0, term = 0; slice < slices && count > 0;) {
    const char* in = ring.oldest();
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // past a short last slice: stale bytes, never stored
      const uint4 q = *reinterpret_cast<const uint4*>(in + 512 * u + 16 * lane);
      const float scale = reinterpret_cast<const float*>(in + kFp8Slice + 32 * lane + 16 * u)[lane / 8];
      add_fp8x8(acc[2 * u], make_uint2(q.x, q.y), scale);
      add_fp8x8(acc[2 * u + 1], make_uint2(q.z, q.w), scale);
    }
    ring.refill(load);
    if (++term == count) store(slice++), term = 0;
  }
  if (count == 0)  // no partial: the sum from 0
    for (int slice = 0; slice < slices; ++slice) store(slice);
}

}  // namespace epx::detail
