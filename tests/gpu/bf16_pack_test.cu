// The device's bf16 rounding of sums (pack_bf16x8: one hardware conversion per pair, the software
// rounding for a pair whose sum is NaN) against the CPU reference's float_to_bf16, bit for bit:
// random bit patterns (NaNs with payloads, infinities, subnormals, both signs) and the edge cases.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/kernels/row_copy.cuh"

namespace {

__global__ void pack_kernel(const float* in, int4* out, int vectors) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= vectors) return;
  float acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = in[8 * i + c];
  out[i] = epx::detail::pack_bf16x8(acc);
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST(CudaBf16Pack, EqualsTheSoftwareRoundingBitForBit) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) GTEST_SKIP() << "needs a GPU";
  std::vector<float> v;
  const float inf = std::numeric_limits<float>::infinity();
  const uint32_t edges[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u,
                            0x3f80ffffu, 0x7f7fffffu, 0xff7f8000u, 0x7f800001u, 0xffc12345u, 0x7fffffffu};
  for (uint32_t e : edges) v.push_back(from_bits(e));
  for (float a : {inf, -inf, 1.0f})  // infinities that cancel in a pair's sum, and ones that do not
    for (float b : {inf, -inf, 2.0f}) v.insert(v.end(), {a, b});
  std::mt19937 rng(7);
  while (v.size() % 8 != 0 || v.size() < (1u << 20)) v.push_back(from_bits(static_cast<uint32_t>(rng())));
  const int vectors = static_cast<int>(v.size() / 8);
  float* in = nullptr;
  int4* out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, v.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, v.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  pack_kernel<<<(vectors + 255) / 256, 256>>>(in, out, vectors);
  std::vector<uint16_t> got(v.size());
  ASSERT_EQ(cudaMemcpy(got.data(), out, v.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(in);
  cudaFree(out);
  int wrong = 0;
  for (size_t i = 0; i < v.size() && wrong < 10; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &v[i], 4);
    if (got[i] != epx::float_to_bf16(v[i])) {
      ADD_FAILURE() << "value " << i << " (bits 0x" << std::hex << bits << "): got 0x" << got[i] << ", want 0x"
                    << epx::float_to_bf16(v[i]);
      ++wrong;
    }
  }
}
