// How long any wait on a peer may take: the config's timeout_ms, else EPX_TIMEOUT_MS, else 60 s.
#pragma once
#include <chrono>
#include <cstdint>

namespace epx::detail {

// Throws invalid_argument when EPX_TIMEOUT_MS is set but not a positive number.
std::chrono::milliseconds resolve_timeout(int64_t config_ms);

}  // namespace epx::detail
