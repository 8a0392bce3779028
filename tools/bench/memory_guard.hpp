// The check that runs before anything else: a run whose estimated peak (memory.hpp) would not
// fit in the host memory it can count on is refused at once, with a smaller setting that fits,
// instead of being killed by the kernel hours later with nothing written.
#pragma once
#include <string>

#include "bench/memory.hpp"
#include "bench/options.hpp"

namespace epx::bench {

// A run may take this share of the available memory: the rest is for what the estimate leaves
// out (allocator slack, other processes starting meanwhile).
constexpr double kMemoryShare = 0.8;

struct AvailableMemory {
  double bytes = 0;
  std::string source;  // "MemAvailable", "cgroup limit" or "--max-memory-gb"
};

// --max-memory-gb when given; else MemAvailable from /proc/meminfo, or the cgroup's memory limit
// where that is lower.
AvailableMemory available_memory(const Options& o);

// Empty when the estimate fits in kMemoryShare of `available`; else the reason to refuse: the
// estimate, what is available, and the largest --tokens (or --ranks) that would fit.
std::string memory_refusal(const Options& o, const MemoryEstimate& estimate, const AvailableMemory& available);

}  // namespace epx::bench
