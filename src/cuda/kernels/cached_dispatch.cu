// A cached dispatch's own kernels (CudaBackend::cached_dispatch): the check_finite scan, the
// wire rows of a quantized wire written into staging rows before combine_backward's transfer
// moves them, and the expanded rows split into recv_x / recv_scales / recv_global_scale after.
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/finite_scan.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/row_copy.cuh"
#include "cuda/kernels/wire_encode.cuh"

namespace epx::detail::kernels {

namespace {

constexpr int kWarps = 8;

__global__ void scan_x_finite_kernel(FiniteCheck check, int64_t tokens, int32_t rank, DeviceStatus* st) {
  scan_finite_all(check, tokens, blockIdx.x, gridDim.x, rank, st);
}

// Warp per token: its wire row at the start of its staging row.
__global__ void __launch_bounds__(kWarps * 32) encode_to_rows_kernel(SendRows rows, int64_t tokens, int64_t hidden,
                                                                    char* staging, int64_t stride) {
  const int lane = threadIdx.x % 32;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    char* dst = staging + t * stride;
    encode_wire_row(rows, t, hidden, &dst, 1, lane);
  }
}

// Warp per row: the wire row's codes, scales and 1/g into their arrays (a zero row, zeros).
__global__ void __launch_bounds__(kWarps * 32) split_wire_rows_kernel(const char* from, int64_t stride, int64_t rows,
                                                                     WireSplit to) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kWarps) {
    const char* row = from + r * stride;
    if (to.scale_bytes > 0) {
      copy_row_split(row, to.x + r * to.x_bytes, to.x_bytes, to.scales + r * to.scale_bytes, to.scale_bytes, lane);
    } else {
      char* x = to.x + r * to.x_bytes;
      copy_row(row, &x, 1, to.x_bytes, lane);
    }
    if (to.global_bytes > 0 && lane == 0)
      reinterpret_cast<float*>(to.global)[r] = *reinterpret_cast<const float*>(row + to.x_bytes + to.scale_bytes);
  }
}

int warp_blocks(const Ctx& ctx, int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ctx.blocks, (rows + kWarps - 1) / kWarps)));
}

}  // namespace

void scan_x_finite(const Ctx& ctx, const FiniteCheck& check, int64_t tokens) {
  if (tokens == 0 || check.parts == 0) return;
  scan_x_finite_kernel<<<ctx.blocks, 256, 0, ctx.stream>>>(check, tokens, ctx.shape.rank, ctx.status);
}

void encode_to_rows(const Ctx& ctx, const SendRows& rows, int64_t tokens, char* staging, int64_t stride) {
  if (tokens == 0) return;
  encode_to_rows_kernel<<<warp_blocks(ctx, tokens), kWarps * 32, 0, ctx.stream>>>(rows, tokens, ctx.shape.hidden,
                                                                                 staging, stride);
}

void split_wire_rows(const Ctx& ctx, const char* from, int64_t stride, int64_t rows, const WireSplit& to) {
  if (rows == 0) return;
  split_wire_rows_kernel<<<warp_blocks(ctx, rows), kWarps * 32, 0, ctx.stream>>>(from, stride, rows, to);
}

void preload_cached_dispatch_kernels() { preload(scan_x_finite_kernel, encode_to_rows_kernel, split_wire_rows_kernel); }

}  // namespace epx::detail::kernels
