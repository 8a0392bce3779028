// EPX_PROFILE=1 (or ll): CUDA events between the steps of each call, averaged per step and printed
// to stderr when the buffer goes, with the host's steps (steady clock). EPX_PROFILE=host: the host's
// steps only, without the events' own host cost (~2-5 us per record, and the reads at the end of
// a call). A measuring aid for docs/performance.md; off by default (core/env.hpp).
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "core/env.hpp"

namespace epx::detail {

class PhaseTimer {
 public:
  static constexpr int kMarks = 12;
  PhaseTimer() = default;
  // Turns the timer on as `profile` says (once, on the buffer's device).
  void start(Profile profile) {
    on_ = profile != Profile::off;
    events_ = on_ && profile != Profile::host;
    if (events_)
      for (cudaEvent_t& e : marks_) cudaEventCreate(&e);
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;
  ~PhaseTimer() {
    if (!on_) return;
    for (const auto& [name, total] : totals_)
      std::fprintf(stderr, "epx profile: %-28s %9.1f us (mean of %d)\n", name.c_str(), total.first / total.second,
                   total.second);
    if (events_)
      for (cudaEvent_t e : marks_) cudaEventDestroy(e);
  }
  bool on() const { return on_; }
  // Records mark i on stream s.
  void mark(int i, cudaStream_t s) {
    if (events_) cudaEventRecord(marks_[i], s);
  }
  // Host wall time between two points.
  void add_host(const std::string& name, std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    add_host_us(name, std::chrono::duration<double, std::micro>(b - a).count());
  }
  void add_host_us(const std::string& name, double us) {
    if (!on_) return;
    auto& t = totals_[name];
    t.first += us;
    t.second += 1;
  }
  // Adds the time from mark a to mark b to `name` (waits for mark b).
  void add(const std::string& name, int a, int b) {
    if (!events_) return;
    float ms = 0;
    cudaEventSynchronize(marks_[b]);
    if (cudaEventElapsedTime(&ms, marks_[a], marks_[b]) != cudaSuccess) return;
    auto& t = totals_[name];
    t.first += 1000.0 * ms;
    t.second += 1;
  }

 private:
  bool on_ = false;
  bool events_ = false;  // GPU marks too (EPX_PROFILE set, not "host")
  cudaEvent_t marks_[kMarks] = {};
  std::map<std::string, std::pair<double, int>> totals_;
};

}  // namespace epx::detail
