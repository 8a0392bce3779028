// The host's time between the steps of the current call, for timeout messages: when a rank's
// wait runs out, the message also says how long this rank's host took to reach each step, so a
// host held up before it posted its plan (by a call that waited for the device, say) shows
// where its peers' waits ran out (docs/cuda.md, "Known gaps"). With EPX_PROFILE, dispatch reports
// the mean time of each step.
#pragma once
#include <chrono>
#include <cstdio>
#include <string>

namespace epx::detail {

class HostSteps {
 public:
  void begin() {
    count_ = 0;
    start_ = std::chrono::steady_clock::now();
  }
  void mark(const char* step) {
    if (count_ < kMaxSteps) steps_[count_++] = {step, std::chrono::steady_clock::now()};
  }
  // fn(step name, time since the step before (or the call's start), in microseconds), step by step.
  template <class Fn>
  void for_each(Fn&& fn) const {
    auto last = start_;
    for (int i = 0; i < count_; ++i) {
      fn(steps_[i].name, std::chrono::duration<double, std::micro>(steps_[i].at - last).count());
      last = steps_[i].at;
    }
  }
  // "call begun +0.01 ms, handle allocated +0.12 ms, ...": each step's time since the one before.
  std::string summary() const {
    std::string out;
    for_each([&](const char* step, double us) {
      char text[96];
      std::snprintf(text, sizeof text, "%s%s +%.2f ms", out.empty() ? "" : ", ", step, us / 1000.0);
      out += text;
    });
    return out;
  }

 private:
  static constexpr int kMaxSteps = 24;
  struct Step {
    const char* name;
    std::chrono::steady_clock::time_point at;
  };
  Step steps_[kMaxSteps] = {};
  int count_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace epx::detail
