// epx's process-wide stream pool (src/cuda/stream_pool.hpp): a stream given back is the next one
// taken, and one in use is never handed out twice.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda/stream_pool.hpp"

namespace {

TEST(CudaStreamPool, AGivenBackStreamIsTakenAgainAndOneInUseIsNot) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t first = epx::detail::take_stream(0);
  ASSERT_NE(first, nullptr);
  epx::detail::give_back_stream(0, first);
  cudaStream_t again = epx::detail::take_stream(0);
  EXPECT_EQ(again, first);
  cudaStream_t other = epx::detail::take_stream(0);
  EXPECT_NE(other, again);
  EXPECT_EQ(cudaStreamSynchronize(other), cudaSuccess);
  epx::detail::give_back_stream(0, other);
  epx::detail::give_back_stream(0, again);
}

}  // namespace
