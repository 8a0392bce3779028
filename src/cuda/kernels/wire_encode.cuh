// Token t's wire row from the dispatch input, as both dispatch engines write it: bf16 copied,
// fp8 given pre-quantized copied with its scales, or quantized here (fp8, fp8_ue8m0, nvfp4).
#pragma once
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail::kernels {

// One warp: token t's wire row (codes, then scales, then 1/g) into each of dst[0..n), n <= kMaxRanks.
__device__ inline void encode_wire_row(const SendRows& rows, int64_t t, int64_t hidden, char* const* dst, int n,
                                       int lane) {
  const char* x = rows.x + t * rows.x_stride_bytes;
  if (rows.x_scales) {  // pre-quantized fp8: codes and scales as given
    char* scales[kMaxRanks];
    for (int i = 0; i < n; ++i) scales[i] = dst[i] + hidden;
    copy_row<true>(x, dst, n, hidden, lane);
    copy_row<true>(reinterpret_cast<const char*>(rows.x_scales + t * rows.scales_stride), scales, n,
                   4 * (hidden / kFp8Block), lane);
  } else if (rows.wire == WireFormat::bf16) {
    copy_row<true>(x, dst, n, 2 * hidden, lane);
  } else if (rows.wire == WireFormat::nvfp4) {
    quantize_nvfp4_row(reinterpret_cast<const uint16_t*>(x), hidden, rows.nvfp4_global_scale, dst, n, lane);
  } else {
    quantize_fp8_row(reinterpret_cast<const uint16_t*>(x), hidden, rows.wire == WireFormat::fp8_ue8m0, dst, n, lane);
  }
}

}  // namespace epx::detail::kernels
