// The collective start of every buffer's creation: ranks agree on the config before any of them
// allocates or joins anything, so a config that one rank refuses fails every rank at once with
// that rank's reason, instead of leaving the others to wait for it until their timeout.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "epx/error.hpp"

#include "epx/group.hpp"

namespace epx::detail {

// Collective: every rank posts its config's description and its own checks' error (empty when
// its config is fine). Then, on every rank alike: a rank with an error throws it (with `code`:
// invalid_argument, or unsupported for a valid config this backend cannot serve), the others
// throw peer_failed naming it; configs that differ throw config_mismatch naming both. `what`
// names the buffer kind ("buffer", "low-latency buffer"); timeout_ms is the config's (0:
// EPX_TIMEOUT_MS or 60 s).
void agree_on_creation(const Group& group, const char* what, const std::string& config, const std::string& error,
                       int64_t timeout_ms, ErrorCode code = ErrorCode::invalid_argument);

// timeout_ms as the agreement waits it: an invalid one (itself an error agreed on) waits 60 s.
std::chrono::milliseconds creation_timeout(int64_t timeout_ms);

// A backend constructor's form: runs `checks` (its own limits), and takes part in the agreement
// with what they threw (nothing: this rank's config is fine), keeping its error code.
template <typename Checks>
void agree_after_checks(const Group& group, const char* what, const std::string& config, int64_t timeout_ms,
                        Checks&& checks) {
  std::string error;
  ErrorCode code = ErrorCode::invalid_argument;
  try {
    checks();
  } catch (const Error& e) {
    error = e.what();
    code = e.code();
  }
  agree_on_creation(group, what, config, error, timeout_ms, code);
}

}  // namespace epx::detail
