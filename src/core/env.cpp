#include "core/env.hpp"

#include <cstdlib>
#include <initializer_list>
#include <string>

#include "core/check.hpp"

namespace epx::detail {

namespace {

// The index of the variable's value in `allowed` (the first when unset).
int choice(const char* name, std::initializer_list<const char*> allowed) {
  const char* v = std::getenv(name);
  const std::string value = v ? v : *allowed.begin();
  std::string list;
  int i = 0;
  for (const char* a : allowed) {
    if (value == a) return i;
    list += (list.empty() ? "'" : ", '") + std::string(a) + "'";
    ++i;
  }
  fail(ErrorCode::invalid_argument, name, " must be one of ", list, " (or unset); got '", value, "'");
}

Engine engine(const char* name) {
  static constexpr Engine engines[] = {Engine::automatic, Engine::sm, Engine::copy};
  return engines[choice(name, {"auto", "sm", "copy"})];
}

}  // namespace

std::optional<int64_t> env_timeout_ms() {
  const char* v = std::getenv("EPX_TIMEOUT_MS");
  if (!v) return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  require(end != v && *end == '\0' && n > 0, "EPX_TIMEOUT_MS must be a positive number of milliseconds, got '", v,
          "'");
  return n;
}

Profile env_profile() {
  if (!std::getenv("EPX_PROFILE")) return Profile::off;
  static constexpr Profile profiles[] = {Profile::on, Profile::host, Profile::ll};
  return profiles[choice("EPX_PROFILE", {"1", "host", "ll"})];
}

bool env_poison_outputs() { return choice("EPX_POISON_OUTPUTS", {"0", "1"}) == 1; }

Engine env_dispatch_engine() { return engine("EPX_DISPATCH_ENGINE"); }

Engine env_combine_engine() { return engine("EPX_COMBINE_ENGINE"); }

}  // namespace epx::detail
