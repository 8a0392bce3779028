// Number formats of the wire, bit-exact and usable on host and device.
//
// Every backend quantizes with these functions (or a bit-identical device equivalent),
// so fp8 codes and scales match across backends. docs/semantics.md gives the formulas.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define EPX_HD __host__ __device__ __forceinline__
#else
#define EPX_HD inline
#endif

namespace epx {

constexpr int kFp8Block = 128;    // channels per fp8 scale
constexpr int kNvfp4Block = 16;   // channels per nvfp4 scale
constexpr float kFp8Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
constexpr float kAmaxFloor = 1e-4f;  // amax below this is raised to it (no division by zero)

EPX_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
EPX_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- bfloat16 ----
EPX_HD float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest, ties to even; NaN stays NaN.
EPX_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- fp8 e4m3 (OCP "fn": bias 7, no infinity, 0x7f/0xff NaN, max 448) ----
EPX_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xfu, man = c & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_float(0x7fc00000u | sign);
  float mag;
  if (exp == 0) {
    mag = static_cast<float>(man) * 0.001953125f;  // man * 2^-9 (subnormal)
  } else {
    mag = bits_float(((exp + 120u) << 23) | (man << 20));
  }
  return bits_float(float_bits(mag) | sign);
}

// Round to nearest even, saturating to +-448 (the "satfinite" of cvt.rn.satfinite.e4m3x2).
EPX_HD uint8_t float_to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;                 // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;         // |f| >= 448 (incl. inf): saturate
  if (a < 0x3c800000u) {                            // |f| < 2^-6: subnormal range, step 2^-9
    const float scaled = bits_float(a) * 512.0f;    // exact
    const uint32_t q = static_cast<uint32_t>(rintf(scaled));  // ties to even
    return sign | static_cast<uint8_t>(q);          // q == 8 is the smallest normal, code 0x08
  }
  const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;  // keep 3 mantissa bits
  uint32_t code = rounded - (120u << 3);                            // rebias 127 -> 7
  if (code > 0x7eu) code = 0x7eu;
  return sign | static_cast<uint8_t>(code);
}

// ---- e2m1 (NVFP4 element): 0, 0.5, 1, 1.5, 2, 3, 4, 6 ----
EPX_HD float e2m1_to_float(uint8_t c) {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = mag[c & 7u];
  return (c & 8u) ? -m : m;
}

// Round to nearest even code, saturating at 6; NaN encodes as 0. The code is the number of
// rounding boundaries |f| is past (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; ties go to the even
// code, hence > at some and >= at others; NaN is past none): a sum of comparisons, with no
// branch for a warp's lanes to diverge on.
EPX_HD uint8_t float_to_e2m1(float f) {
  const uint8_t sign = (float_bits(f) >> 28) & 8u;
  const float a = fabsf(f);
  const int c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return c == 0 ? 0 : static_cast<uint8_t>(sign | c);
}

// ---- non-finite values (docs/semantics.md, "Non-finite values") ----
// NaN or +-inf: every exponent bit set.
EPX_HD bool is_nonfinite(float f) { return (float_bits(f) & 0x7f800000u) == 0x7f800000u; }
EPX_HD bool bf16_is_nonfinite(uint16_t b) { return (b & 0x7f80u) == 0x7f80u; }
// How messages name a non-finite value: "nan", "inf" or "-inf".
inline const char* nonfinite_name(float f) { return std::isnan(f) ? "nan" : f > 0.0f ? "inf" : "-inf"; }
// The fp32 NaN a block scale takes when its block holds a NaN or an infinity.
constexpr uint32_t kNanScaleBits = 0x7fc00000u;

// A quantization block's max |x| that keeps a non-finite value visible: the result is NaN or
// inf when m or v is (which one is unspecified; is_nonfinite tells), else max(m, |v|) exactly
// as fmaxf gives it. m >= 0 or non-finite. On the device one max.NaN (fmaxf drops a NaN).
EPX_HD float max_abs_nonfinite(float m, float v) {
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
#else
  const float a = fabsf(v);
  return a > m || std::isnan(a) ? a : m;
#endif
}

// max(m, |v|) over finite v only (a NaN or an infinity leaves m as it is): the nvfp4 row max.
EPX_HD float max_abs_finite(float m, float v) {
  const float a = fabsf(v);
  return a <= 3.40282347e38f ? fmaxf(m, a) : m;
}

// ---- scales ----
// fp8 block scale from the block's max |x|: amax / 448, or for UE8M0 that value rounded up
// to a power of two. A non-finite amax (the block holds a NaN or an infinity) gives the NaN
// scale (kNanScaleBits), whatever the rounding.
EPX_HD float fp8_scale(float amax, bool ue8m0) {
  const float s = fmaxf(amax, kAmaxFloor) / kFp8Max;
  const uint32_t b = float_bits(s);
  const float r = ue8m0 && (b & 0x7fffffu) ? bits_float((b & 0x7f800000u) + 0x800000u) : s;
  return is_nonfinite(amax) ? bits_float(kNanScaleBits) : r;  // a select, not a branch, on the device
}

// NVFP4 per-token global scale: 2688 / max|x[t]| (2688 = 448 * 6), the max over the row's finite
// values (max_abs_finite).
EPX_HD float nvfp4_token_global_scale(float rowmax) { return (kFp8Max * kE2m1Max) / fmaxf(rowmax, kAmaxFloor); }

// NVFP4 block scale code: e4m3(bmax * g / 6); the e4m3 NaN 0x7f when bmax is non-finite (the
// block holds a NaN or an infinity: its factor is then 0, so its codes are 0).
EPX_HD uint8_t nvfp4_block_scale(float bmax, float global_scale) {
  if (is_nonfinite(bmax)) return 0x7f;
  return float_to_e4m3(bmax * global_scale / kE2m1Max);
}

// Factor that multiplies x before e2m1 rounding: g / block_scale (0 when the scale is 0).
EPX_HD float nvfp4_encode_factor(uint8_t block_scale, float global_scale) {
  const float s = e4m3_to_float(block_scale);
  return s > 0.0f ? global_scale / s : 0.0f;
}

// ---- whole rows (host loops over the scalar rules above) ----
// x: H bf16; q: H e4m3 codes; scales: H/128 floats. H % 128 == 0.
void quantize_fp8_row(const uint16_t* x, int64_t hidden, bool ue8m0, uint8_t* q, float* scales);
void dequantize_fp8_row(const uint8_t* q, const float* scales, int64_t hidden, float* out);

// x: H bf16; q: H/2 bytes; scales: H/16 e4m3 codes; returns 1/g for the row.
// global_scale <= 0 selects the per-token global scale. H % 16 == 0.
float quantize_nvfp4_row(const uint16_t* x, int64_t hidden, float global_scale, uint8_t* q, uint8_t* scales);
void dequantize_nvfp4_row(const uint8_t* q, const uint8_t* scales, float inv_global, int64_t hidden, float* out);

}  // namespace epx
