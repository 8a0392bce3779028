#include "core/timeout.hpp"

#include "core/env.hpp"

namespace epx::detail {

std::chrono::milliseconds resolve_timeout(int64_t config_ms) {
  if (config_ms > 0) return std::chrono::milliseconds(config_ms);
  if (const std::optional<int64_t> env = env_timeout_ms()) return std::chrono::milliseconds(*env);
  return std::chrono::milliseconds(60000);
}

}  // namespace epx::detail
