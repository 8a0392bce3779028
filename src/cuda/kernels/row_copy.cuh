// Moving one row with one warp to several places at once (a peer's window, output rows):
// read once, written to each destination. Rows are read in steps of kUnroll 16-byte loads
// per lane so a warp keeps 4 KiB in flight, enough for NVLink and HBM latency to be hidden by
// a few warps per SM.
#pragma once
#include "cuda/kernels/device_common.cuh"

namespace epx::detail {

constexpr int kUnroll = 8;

__device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
// Lane `from`'s pointer, to every lane of the warp.
__device__ inline const char* shfl_ptr(const void* p, int from) {
  return reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(p), from));
}

// kConstant: the source never changes while the kernel runs (user input), so the read-only
// path may cache it. Rows written by peers during the kernel are read with plain loads.
template <bool kConstant>
__device__ inline int4 load16(const int4* p) {
  if constexpr (kConstant) return __ldg(p);
  return *p;
}

// bytes from src to each of dst[0..n); 16-byte moves when every address allows it.
template <bool kConstant = false>
__device__ void copy_row(const char* src, char* const* dst, int n, int64_t bytes, int lane) {
  bool wide = aligned16(src) && bytes % 16 == 0;
  for (int d = 0; d < n; ++d) wide &= aligned16(dst[d]);
  if (!wide) {
    for (int64_t i = lane; i < bytes; i += 32) {
      const char v = src[i];
      for (int d = 0; d < n; ++d) dst[d][i] = v;
    }
    return;
  }
  const int4* from = reinterpret_cast<const int4*>(src);
  const int64_t vectors = bytes / 16;
  for (int64_t base = 0; base < vectors; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < vectors) v[u] = load16<kConstant>(from + i);
    }
    for (int d = 0; d < n; ++d) {
      int4* to = reinterpret_cast<int4*>(dst[d]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < vectors) to[i] = v[u];
      }
    }
  }
}

// bytes_a + bytes_b consecutive bytes from src, the first bytes_a to dst_a and the rest to dst_b
// (a wire row's codes and scales into their own arrays). A tail of at most 512 bytes is loaded,
// a 16-byte vector per lane, before the head's first round, so it costs no round of its own.
__device__ inline void copy_row_split(const char* src, char* dst_a, int64_t bytes_a, char* dst_b, int64_t bytes_b,
                                      int lane) {
  const char* tail = src + bytes_a;
  if (!(bytes_b <= 512 && bytes_b % 16 == 0 && aligned16(tail) && aligned16(dst_b))) {
    copy_row(src, &dst_a, 1, bytes_a, lane);
    copy_row(tail, &dst_b, 1, bytes_b, lane);
    return;
  }
  const bool mine = lane < bytes_b / 16;
  int4 v{};
  if (mine) v = reinterpret_cast<const int4*>(tail)[lane];
  copy_row(src, &dst_a, 1, bytes_a, lane);
  if (mine) reinterpret_cast<int4*>(dst_b)[lane] = v;
}

// Zero bytes at each of dst[0..n).
__device__ inline void zero_row(char* const* dst, int n, int64_t bytes, int lane) {
  for (int d = 0; d < n; ++d) {
    if (aligned16(dst[d]) && bytes % 16 == 0)
      for (int64_t i = lane; i < bytes / 16; i += 32) reinterpret_cast<int4*>(dst[d])[i] = int4{0, 0, 0, 0};
    else
      for (int64_t i = lane; i < bytes; i += 32) dst[d][i] = 0;
  }
}

// The 8 bf16 values of a 16-byte vector as floats (little-endian: value 2j is word j's low half).
__device__ inline void unpack_bf16x8(const int4& raw, float* v) {
  const uint32_t word[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
                            static_cast<uint32_t>(raw.w)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = __uint_as_float(word[j] << 16);
    v[2 * j + 1] = __uint_as_float(word[j] & 0xffff0000u);
  }
}

// v[0..8) * inv as e4m3 codes, value i in byte i: the hardware's cvt.rn.satfinite, which
// float_to_e4m3 specifies.
__device__ inline uint2 e4m3x8(const float* v, float inv) {
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(v[i + 1] * inv), "f"(v[i] * inv));
    word[i / 4] |= static_cast<uint32_t>(pair) << (8 * (i % 4));
  }
  return make_uint2(word[0], word[1]);
}

// The max |v| of one 128-channel fp8 block whose values kLanes neighbouring lanes hold, kValues
// each (`on`: the lane holds a block of the row); every lane of the warp must call it. The max keeps
// a NaN (max.NaN, where fmaxf would drop it), so a block holding a NaN or an infinity gets the NaN
// scale from fp8_scale.
template <int kValues, int kLanes>
__device__ float fp8_block_amax(const float* v, bool on) {
  static_assert(kValues * kLanes == kFp8Block, "a block's lanes hold its 128 values");
  float amax = 0.0f;
  if (on)
    for (int i = 0; i < kValues; ++i) amax = max_abs_nonfinite(amax, v[i]);
  for (int o = 1; o < kLanes; o *= 2) amax = max_abs_nonfinite(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return amax;
}

// One 512-channel step of an fp8 row: lane's 16 values (when `on`) -> codes and its block's
// scale. Every lane of the warp calls it (fp8_block_amax: 3 shuffles over a block's 8 lanes). A
// block holding a NaN or an infinity gets the NaN scale, and its codes (x * NaN) the e4m3 NaN 0x7f.
__device__ inline void fp8_step(const float* v, bool on, int64_t h, int64_t hidden, bool ue8m0, char* const* dst, int n,
                                int lane) {
  const float amax = fp8_block_amax<16, 8>(v, on);
  if (!on) return;
  const float scale = fp8_scale(amax, ue8m0);
  const float inv = 1.0f / scale;
  const uint2 lo = e4m3x8(v, inv), hi = e4m3x8(v + 8, inv);
  const int4 codes = make_int4(static_cast<int>(lo.x), static_cast<int>(lo.y), static_cast<int>(hi.x),
                               static_cast<int>(hi.y));
  for (int d = 0; d < n; ++d) {
    *reinterpret_cast<int4*>(dst[d] + h) = codes;
    if (lane % 8 == 0) reinterpret_cast<float*>(dst[d] + hidden)[h / kFp8Block] = scale;
  }
}

// fp8 wire row (codes [H], then f32 scales [H/128]) of a bf16 row, to each of dst[0..n): its
// channels [begin, end) (begin a multiple of 128; end < 0: the whole row), codes and scales in
// their places in the row. A lane owns 16 channels of a 512-channel step; the 8 lanes of a
// 128-channel block agree on its scale. With an aligned row, kFp8Steps steps are loaded before
// any is converted, so a warp keeps 4 KiB of the row in flight. Same arithmetic as the codec's
// row quantizer.
constexpr int kFp8Steps = 4;
__device__ inline void quantize_fp8_row(const uint16_t* x, int64_t hidden, bool ue8m0, char* const* dst, int n, int lane,
                                        int64_t begin = 0, int64_t end = -1) {
  if (end < 0) end = hidden;
  float v[16];
  if (!aligned16(x)) {
    for (int64_t base = begin; base < end; base += 512) {
      const int64_t h = base + lane * 16;
      const bool on = h < end;  // hidden % 128 == 0: a block's 8 lanes are all on or all off
      if (on)
        for (int i = 0; i < 16; ++i) v[i] = bf16_to_float(x[h + i]);
      fp8_step(v, on, h, hidden, ue8m0, dst, n, lane);
    }
    return;
  }
  for (int64_t base = begin; base < end; base += 512 * kFp8Steps) {
    int4 raw[2 * kFp8Steps];
#pragma unroll
    for (int u = 0; u < kFp8Steps; ++u) {
      const int64_t h = base + u * 512 + lane * 16;
      if (h < end) {
        raw[2 * u] = __ldg(reinterpret_cast<const int4*>(x + h));
        raw[2 * u + 1] = __ldg(reinterpret_cast<const int4*>(x + h) + 1);
      }
    }
#pragma unroll
    for (int u = 0; u < kFp8Steps; ++u) {
      const int64_t h = base + u * 512 + lane * 16;
      const bool on = h < end;
      if (on) {
        unpack_bf16x8(raw[2 * u], v);
        unpack_bf16x8(raw[2 * u + 1], v + 8);
      }
      fp8_step(v, on, h, hidden, ue8m0, dst, n, lane);
    }
  }
}

// The magnitudes of a bf16 pair (a word's halves) as unsigned 16-bit numbers, each half's max
// with m's: for non-negative floats the bits order as the values, and a NaN's bits lie above an
// infinity's, which lie above every finite value's. One instruction a pair where the float max
// of the values took an unpacking, an absolute value and a compare each (by its instruction
// count the NVFP4 encode is bound by the SMs' integer and compare pipe:
// docs/lab/2026-12-07-session25.md).
__device__ inline uint32_t max_magnitudes(uint32_t m, uint32_t word) {
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(m), "r"(word & 0x7fff7fffu));
  return r;
}
__device__ inline uint32_t max_magnitudes(uint32_t m, const int4& raw) {
  m = max_magnitudes(m, static_cast<uint32_t>(raw.x));
  m = max_magnitudes(m, static_cast<uint32_t>(raw.y));
  m = max_magnitudes(m, static_cast<uint32_t>(raw.z));
  return max_magnitudes(m, static_cast<uint32_t>(raw.w));
}
// The larger half of max_magnitudes' pair, as a bf16 bit pattern.
__device__ inline uint32_t larger_half(uint32_t m) { return max(m & 0xffffu, m >> 16); }

// The largest finite |x| of a bf16 row, to every lane: with an aligned row, kUnroll 16-byte
// loads per lane are in flight before any is compared (the row-max pass is one chain of load
// rounds), and the max is of the magnitudes' bits; only a row holding a NaN or an infinity (a
// max past the largest finite bf16, 0x7f7f) is read again, comparing finite values alone.
__device__ inline float row_max_finite(const uint16_t* x, int64_t hidden, int lane) {
  const auto finite_pass = [&] {
    float m = 0.0f;
    for (int64_t h = lane; h < hidden; h += 32) m = max_abs_finite(m, bf16_to_float(x[h]));
    return warp_max(m);
  };
  if (!aligned16(x) || hidden % 8 != 0) return finite_pass();
  const int4* from = reinterpret_cast<const int4*>(x);
  const int64_t vectors = hidden / 8;
  uint32_t m = 0;
  for (int64_t base = 0; base < vectors; base += 32 * kUnroll) {
    int4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 32 + lane < vectors) raw[u] = __ldg(from + base + u * 32 + lane);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 32 + lane < vectors) m = max_magnitudes(m, raw[u]);
  }
  const uint32_t bits = __reduce_max_sync(0xffffffffu, larger_half(m));
  return bits > 0x7f7fu ? finite_pass() : __uint_as_float(bits << 16);
}

// e4m3 code of a non-negative float by the hardware's cvt.rn.satfinite (float_to_e4m3's rule),
// and a code's value by the hardware's exact conversion through f16 (e4m3_to_float's).
__device__ inline uint8_t e4m3_code(float v) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));  // v in the low byte
  return static_cast<uint8_t>(pair & 0xffu);
}
__device__ inline float e4m3_value(uint8_t code) {
  uint32_t halves;
  float value;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<uint16_t>(code)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(static_cast<uint16_t>(halves & 0xffffu)));
  return value;
}

// The e2m1 magnitude code m (0..7) of |p| for a p that is not NaN, as the float 2^23 + m:
// float_to_e2m1's rounding, on the FMA pipe but for three minima (its seven compares would go to
// the integer and compare pipe, which bounds the encode by its count: docs/lab/2026-12-07-session25.md).
// Adding 2^23 rounds a float to an integer in the low mantissa bits, to nearest even, so with a =
// min(|p|, 6): rint(2a) is the code below 2 (0, 0.5, 1, 1.5, 2: codes 0-4), 2 + rint(a) from 2 to
// 4 (2, 3, 4: codes 4-6), 4 + rint(a / 2) from 4 (4, 6: codes 6, 7), and each is at least the
// right one outside its range, so the code is their minimum. Equal to float_to_e2m1 on all 2^32
// floats but the NaNs (checked on the host, and on the device by CudaNvfp4Encode).
__device__ inline float e2m1_magnitude(float p) {
  const float a = fminf(fabsf(p), 6.0f);
  return fminf(fminf(__fmaf_rn(a, 2.0f, 0x1p23f), __fadd_rn(a, 0x1p23f + 2.0f)), __fmaf_rn(a, 0.5f, 0x1p23f + 4.0f));
}
constexpr uint32_t kTwo23Bits = 0x4b000000u;  // 2^23's bits: e2m1_magnitude's value less its code

// float_to_e2m1 of a value that is not NaN: its magnitude code, and the sign on a nonzero code.
__device__ inline uint32_t e2m1_code(float f) {
  const uint32_t c = __float_as_uint(e2m1_magnitude(f)) - kTwo23Bits;
  return c | ((__float_as_uint(f) >> 28) & (c + 7u) & 8u);  // c + 7 has bit 3 for c > 0 alone
}

// The e2m1 codes of 8 bf16 values (one 16-byte vector, words[j] holding values 2j and 2j + 1)
// times f (>= 0, finite), value i in nibble i: float_to_e2m1 of each product. The magnitudes'
// floats 2^23 + m go into their nibbles by shifts and adds (the exponent bits shifted past bit 31
// vanish, values 0's and 1's are taken off at the end); the signs, from the bf16 words' high
// bytes gathered by byte permutes, go on the nonzero codes of all 8 at once (a nibble of at most 7
// plus 7 has bit 3 for a nonzero code alone).
__device__ inline uint32_t e2m1x8(const uint32_t (&words)[4], float f) {
  uint32_t codes = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float lo = __uint_as_float(words[j] << 16), hi = __uint_as_float(words[j] & 0xffff0000u);
    codes += __float_as_uint(e2m1_magnitude(lo * f)) << (8 * j);
    codes += __float_as_uint(e2m1_magnitude(hi * f)) << (8 * j + 4);
  }
  codes -= kTwo23Bits + (kTwo23Bits << 4);
  const uint32_t low = __byte_perm(words[0], words[1], 0x7351), high = __byte_perm(words[2], words[3], 0x7351);
  const uint32_t even = __byte_perm(low, high, 0x5410), odd = __byte_perm(low, high, 0x7632);  // byte j: value 2j's, 2j + 1's high byte
  const uint32_t signs = ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
  return codes | ((codes + 0x77777777u) & signs);
}

// One nvfp4 block's 16 bf16 values (two 16-byte vectors, with global scale g): its e4m3 scale
// code and its 8 bytes of e2m1 code pairs (value 2i in byte i's low nibble), float_to_e2m1's
// rounding of each value times the block's factor (e2m1x8's, where the product cannot be NaN:
// a block holding a non-finite value has codes 0, and an infinite factor takes float_to_e2m1).
// The block's max is of the magnitudes' bits (max_abs_nonfinite's: non-finite when the block
// holds a NaN or an infinity).
__device__ inline uint8_t nvfp4_block(const int4 (&raw)[2], float g, uint2& codes) {
  const uint32_t bmax = larger_half(max_magnitudes(max_magnitudes(0u, raw[0]), raw[1]));
  if (bmax >= 0x7f80u) {  // a NaN or an infinity in the block: scale 0x7f, factor 0, every code 0
    codes = make_uint2(0u, 0u);
    return 0x7f;
  }
  const uint8_t s = e4m3_code(__uint_as_float(bmax << 16) * g / kE2m1Max);
  const float scale = e4m3_value(s);
  const float f = scale > 0.0f ? g / scale : 0.0f;  // nvfp4_encode_factor
  const uint32_t words[2][4] = {{static_cast<uint32_t>(raw[0].x), static_cast<uint32_t>(raw[0].y),
                                 static_cast<uint32_t>(raw[0].z), static_cast<uint32_t>(raw[0].w)},
                                {static_cast<uint32_t>(raw[1].x), static_cast<uint32_t>(raw[1].y),
                                 static_cast<uint32_t>(raw[1].z), static_cast<uint32_t>(raw[1].w)}};
  if (isinf(f)) {  // a given g past ~6.6e35 over a tiny scale: 0 * f is NaN, which e2m1_magnitude does not take
    float v[kNvfp4Block];
    unpack_bf16x8(raw[0], v);
    unpack_bf16x8(raw[1], v + 8);
    uint32_t word[2] = {0u, 0u};
    for (int i = 0; i < kNvfp4Block; ++i) word[i / 8] |= static_cast<uint32_t>(float_to_e2m1(v[i] * f)) << (4 * (i % 8));
    codes = make_uint2(word[0], word[1]);
    return s;
  }
  codes = make_uint2(e2m1x8(words[0], f), e2m1x8(words[1], f));
  return s;
}

// nvfp4 wire row (codes [H/2], e4m3 block scales [H/16], f32 1/g) to each of dst[0..n): its
// channels [begin, end) (multiples of 16; end < 0: the whole row) in their places in the row,
// and 1/g by the warp whose part begins the row. A lane owns whole 16-channel blocks (block
// lane + 32 i of the part), kNvfp4Loads of them loaded (two 16-byte loads each, with an aligned
// row) before any is encoded; its 8 code bytes go as one store. The per-token g is over the
// whole row's finite values (each part's warp reads the row for it); a block holding a NaN or
// an infinity (its max non-finite) gets scale 0x7f, factor 0, codes 0.
constexpr int kNvfp4Loads = 2;
__device__ inline void quantize_nvfp4_row(const uint16_t* x, int64_t hidden, float given_scale, char* const* dst, int n,
                                          int lane, int64_t begin = 0, int64_t end = -1) {
  const float g = given_scale > 0.0f ? given_scale : nvfp4_token_global_scale(row_max_finite(x, hidden, lane));
  bool wide = aligned16(x);
  for (int d = 0; d < n; ++d) wide &= (reinterpret_cast<uintptr_t>(dst[d]) & 7u) == 0;
  const int64_t blocks = (end < 0 ? hidden : end) / kNvfp4Block;
  for (int64_t base = begin / kNvfp4Block; base < blocks; base += 32 * kNvfp4Loads) {
    int4 raw[kNvfp4Loads][2];  // bf16 until encoded: half the registers of the floats
    if (wide)
#pragma unroll
      for (int u = 0; u < kNvfp4Loads; ++u) {
        const int64_t b = base + u * 32 + lane;
        if (b >= blocks) continue;
        const int4* from = reinterpret_cast<const int4*>(x + b * kNvfp4Block);
        raw[u][0] = __ldg(from);
        raw[u][1] = __ldg(from + 1);
      }
#pragma unroll
    for (int u = 0; u < kNvfp4Loads; ++u) {
      const int64_t b = base + u * 32 + lane;
      if (b >= blocks) continue;
      if (!wide) {  // the block's bf16 values into the vectors a pair at a time
        const uint16_t* at = x + b * kNvfp4Block;
        uint32_t w[8];
        for (int i = 0; i < 8; ++i) w[i] = at[2 * i] | static_cast<uint32_t>(at[2 * i + 1]) << 16;
        raw[u][0] = make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
        raw[u][1] = make_int4(static_cast<int>(w[4]), static_cast<int>(w[5]), static_cast<int>(w[6]), static_cast<int>(w[7]));
      }
      uint2 codes;
      const uint8_t s = nvfp4_block(raw[u], g, codes);
      for (int d = 0; d < n; ++d) {
        char* at = dst[d] + b * (kNvfp4Block / 2);
        if (wide) *reinterpret_cast<uint2*>(at) = codes;
        else for (int i = 0; i < 8; ++i) at[i] = static_cast<char>((i < 4 ? codes.x : codes.y) >> (8 * (i % 4)));
        dst[d][hidden / 2 + b] = static_cast<char>(s);
      }
    }
  }
  if (lane == 0 && begin == 0) {
    const float inv = 1.0f / g;
    for (int d = 0; d < n; ++d)
      for (int i = 0; i < 4; ++i) dst[d][hidden / 2 + hidden / kNvfp4Block + i] = reinterpret_cast<const char*>(&inv)[i];
  }
}

constexpr int kSumUnroll = 4;   // 16-byte vectors per lane in flight per term

// acc[c] = fma(weight, v[c], acc[c]) for the 8 bf16 values of a 16-byte vector (little-endian:
// value 2j is word j's low half). An unweighted sum passes weight 1: fma(1, v, acc) rounds
// v + acc once, so it equals acc + v bit for bit, and one instruction serves both sums.
__device__ inline void fma_bf16x8(float (&acc)[8], const int4& raw, float weight) {
  const uint32_t word[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
                            static_cast<uint32_t>(raw.w)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    acc[2 * j] = __fmaf_rn(weight, __uint_as_float(word[j] << 16), acc[2 * j]);
    acc[2 * j + 1] = __fmaf_rn(weight, __uint_as_float(word[j] & 0xffff0000u), acc[2 * j + 1]);
  }
}

// lo and hi rounded to bf16 (nearest, ties to even), lo in the low half: float_to_bf16's bits,
// by one hardware conversion for the pair. The hardware gives a canonical NaN where
// float_to_bf16 keeps the payload, so a pair whose sum is NaN (a NaN, or infinities that cancel)
// takes float_to_bf16. The software rounding alone cost ~8 instructions a value: most of a
// one-term sum's instructions (docs/lab/2026-12-01-performance-diary.md).
__device__ inline uint32_t bf16x2_bits(float lo, float hi) {
  uint32_t word;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));  // the first operand goes high
  if (isnan(lo + hi)) word = static_cast<uint32_t>(float_to_bf16(lo)) | static_cast<uint32_t>(float_to_bf16(hi)) << 16;
  return word;
}

// The 8 sums rounded to bf16, as one 16-byte vector.
__device__ inline int4 pack_bf16x8(const float (&acc)[8]) {
  return int4{static_cast<int>(bf16x2_bits(acc[0], acc[1])), static_cast<int>(bf16x2_bits(acc[2], acc[3])),
              static_cast<int>(bf16x2_bits(acc[4], acc[5])), static_cast<int>(bf16x2_bits(acc[6], acc[7]))};
}

// The wide form of sum_rows below: for each 16-byte vector v < hidden / 8 of the span the warp
// sums, store(v, acc, on) gets its 8 fp32 sums; every lane calls it for every round of
// kSumUnroll vectors (`on`: v is in the row), so a store may shuffle between the lanes.
template <int kGroup = 1, typename Term, typename Store>
__device__ void sum_rows_wide(int n, Term term, bool weighted, int64_t hidden, int lane, Store store) {
  const int64_t vectors = hidden / 8;
  for (int64_t base = 0; base < vectors; base += 32 * kSumUnroll) {
    float acc[kSumUnroll][8] = {};
    for (int next = 0; next < n;) {
      int4 raw[kGroup][kSumUnroll];
      float weight[kGroup];
      bool present[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {  // the next kGroup present terms, in order
        const uint16_t* row = nullptr;
        while (next < n && !term(next, row, weight[g])) ++next;
        present[g] = next < n;
        ++next;
        if (!present[g]) continue;
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) {
          const int64_t v = base + u * 32 + lane;
          if (v < vectors) raw[g][u] = reinterpret_cast<const int4*>(row)[v];
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (!present[g]) continue;
        const float wg = weighted ? weight[g] : 1.0f;
#pragma unroll
        for (int u = 0; u < kSumUnroll; ++u) fma_bf16x8(acc[u], raw[g][u], wg);
      }
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) store(base + u * 32 + lane, acc[u], base + u * 32 + lane < vectors);
  }
}

// out = bf16(sum over terms i = 0..n-1 in order), fp32 accumulation from 0: acc = fma(w_i, v, acc)
// when weighted, else acc + v. term(i, row, weight) returns false for an absent term. Wide
// (16-byte) accesses when every row is 16-byte aligned and hidden % 8 == 0; then the loads of the
// next kGroup present terms are issued before any of their adds (a warp's loads in flight: kGroup
// x 4 vectors per lane), the adds still in term order.
template <int kGroup = 1, typename Term>
__device__ void sum_rows(int n, Term term, bool weighted, uint16_t* out, int64_t hidden, bool wide, int lane) {
  if (!wide) {
    for (int64_t h = lane; h < hidden; h += 32) {
      float acc = 0.0f;
      for (int i = 0; i < n; ++i) {
        const uint16_t* row;
        float weight;
        if (!term(i, row, weight)) continue;
        const float v = bf16_to_float(row[h]);
        acc = weighted ? __fmaf_rn(weight, v, acc) : __fadd_rn(acc, v);
      }
      out[h] = float_to_bf16(acc);
    }
    return;
  }
  sum_rows_wide<kGroup>(n, term, weighted, hidden, lane, [&](int64_t v, const float (&acc)[8], bool on) {
    if (on) reinterpret_cast<int4*>(out)[v] = pack_bf16x8(acc);
  });
}

}  // namespace epx::detail
