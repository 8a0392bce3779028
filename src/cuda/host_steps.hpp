// The host's time between the steps of the current call, for timeout messages: when a rank's
// wait runs out, the message also says how long this rank's host took to reach each step, so a
// host held up before it posted its plan (by a call that waited for the device, say) shows
// where its peers' waits ran out (docs/cuda.md, "Known gaps").
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
  // "call begun +0.01 ms, handle allocated +0.12 ms, ...": each step's time since the one before.
  std::string summary() const {
    std::string out;
    auto last = start_;
    for (int i = 0; i < count_; ++i) {
      const double ms = std::chrono::duration<double, std::milli>(steps_[i].at - last).count();
      char text[96];
      std::snprintf(text, sizeof text, "%s%s +%.2f ms", i ? ", " : "", steps_[i].name, ms);
      out += text;
      last = steps_[i].at;
    }
    return out;
  }

 private:
  static constexpr int kMaxSteps = 12;
  struct Step {
    const char* name;
    std::chrono::steady_clock::time_point at;
  };
  Step steps_[kMaxSteps] = {};
  int count_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace epx::detail
