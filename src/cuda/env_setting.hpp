// Tuning and measuring variables of the CUDA backend (EPX_*): read from the environment, checked,
// with words a user can act on when a value is not one the backend knows.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "core/check.hpp"

namespace epx::detail {

// One of `allowed` (the first when unset).
inline std::string env_choice(const char* name, std::initializer_list<const char*> allowed) {
  const char* v = std::getenv(name);
  const std::string value = v ? v : *allowed.begin();
  std::string list;
  for (const char* a : allowed) {
    if (value == a) return value;
    list += (list.empty() ? "'" : ", '") + std::string(a) + "'";
  }
  fail(ErrorCode::invalid_argument, name, " must be one of ", list, "; got '", value, "'");
}

// Unset: `fallback`; set, an integer in [lo, hi].
inline int64_t env_integer(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  require(end != v && *end == '\0' && n >= lo && n <= hi, name, " must be an integer in [", lo, ", ", hi, "], got '", v,
          "'");
  return n;
}

}  // namespace epx::detail
