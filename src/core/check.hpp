// Small helpers to build error messages and throw epx::Error.
#pragma once
#include <sstream>
#include <string>

#include "epx/error.hpp"

namespace epx::detail {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(ErrorCode code, const Args&... args) {
  throw Error(code, cat(args...));
}

// Throws invalid_argument with the message when cond is false.
template <typename... Args>
void require(bool cond, const Args&... args) {
  if (!cond) fail(ErrorCode::invalid_argument, args...);
}

}  // namespace epx::detail
