// A barrier for the ranks of a host group that never waits forever: a rank that does not
// arrive in time breaks it, and every rank then gets an error instead of a hang.
#pragma once
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace epx::detail {

class PeerBarrier {
 public:
  explicit PeerBarrier(int ranks) : arrived_(ranks, false) {}

  // Waits until every rank has arrived. Throws Error(timeout) naming the missing ranks
  // after `timeout`; once broken (timeout or abort) every call throws Error(peer_failed).
  // `what` says where we are, e.g. "dispatch #3 (exchange)".
  void arrive_and_wait(int rank, std::chrono::milliseconds timeout, std::string_view what);

  // Breaks the barrier: waiting and later ranks fail with `reason`.
  void abort(const std::string& reason);

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<bool> arrived_;
  int count_ = 0;
  long generation_ = 0;
  std::string broken_;  // why the barrier is unusable; empty while healthy
};

}  // namespace epx::detail
