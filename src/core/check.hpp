// Small helpers to build error messages and throw epx::Error.
#pragma once
#include <sstream>
#include <string>
#include <tuple>

#include "epx/error.hpp"

namespace epx::detail {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// A message's words, written only when the message is (a check that passes formats nothing):
// words("[T=", tokens, "]") keeps references to its arguments, valid to the end of the full
// expression that made it, or as long as they live when a local holds it.
template <typename... Args>
struct Words {
  std::tuple<const Args&...> args;
  friend std::ostream& operator<<(std::ostream& os, const Words& w) {
    std::apply([&](const auto&... a) { (os << ... << a); }, w.args);
    return os;
  }
};
template <typename... Args>
Words<Args...> words(const Args&... args) {
  return {std::tie(args...)};
}

// Any streamable value behind one type (a non-template function's message argument), written
// only when streamed. It refers to the value: pass it within the value's full expression.
class Lazy {
 public:
  template <typename T>
  Lazy(const T& value)  // NOLINT(google-explicit-constructor): stands in for the value
      : value_(&value), write_([](std::ostream& os, const void* v) { os << *static_cast<const T*>(v); }) {}
  friend std::ostream& operator<<(std::ostream& os, const Lazy& l) {
    l.write_(os, l.value_);
    return os;
  }

 private:
  const void* value_;
  void (*write_)(std::ostream&, const void*);
};

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
