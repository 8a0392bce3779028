// Errors: every failure is an epx::Error whose message says what went wrong and what to do.
#pragma once
#include <stdexcept>
#include <string>

namespace epx {

enum class ErrorCode : int32_t {
  invalid_argument = 1,  // bad shape, dtype, id, option: the caller's input
  config_mismatch = 2,   // ranks disagree on a collective's configuration or call order
  peer_failed = 3,       // another rank rejected its input or failed; this rank stops too
  timeout = 4,           // a peer never arrived within the timeout
  unsupported = 5,       // valid request this build or backend cannot serve
  internal = 6,          // a bug in epx; please report
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace epx
