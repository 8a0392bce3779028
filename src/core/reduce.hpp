// The floating-point reductions whose order the spec fixes (docs/semantics.md, "Sums"),
// written once for the CPU backend. Device code reproduces the same order.
#pragma once
#include <cstdint>

namespace epx::detail {

// acc[h] = fma(w, y[h], acc[h])  (single rounding, as CUDA's __fmaf_rn)
void fma_row(float* acc, float w, const uint16_t* y_bf16, int64_t hidden);
// acc[h] += y[h]
void add_row(float* acc, const uint16_t* y_bf16, int64_t hidden);
// out[h] = bf16(acc[h]), round to nearest even
void round_row(uint16_t* out_bf16, const float* acc, int64_t hidden);
// out[h] = bf16(w * y[h])
void scale_row(uint16_t* out_bf16, float w, const uint16_t* y_bf16, int64_t hidden);

// Dot product of two bf16 rows in fp32: 32 lanes, lane l accumulates with fma the channels h
// with (h / 8) % 32 == l in increasing h; then lanes are summed as a butterfly
// (p[l] += p[l ^ o] for o = 16, 8, 4, 2, 1) and lane 0 is the result.
float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t hidden);

}  // namespace epx::detail
