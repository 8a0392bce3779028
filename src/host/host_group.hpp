// Shared state of a host group: ranks are threads of one process. Each Buffer's ranks share a
// SharedBuffer: a barrier and every rank's receive memory, which peers write into directly.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "host/peer_barrier.hpp"
#include "host/thread_all_gather.hpp"

namespace epx::detail {

// What a rank publishes at the start of every collective operation.
struct Mailbox {
  std::string op;         // "dispatch #3": the call, numbered per buffer
  std::string signature;  // options that must agree across ranks
  std::string error;      // this rank's input error, empty when its input is fine
  int64_t tokens = 0;
  std::vector<int64_t> expert_counts;  // dispatch: this rank's (token, expert) pairs per expert
};

// One rank's receive memory, written by its peers. Sized once from the buffer config.
struct RankArea {
  // Forward direction (source -> expert rank), rows [source rank][position].
  std::vector<uint8_t> fwd_payload;      // row_bytes each
  std::vector<int32_t> fwd_token;        // source token index
  std::vector<int32_t> fwd_slot_expert;  // [K] local expert of each source slot, -1 if not here
  std::vector<float> fwd_slot_weight;    // [K]
  std::vector<int64_t> fwd_rows;         // [R] rows each source wrote
  // Reverse direction (expert rank -> source), rows [expert rank][position].
  std::vector<uint8_t> rev_rows;         // 2H bytes each: a partial sum in its combine wire form (<= 2H)
  std::vector<float> rev_slot_value;     // [K] per-slot scalars (gradients of the weights)
  // Double-buffered by call parity, so a fast rank's next call never overwrites a mailbox
  // that a slower rank is still reading.
  Mailbox mailbox[2];
};

struct SharedBuffer {
  explicit SharedBuffer(int ranks) : barrier(ranks), areas(ranks) {}
  PeerBarrier barrier;
  std::vector<RankArea> areas;
};

struct HostGroupState final : GroupState {
  explicit HostGroupState(int ranks) : ranks(ranks), gather_(ranks), buffers_created_(ranks, 0) {}

  std::vector<std::string> all_gather(int rank, const std::string& record, std::chrono::milliseconds timeout,
                                      std::string_view what) override {
    return gather_.gather(rank, record, timeout, what);
  }

  // The shared state of this rank's next buffer of any kind: the n-th buffer of every rank
  // shares one, made by `make` on first use. A rank creating another kind of buffer than its
  // peers at the same position gets config_mismatch.
  template <typename T>
  std::shared_ptr<T> join_next(int rank, const char* kind) {
    return std::static_pointer_cast<T>(join_next_any(rank, kind, [this] { return std::make_shared<T>(ranks); }));
  }

  const int ranks;

 private:
  struct Pending {
    int joined = 0;
    std::string kind;
    std::shared_ptr<void> shared;
  };
  std::shared_ptr<void> join_next_any(int rank, const char* kind, const std::function<std::shared_ptr<void>()>& make);

  ThreadAllGather gather_;
  std::mutex mutex_;
  std::vector<int64_t> buffers_created_;  // per rank
  std::map<int64_t, Pending> pending_;    // by creation index
};

}  // namespace epx::detail
