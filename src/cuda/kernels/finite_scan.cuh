// check_finite (BufferConfig, LowLatencyConfig): a block's share of an input array scanned for a
// NaN or an infinity, reported as kStatusNonFinite. Only launched or run when the option is set.
#pragma once
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"

namespace epx::detail {

// Element `bits` (elem_bytes wide) is a NaN or an infinity: its exponent bits all set (e4m3 has no
// infinity; its NaN is S.1111.111).
__device__ inline bool elem_nonfinite(uint32_t bits, int elem_bytes) {
  const uint32_t mask = elem_bytes == 1 ? 0x7fu : elem_bytes == 2 ? 0x7f80u : 0x7f800000u;
  return (bits & mask) == mask;
}

// The element's value as fp32 bits, for the message.
__device__ inline uint32_t elem_value_bits(uint32_t bits, int elem_bytes) {
  if (elem_bytes == 1) return float_bits(e4m3_to_float(static_cast<uint8_t>(bits)));
  if (elem_bytes == 2) return bits << 16;
  return bits;
}

// Rows first_row, first_row + row_step, ... (< rows) of f, by the block's threads: 16 bytes per
// load where the rows allow it, else one element. The first non-finite value a thread sees is
// reported (the first report of the call wins).
__device__ inline void scan_finite(const kernels::FiniteScan& f, int64_t rows, int64_t first_row, int64_t row_step,
                                   int32_t rank, DeviceStatus* st) {
  const int eb = f.elem_bytes;
  const int64_t row_bytes = f.cols * eb;
  const bool wide = (reinterpret_cast<uintptr_t>(f.data) & 15u) == 0 && f.stride_bytes % 16 == 0 && row_bytes % 16 == 0;
  const int64_t unit = wide ? 16 : eb, units = row_bytes / unit;
  const uint32_t elem_mask = eb == 4 ? 0xffffffffu : (1u << (8 * eb)) - 1u;
  for (int64_t t = first_row; t < rows; t += row_step) {
    const char* row = f.data + t * f.stride_bytes;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      uint32_t w[4] = {0, 0, 0, 0};
      if (wide) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(row) + u);
        w[0] = static_cast<uint32_t>(v.x), w[1] = static_cast<uint32_t>(v.y), w[2] = static_cast<uint32_t>(v.z),
        w[3] = static_cast<uint32_t>(v.w);
      } else {
        const char* p = row + u * eb;
        w[0] = eb == 1 ? *reinterpret_cast<const uint8_t*>(p)
               : eb == 2 ? *reinterpret_cast<const uint16_t*>(p)
                         : *reinterpret_cast<const uint32_t*>(p);
      }
      const int words = wide ? 4 : 1, per_word = wide ? 4 / eb : 1;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k >= words) break;
        for (int j = 0; j < per_word; ++j) {
          const uint32_t bits = (w[k] >> (8 * eb * j)) & elem_mask;
          if (!elem_nonfinite(bits, eb)) continue;
          const int64_t col = (u * unit) / eb + k * (4 / eb) + j;
          report(st, kStatusNonFinite, rank, t, col,
                 (static_cast<int64_t>(f.tensor) << 32) | static_cast<int64_t>(elem_value_bits(bits, eb)));
          return;
        }
      }
    }
  }
}

// Every part of `check` (x, then x_scales), as scan_finite.
__device__ inline void scan_finite_all(const kernels::FiniteCheck& check, int64_t rows, int64_t first_row,
                                       int64_t row_step, int32_t rank, DeviceStatus* st) {
  for (int i = 0; i < check.parts; ++i) scan_finite(check.part[i], rows, first_row, row_step, rank, st);
}

}  // namespace epx::detail
