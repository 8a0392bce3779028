// Every epx kernel's stack frame fits the device's default local-memory reservation, so no first
// launch grows it (which waits for every running kernel: src/cuda/kernels/kernel_frames.hpp).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda/kernels/kernel_frames.hpp"
#include "cuda/kernels/launch.hpp"

namespace {

TEST(CudaKernels, EveryStackFrameFitsTheDefaultLocalMemoryReservation) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  epx::detail::kernels::preload_kernels();  // every kernel of both modes
  size_t limit = 0;
  ASSERT_EQ(cudaDeviceGetLimit(&limit, cudaLimitStackSize), cudaSuccess);
  const size_t largest = epx::detail::largest_kernel_frame();
  EXPECT_GT(largest, 0u);  // measured: the high-throughput transfer kernel has a frame
  EXPECT_LE(largest, limit) << "a kernel's first launch would grow the local-memory reservation and wait for the "
                               "running kernels (a shared-GPU peer's waiting one): shrink its frame";
}

}  // namespace
