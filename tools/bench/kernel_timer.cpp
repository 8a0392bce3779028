#include "bench/kernel_timer.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#ifdef EPX_HAS_CUPTI
#include <cupti.h>
#endif

namespace epx::bench {

#ifdef EPX_HAS_CUPTI
namespace {

struct Span {
  uint32_t device, stream;
  uint64_t start, end;
};

std::mutex spans_mutex;
std::vector<Span> spans;  // filled by CUPTI's buffer callback, on its own thread

constexpr size_t kBufferBytes = 8 << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(spans_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS)
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      spans.push_back({k->deviceId, k->streamId, k->start, k->end});
    }
  std::free(buffer);
}

void check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  throw std::runtime_error(std::string("epx-bench: CUPTI ") + what + " failed: " + (text ? text : "?"));
}

}  // namespace

bool KernelRecording::available() { return true; }

KernelRecording::KernelRecording() {
  {
    std::lock_guard<std::mutex> lock(spans_mutex);
    spans.clear();
  }
  static const bool registered = [] {
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    return true;
  }();
  (void)registered;
  // CONCURRENT_KERNEL, not KERNEL: the latter would serialize kernels, and ranks wait for each other's.
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
}

KernelRecording::~KernelRecording() { cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL); }

std::vector<std::vector<double>> KernelRecording::durations_by_stream() {
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(spans_mutex);
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.start < b.start; });
  std::map<std::pair<uint32_t, uint32_t>, std::vector<double>> by_stream;
  for (const Span& s : spans) by_stream[{s.device, s.stream}].push_back(1e-3 * static_cast<double>(s.end - s.start));
  std::vector<std::vector<double>> out;
  for (auto& [key, durations] : by_stream) out.push_back(std::move(durations));
  return out;
}
#else
bool KernelRecording::available() { return false; }
KernelRecording::KernelRecording() = default;
KernelRecording::~KernelRecording() = default;
std::vector<std::vector<double>> KernelRecording::durations_by_stream() { return {}; }
#endif

double per_call_median_us(const std::vector<std::vector<double>>& by_stream, int streams, int replays, int calls) {
  if (static_cast<int>(by_stream.size()) != streams || replays <= 0 || calls <= 0) return 0.0;
  std::vector<double> per_call(replays, 0.0);
  for (const std::vector<double>& durations : by_stream) {
    if (static_cast<int>(durations.size()) != replays * calls) return 0.0;
    for (int i = 0; i < replays; ++i) {
      double sum = 0.0;
      for (int c = 0; c < calls; ++c) sum += durations[i * calls + c];
      per_call[i] = std::max(per_call[i], sum / calls);
    }
  }
  std::sort(per_call.begin(), per_call.end());
  return replays % 2 ? per_call[replays / 2] : 0.5 * (per_call[replays / 2 - 1] + per_call[replays / 2]);
}

}  // namespace epx::bench
