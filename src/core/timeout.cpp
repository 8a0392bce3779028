#include "core/timeout.hpp"

#include <cstdlib>

#include "core/check.hpp"

namespace epx::detail {

std::chrono::milliseconds resolve_timeout(int64_t config_ms) {
  if (config_ms > 0) return std::chrono::milliseconds(config_ms);
  if (const char* env = std::getenv("EPX_TIMEOUT_MS")) {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    require(end != env && *end == '\0' && v > 0, "EPX_TIMEOUT_MS must be a positive number of milliseconds, got '",
            env, "'");
    return std::chrono::milliseconds(v);
  }
  return std::chrono::milliseconds(60000);
}

}  // namespace epx::detail
