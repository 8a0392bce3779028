#include "host/thread_all_gather.hpp"

#include "core/check.hpp"

namespace epx::detail {

std::vector<std::string> ThreadAllGather::gather(int rank, std::string record, std::chrono::milliseconds timeout,
                                                 std::string_view what) {
  std::unique_lock lock(mutex_);
  const int64_t call = calls_[rank]++;
  Round& round = rounds_[call];
  if (round.arrived.empty()) {
    round.records.assign(ranks_, "");
    round.arrived.assign(ranks_, false);
  }
  round.records[rank] = std::move(record);
  round.arrived[rank] = true;
  if (++round.count == ranks_) cv_.notify_all();
  const bool done = cv_.wait_for(lock, timeout, [&] { return round.count == ranks_ || !round.abandoned.empty(); });
  if (!round.abandoned.empty()) {
    const std::string why = round.abandoned;
    if (++round.taken == ranks_) rounds_.erase(call);
    fail(ErrorCode::peer_failed, what, " (rank ", rank, "): another rank gave up on it: ", why);
  }
  if (!done) {
    std::string missing;
    for (int r = 0; r < ranks_; ++r)
      if (!round.arrived[r]) missing += cat(missing.empty() ? "" : ", ", r);
    round.abandoned = cat(what, ": rank ", rank, " waited ", timeout.count(), " ms for rank(s) ", missing,
                          ", which never arrived (crashed, hung, or made collective calls in a different order)");
    const std::string why = round.abandoned;
    cv_.notify_all();
    if (++round.taken == ranks_) rounds_.erase(call);
    fail(ErrorCode::timeout, why);
  }
  std::vector<std::string> records = round.records;
  if (++round.taken == ranks_) rounds_.erase(call);
  return records;
}

}  // namespace epx::detail
