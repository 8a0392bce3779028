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

// Reads only: what `blocks` SMs can pull from HBM, the bound of a sum that reads many rows and
// writes one (combine's expert-major partials). Every thread keeps kReadsInFlight 16-byte loads in
// flight and folds them into one word it stores at the end, so no load is optimized away.
constexpr int kReadsInFlight = 8;

__global__ void __launch_bounds__(kThreads) read_kernel(const int4* __restrict__ src, size_t n, int* __restrict__ sink) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
  int fold = 0;
  for (; i + (kReadsInFlight - 1) * stride < n; i += kReadsInFlight * stride) {
    int4 v[kReadsInFlight];
#pragma unroll
    for (int k = 0; k < kReadsInFlight; ++k) v[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < kReadsInFlight; ++k) fold ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n; i += stride) fold ^= src[i].x;
  sink[static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x] = fold;
}

// Writes only (the bound of a receiver that writes each row it reads to several expert rows):
// stores need no round trip, so one 16-byte store per thread and step keeps the SM busy.
__global__ void __launch_bounds__(kThreads) write_kernel(int4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  const int4 v{static_cast<int>(threadIdx.x), 1, 2, 3};
  for (size_t i = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) dst[i] = v;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("local copy: ") + what + ": " + cudaGetErrorString(e));
}

// A stream and two events on GPU 0; time(fn) gives fn's enqueued work's time per iteration (us).
class Timer {
 public:
  Timer(int warmup, int iters) : warmup_(warmup), iters_(iters) {
    check(cudaSetDevice(0), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&start_), "cudaEventCreate");
    check(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~Timer() {
    cudaStreamDestroy(stream_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  cudaStream_t stream() const { return stream_; }
  template <typename Fn>
  std::vector<double> time(Fn&& fn) {
    std::vector<double> times;
    for (int i = 0; i < warmup_ + iters_; ++i) {
      check(cudaEventRecord(start_, stream_), "cudaEventRecord");
      fn();
      check(cudaEventRecord(stop_, stream_), "cudaEventRecord");
      check(cudaEventSynchronize(stop_), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
      if (i >= warmup_) times.push_back(1000.0 * ms);
    }
    return times;
  }

 private:
  int warmup_, iters_;
  cudaStream_t stream_;
  cudaEvent_t start_, stop_;
};

// Device memory freed on scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { check(cudaMalloc(&ptr, bytes), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr = nullptr;
};

// The time of launch(blocks) for each block count, in order.
template <typename Launch>
std::vector<LocalCopyTime> time_each(Timer& timer, const std::vector<int>& block_counts, Launch launch) {
  std::vector<LocalCopyTime> out;
  for (int blocks : block_counts) out.push_back({blocks, timer.time([&] { launch(blocks); })});
  return out;
}

}  // namespace

std::vector<LocalCopyTime> time_local_copies(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters) {
  bytes = bytes / sizeof(int4) * sizeof(int4);
  Timer timer(warmup, iters);
  DeviceBuffer src(bytes), dst(bytes);
  check(cudaMemset(src.ptr, 0x3c, bytes), "cudaMemset");
  const auto* from = static_cast<const int4*>(src.ptr);
  auto* to = static_cast<int4*>(dst.ptr);
  std::vector<LocalCopyTime> out = time_each(timer, block_counts, [&](int blocks) {
    copy_kernel<<<blocks, kThreads, 0, timer.stream()>>>(from, to, bytes / sizeof(int4));
    check(cudaGetLastError(), "copy kernel launch");
  });
  out.push_back({0, timer.time([&] {
                   check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, timer.stream()), "cudaMemcpyAsync");
                 })});
  return out;
}

std::vector<LocalCopyTime> time_local_writes(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters) {
  bytes = bytes / sizeof(int4) * sizeof(int4);
  Timer timer(warmup, iters);
  DeviceBuffer dst(bytes);
  return time_each(timer, block_counts, [&](int blocks) {
    write_kernel<<<blocks, kThreads, 0, timer.stream()>>>(static_cast<int4*>(dst.ptr), bytes / sizeof(int4));
    check(cudaGetLastError(), "write kernel launch");
  });
}

std::vector<LocalCopyTime> time_local_reads(size_t bytes, const std::vector<int>& block_counts, int warmup, int iters) {
  bytes = bytes / sizeof(int4) * sizeof(int4);
  Timer timer(warmup, iters);
  int most_blocks = 1;
  for (int blocks : block_counts) most_blocks = std::max(most_blocks, blocks);
  DeviceBuffer src(bytes), sink(static_cast<size_t>(most_blocks) * kThreads * sizeof(int));
  check(cudaMemset(src.ptr, 0x3c, bytes), "cudaMemset");
  return time_each(timer, block_counts, [&](int blocks) {
    read_kernel<<<blocks, kThreads, 0, timer.stream()>>>(static_cast<const int4*>(src.ptr), bytes / sizeof(int4),
                                                         static_cast<int*>(sink.ptr));
    check(cudaGetLastError(), "read kernel launch");
  });
}

}  // namespace epx::bench
