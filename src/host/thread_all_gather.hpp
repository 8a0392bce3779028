// An all-gather of short records between the threads of one process (the ranks of a host group
// or of the shared-GPU transport), with a timeout: the k-th call of every rank meets the k-th
// call of the others.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace epx::detail {

class ThreadAllGather {
 public:
  explicit ThreadAllGather(int ranks) : ranks_(ranks), calls_(ranks, 0) {}

  // Every rank's record, in rank order. Throws Error(timeout) naming `what` and the ranks that
  // did not arrive within `timeout`; a rank that arrives at a round another rank gave up on throws
  // Error(peer_failed), so no rank goes on with a creation its peers abandoned.
  std::vector<std::string> gather(int rank, std::string record, std::chrono::milliseconds timeout, std::string_view what);

 private:
  struct Round {
    std::vector<std::string> records;
    std::vector<bool> arrived;
    int count = 0;  // ranks arrived
    int taken = 0;  // ranks that have read the records or given up (the last one frees the round)
    std::string abandoned;  // why a rank gave up on this round (its timeout): late ranks fail too
  };
  const int ranks_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<int64_t> calls_;     // per rank: its calls so far
  std::map<int64_t, Round> rounds_;  // by call number, until every rank has read it
};

}  // namespace epx::detail
