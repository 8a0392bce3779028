#include "host/host_group.hpp"

#include "core/check.hpp"
#include "epx/group.hpp"

namespace epx {

namespace detail {
std::shared_ptr<void> HostGroupState::join_next_any(int rank, const char* kind,
                                                    const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard lock(mutex_);
  const int64_t index = buffers_created_[rank]++;
  Pending& p = pending_[index];
  if (!p.shared) {
    p.shared = make();
    p.kind = kind;
  }
  if (p.kind != kind)
    fail(ErrorCode::config_mismatch, "buffer creation (rank ", rank, "): this rank creates a ", kind,
         " where another rank created a ", p.kind, "; every rank must create the same buffers in the same order");
  std::shared_ptr<void> result = p.shared;
  if (++p.joined == ranks) pending_.erase(index);
  return result;
}
}  // namespace detail

HostWorld::HostWorld(int size) : size_(size) {
  detail::require(size >= 1 && size <= 1024, "HostWorld: size must be in [1, 1024], got ", size);
  state_ = std::make_shared<detail::HostGroupState>(size);
}

Group HostWorld::group(int rank) const {
  detail::require(rank >= 0 && rank < size_, "HostWorld::group: rank ", rank, " is outside [0, ", size_, ")");
  return Group(state_, rank, size_, BackendKind::host);
}

}  // namespace epx
