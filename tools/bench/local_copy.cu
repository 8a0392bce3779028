// What one GPU's SMs and copy engines give to a plain local copy, measured in the same run as
// epx: the receiver of a dispatch and the reducers of a combine move rows within one GPU with the
// SM budget, so this says how far their rates are from what `blocks` SMs can copy at all.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/local_copy.hpp"

namespace epx::bench {

namespace {

constexpr int kThreads = 1024;
constexpr int kInFlight = 4;  // 16-byte loads per thread issued before the stores

__global__ void __launch_bounds__(kThreads) copy_kernel(const int4* __restrict__ src, int4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kInFlight - 1) * stride < n; i += kInFlight * stride) {
    int4 v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) dst[i + k * stride] = v[k];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("local copy: ") + what + ": " + cudaGetErrorString(e));
}

}  // namespace

std::vector<LocalCopyTime> time_local_copies(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters) {
  bytes = bytes / sizeof(int4) * sizeof(int4);
  check(cudaSetDevice(0), "cudaSetDevice");
  void *src = nullptr, *dst = nullptr;
  cudaStream_t stream;
  cudaEvent_t start, stop;
  check(cudaMalloc(&src, bytes), "cudaMalloc");
  check(cudaMalloc(&dst, bytes), "cudaMalloc");
  check(cudaMemset(src, 0x3c, bytes), "cudaMemset");
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  auto timed = [&](auto&& copy) {
    std::vector<double> times;
    for (int i = 0; i < warmup + iters; ++i) {
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      copy();
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      if (i >= warmup) times.push_back(1000.0 * ms);
    }
    return times;
  };
  std::vector<LocalCopyTime> out;
  for (int blocks : block_counts)
    out.push_back({blocks, timed([&] {
                     copy_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const int4*>(src), static_cast<int4*>(dst),
                                                                bytes / sizeof(int4));
                     check(cudaGetLastError(), "copy kernel launch");
                   })});
  out.push_back({0, timed([&] { check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync"); })});
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(stream);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return out;
}

}  // namespace epx::bench
