#include "host/peer_barrier.hpp"

#include "core/check.hpp"

namespace epx::detail {

void PeerBarrier::arrive_and_wait(int rank, std::chrono::milliseconds timeout, std::string_view what) {
  std::unique_lock lock(mutex_);
  if (!broken_.empty())
    fail(ErrorCode::peer_failed, what, " (rank ", rank, "): the group already failed: ", broken_);
  arrived_[rank] = true;
  if (++count_ == static_cast<int>(arrived_.size())) {
    count_ = 0;
    arrived_.assign(arrived_.size(), false);
    ++generation_;
    cv_.notify_all();
    return;
  }
  const long my_generation = generation_;
  const bool done = cv_.wait_for(lock, timeout, [&] { return generation_ != my_generation || !broken_.empty(); });
  if (generation_ != my_generation) return;
  if (!done) {
    std::string missing;
    for (size_t r = 0; r < arrived_.size(); ++r)
      if (!arrived_[r]) missing += cat(missing.empty() ? "" : ", ", r);
    broken_ = cat(what, ": rank ", rank, " waited ", timeout.count(), " ms for rank(s) ", missing,
                  ", which never arrived (crashed, hung, or called collective operations in a different order)");
    cv_.notify_all();
    fail(ErrorCode::timeout, broken_);
  }
  fail(ErrorCode::peer_failed, what, " (rank ", rank, "): the group failed while waiting: ", broken_);
}

void PeerBarrier::abort(const std::string& reason) {
  std::lock_guard lock(mutex_);
  if (broken_.empty()) broken_ = reason;
  cv_.notify_all();
}

}  // namespace epx::detail
