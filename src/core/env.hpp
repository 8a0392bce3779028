// The environment variables epx reads, one function each (docs/cuda.md, "Environment variables").
// Each parses and checks its variable; a value it does not know is an invalid_argument error that
// names the variable and the values it takes. Tuning belongs to BufferConfig, not here: these are
// the timeout's fallback, measuring aids and test switches.
#pragma once
#include <cstdint>
#include <optional>

namespace epx::detail {

// EPX_TIMEOUT_MS: a positive number of milliseconds; nullopt when unset (core/timeout.hpp).
std::optional<int64_t> env_timeout_ms();

// EPX_PROFILE: per-step times of the CUDA backend's calls, printed to stderr when a buffer goes.
// 1: CUDA events between the steps and the host's steps; host: the host's steps only; ll: as 1,
// and the low-latency kernels' per-block timelines.
enum class Profile { off, on, host, ll };
Profile env_profile();

// EPX_POISON_OUTPUTS=1: the CUDA backend fills every output with 0xa5 before its kernels write
// it, so a byte left unwritten shows (tests). 0 or unset: off.
bool env_poison_outputs();

// EPX_DISPATCH_ENGINE, EPX_COMBINE_ENGINE: auto (the default) or an engine forced (tests, and
// measuring one engine against the other; docs/cuda.md).
enum class Engine { automatic, sm, copy };
Engine env_dispatch_engine();
Engine env_combine_engine();

}  // namespace epx::detail
