// Kernel time from CUPTI's activity records: how long each kernel ran on the device, without the
// gaps between launches. DeepEP's benchmark reports its low-latency kernels this way (PyTorch's
// profiler, kineto, reads the same records), and the speed issue's low-latency targets are kernel
// times, so epx-bench reports it beside the graph replays' time (docs/benchmarks.md). Built where
// CMake finds CUPTI (EPX_HAS_CUPTI); elsewhere available() is false and nothing is recorded.
#pragma once
#include <cstdint>
#include <vector>

namespace epx::bench {

// Records every kernel the process runs between begin() and end(); one recording at a time.
class KernelRecording {
 public:
  static bool available();
  KernelRecording();  // begins
  ~KernelRecording();
  KernelRecording(const KernelRecording&) = delete;
  KernelRecording& operator=(const KernelRecording&) = delete;
  // Ends the recording (waits for CUPTI's buffers) and returns, for each (device, stream) that ran
  // kernels, their durations in us in the order they started.
  std::vector<std::vector<double>> durations_by_stream();
};

// The median over `replays` of the per-call kernel time, each replay's `calls` kernels per stream
// summed and divided by `calls`, the slowest of `streams` streams (ranks) taken, as the replays'
// times are. 0 when the recording does not hold exactly that many kernels on that many streams.
double per_call_median_us(const std::vector<std::vector<double>>& by_stream, int streams, int replays, int calls);

}  // namespace epx::bench
