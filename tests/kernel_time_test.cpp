// epx-bench's kernel time from CUPTI's records (tools/bench/kernel_timer.hpp): how the recorded
// kernel durations become one number per record.
#include <gtest/gtest.h>

#include "bench/kernel_timer.hpp"

namespace epx::bench {
namespace {

TEST(KernelTime, PerCallMedianTakesTheSlowestStreamOfEachReplay) {
  // Two ranks' streams, three replays of two calls each (us, in start order).
  const std::vector<std::vector<double>> by_stream = {{10, 12, 20, 20, 11, 11}, {14, 14, 9, 9, 30, 10}};
  // Per replay: max(11, 14) = 14, max(20, 9) = 20, max(11, 20) = 20; median 20.
  EXPECT_DOUBLE_EQ(per_call_median_us(by_stream, 2, 3, 2), 20.0);
  // Two replays of three calls: max(14, 12.333...) = 14, max(14, 16.333...) = 16.333...; median of two.
  EXPECT_NEAR(per_call_median_us(by_stream, 2, 2, 3), 0.5 * (14.0 + 49.0 / 3.0), 1e-12);
}

TEST(KernelTime, RecordsThatDoNotFitGiveNoNumber) {
  const std::vector<std::vector<double>> two = {{1, 2, 3, 4}, {1, 2, 3, 4}};
  EXPECT_EQ(per_call_median_us(two, 3, 2, 2), 0.0);  // a rank's stream ran no kernel
  EXPECT_EQ(per_call_median_us(two, 2, 3, 2), 0.0);  // fewer kernels than replays x calls
  EXPECT_EQ(per_call_median_us({{1, 2, 3}, {1, 2, 3, 4}}, 2, 2, 2), 0.0);
  EXPECT_EQ(per_call_median_us({}, 0, 0, 2), 0.0);
}

TEST(KernelTime, WithoutCuptiNothingIsRecorded) {
  if (KernelRecording::available()) GTEST_SKIP() << "this build has CUPTI";
  KernelRecording recording;
  EXPECT_TRUE(recording.durations_by_stream().empty());
}

}  // namespace
}  // namespace epx::bench
