// The device's NVFP4 encoder (row_copy.cuh: the magnitudes' max, the hardware e4m3 conversions,
// e2m1_code) against the codec's host rules, bit for bit: e2m1_code on every float that is not
// NaN, the e4m3 conversions on every non-negative float and every code, and whole rows (random
// bit patterns with NaNs and infinities, ordinary values, blocks of zeros) with the per-token
// scale and given scales up to 1e38 (an infinite block factor), aligned and not, whole and in
// the partial form low-latency dispatch uses.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/kernels/row_copy.cuh"

namespace {

using epx::detail::e2m1_code;
using epx::detail::e4m3_code;
using epx::detail::e4m3_value;

// Mismatches over bit patterns [first, first + count) of floats, counted on the device.
__global__ void scalar_rules_kernel(uint64_t first, uint64_t count, unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t bits = static_cast<uint32_t>(first + i);
    const float f = __uint_as_float(bits);
    if (!isnan(f) && e2m1_code(f) != epx::float_to_e2m1(f)) ++bad;
    if (!(bits >> 31) && !isnan(f) && e4m3_code(f) != epx::float_to_e4m3(f)) ++bad;
    if (bits < 256 && bits != 0x7fu && bits != 0xffu &&
        __float_as_uint(e4m3_value(static_cast<uint8_t>(bits & 0x7fu))) !=
            __float_as_uint(epx::e4m3_to_float(static_cast<uint8_t>(bits & 0x7fu))))
      ++bad;
  }
  if (bad) atomicAdd(wrong, bad);
}

// One warp a row: row r's wire row (codes, scales, 1/g), whole or as two parts [0, cut) and
// [cut, H) by two calls, as low-latency dispatch's spans are.
__global__ void encode_kernel(const uint16_t* x, int64_t x_stride, int64_t hidden, float given, int64_t cut,
                              char* out, int64_t out_stride, int rows) {
  const int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (r >= rows) return;
  char* dst = out + r * out_stride;
  const uint16_t* row = x + r * x_stride;
  if (cut <= 0) {
    epx::detail::quantize_nvfp4_row(row, hidden, given, &dst, 1, lane);
  } else {
    epx::detail::quantize_nvfp4_row(row, hidden, given, &dst, 1, lane, 0, cut);
    epx::detail::quantize_nvfp4_row(row, hidden, given, &dst, 1, lane, cut, hidden);
  }
}

// The GPUs this process sees (cuda_harness.hpp's gpu_count, which is C++20 and so not for a .cu).
int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

}  // namespace

TEST(CudaNvfp4Encode, ScalarRulesEqualTheCodecOnEveryFloat) {
  if (gpu_count() == 0) GTEST_SKIP() << "needs a GPU";
  unsigned long long* wrong = nullptr;
  ASSERT_EQ(cudaMalloc(&wrong, sizeof(*wrong)), cudaSuccess);
  ASSERT_EQ(cudaMemset(wrong, 0, sizeof(*wrong)), cudaSuccess);
  constexpr uint64_t kPart = 1ull << 30;
  for (uint64_t first = 0; first < (1ull << 32); first += kPart) scalar_rules_kernel<<<1024, 256>>>(first, kPart, wrong);
  unsigned long long got = 1;
  ASSERT_EQ(cudaMemcpy(&got, wrong, sizeof(got), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(wrong);
  EXPECT_EQ(got, 0u);
}

TEST(CudaNvfp4Encode, RowsEqualTheHostQuantizerBitForBit) {
  if (gpu_count() == 0) GTEST_SKIP() << "needs a GPU";
  constexpr int64_t kHidden = 2560, kRows = 96;
  constexpr int64_t kWire = kHidden / 2 + kHidden / epx::kNvfp4Block + 4;
  std::mt19937 rng(25);
  // One spare value a row, so that rows starting at value 1 are not 16-byte aligned.
  std::vector<uint16_t> x(static_cast<size_t>(kRows * (kHidden + 8)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t h = 0; h < kHidden + 8; ++h) {
      uint16_t& v = x[r * (kHidden + 8) + h];
      switch (r % 4) {
        case 0: v = static_cast<uint16_t>(rng()); break;  // every bit pattern: NaNs, infinities, subnormals
        case 1: v = epx::float_to_bf16(normal(rng)); break;
        case 2: v = h / 16 % 3 == 0 ? 0 : epx::float_to_bf16(normal(rng) * 1e-30f); break;  // blocks of zeros, tiny values
        default: v = h / 16 % 2 == 0 ? (h % 16 == 0 ? 0x0001 : 0x8000) : epx::float_to_bf16(normal(rng) * 1e4f); break;
      }
    }
  uint16_t* dx = nullptr;
  char* dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, kRows * kWire), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  int wrong = 0;
  for (float given : {0.0f, 300.0f, 1e-30f, 1e36f, 1e38f})
    for (int offset : {0, 1})
      for (int64_t cut : {int64_t{0}, int64_t{1024}}) {
        ASSERT_EQ(cudaMemset(dout, 0xa5, kRows * kWire), cudaSuccess);
        encode_kernel<<<kRows / 4, 128>>>(dx + offset, kHidden + 8, kHidden, given, cut, dout, kWire, kRows);
        std::vector<uint8_t> got(static_cast<size_t>(kRows * kWire));
        ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        for (int64_t r = 0; r < kRows && wrong < 10; ++r) {
          std::vector<uint8_t> want(kWire);
          const float inv = epx::quantize_nvfp4_row(x.data() + r * (kHidden + 8) + offset, kHidden, given, want.data(),
                                                    want.data() + kHidden / 2);
          std::memcpy(want.data() + kHidden / 2 + kHidden / epx::kNvfp4Block, &inv, 4);
          for (int64_t i = 0; i < kWire; ++i)
            if (got[r * kWire + i] != want[i]) {
              ADD_FAILURE() << "given scale " << given << ", offset " << offset << ", cut " << cut << ", row " << r
                            << ", byte " << i << ": got 0x" << std::hex << int{got[r * kWire + i]} << ", want 0x"
                            << int{want[i]};
              ++wrong;
              break;
            }
        }
      }
  cudaFree(dx);
  cudaFree(dout);
}
