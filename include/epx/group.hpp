// Group: the ranks that exchange tokens, and which backend moves them.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace epx {

enum class BackendKind : int32_t { host = 0, cuda = 1 };

namespace detail {
struct GroupState;  // backend-specific shared state
}

class Group {
 public:
  Group() = default;
  Group(std::shared_ptr<detail::GroupState> state, int rank, int size, BackendKind backend)
      : state_(std::move(state)), rank_(rank), size_(size), backend_(backend) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  BackendKind backend() const { return backend_; }
  const std::shared_ptr<detail::GroupState>& state() const { return state_; }

  // Collective: every rank's `record` (at most kMaxRecordBytes), in rank order, over the group's
  // own transport, for front ends that must agree on a value (a calibrated size) before they create
  // buffers. It pairs with the peers' calls in order, buffer creations included. A record too long
  // on any rank fails every rank (invalid_argument there, peer_failed on the others); a rank that
  // does not arrive within timeout_ms (0: EPX_TIMEOUT_MS or 60 s) fails the others with timeout.
  static constexpr size_t kMaxRecordBytes = 1024;
  std::vector<std::string> all_gather(const std::string& record, int64_t timeout_ms = 0) const;

 private:
  std::shared_ptr<detail::GroupState> state_;
  int rank_ = 0;
  int size_ = 0;
  BackendKind backend_ = BackendKind::host;
};

// The CPU backend: `size` ranks that are threads of this process. Create one world,
// then give world.group(r) to the thread that plays rank r.
class HostWorld {
 public:
  explicit HostWorld(int size);
  int size() const { return size_; }
  Group group(int rank) const;

 private:
  std::shared_ptr<detail::GroupState> state_;
  int size_;
};

}  // namespace epx
