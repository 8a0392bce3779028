#include "host/host_group.hpp"

#include "core/check.hpp"
#include "epx/group.hpp"

namespace epx {

namespace detail {
std::shared_ptr<SharedBuffer> HostGroupState::join_next_buffer(int rank) {
  std::lock_guard lock(mutex);
  const int64_t index = buffers_created[rank]++;
  auto& [joined, buffer] = pending[index];
  if (!buffer) buffer = std::make_shared<SharedBuffer>(ranks);
  std::shared_ptr<SharedBuffer> result = buffer;
  if (++joined == ranks) pending.erase(index);
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
