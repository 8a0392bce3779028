// Row quantizers built from the scalar rules of epx/codec.hpp. The CPU backend uses these;
// device code must produce the same bits.
#include "epx/codec.hpp"

namespace epx {

namespace {
// max |x| of a quantization block; non-finite when the block holds a NaN or an infinity.
float block_amax(const uint16_t* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = max_abs_nonfinite(m, bf16_to_float(x[i]));
  return m;
}
// max |x| over the finite values (the nvfp4 per-token global scale's).
float finite_amax(const uint16_t* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = max_abs_finite(m, bf16_to_float(x[i]));
  return m;
}
}  // namespace

void quantize_fp8_row(const uint16_t* x, int64_t hidden, bool ue8m0, uint8_t* q, float* scales) {
  for (int64_t b = 0; b < hidden / kFp8Block; ++b) {
    const uint16_t* xb = x + b * kFp8Block;
    const float scale = fp8_scale(block_amax(xb, kFp8Block), ue8m0);
    const float inv = 1.0f / scale;
    scales[b] = scale;
    for (int i = 0; i < kFp8Block; ++i) q[b * kFp8Block + i] = float_to_e4m3(bf16_to_float(xb[i]) * inv);
  }
}

void dequantize_fp8_row(const uint8_t* q, const float* scales, int64_t hidden, float* out) {
  for (int64_t h = 0; h < hidden; ++h) out[h] = e4m3_to_float(q[h]) * scales[h / kFp8Block];
}

float quantize_nvfp4_row(const uint16_t* x, int64_t hidden, float global_scale, uint8_t* q, uint8_t* scales) {
  const float g = global_scale > 0.0f ? global_scale : nvfp4_token_global_scale(finite_amax(x, hidden));
  for (int64_t b = 0; b < hidden / kNvfp4Block; ++b) {
    const uint16_t* xb = x + b * kNvfp4Block;
    const uint8_t s = nvfp4_block_scale(block_amax(xb, kNvfp4Block), g);
    const float f = nvfp4_encode_factor(s, g);
    scales[b] = s;
    for (int i = 0; i < kNvfp4Block; i += 2) {
      const uint8_t lo = float_to_e2m1(bf16_to_float(xb[i]) * f);
      const uint8_t hi = float_to_e2m1(bf16_to_float(xb[i + 1]) * f);
      q[(b * kNvfp4Block + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  return 1.0f / g;
}

void dequantize_nvfp4_row(const uint8_t* q, const uint8_t* scales, float inv_global, int64_t hidden, float* out) {
  for (int64_t h = 0; h < hidden; ++h) {
    const uint8_t code = (q[h / 2] >> ((h & 1) * 4)) & 0xf;
    out[h] = e2m1_to_float(code) * e4m3_to_float(scales[h / kNvfp4Block]) * inv_global;
  }
}

}  // namespace epx
