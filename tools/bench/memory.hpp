// How much memory a whole epx-bench run takes at its peak, estimated from its options alone,
// before anything runs (docs/benchmarks.md, "Memory"). A run is a sequence of phases (one
// high-throughput configuration running, then being verified; one low-latency wire format); each
// phase's memory is the sum of what is alive in it on every rank, and the peak is the largest.
#pragma once
#include <string>
#include <vector>

#include "bench/options.hpp"

namespace epx::bench {

struct MemoryPart {
  std::string what;
  double bytes = 0;
};

struct MemoryPhase {
  std::string name;               // e.g. "ll bf16, running"
  std::vector<MemoryPart> host;   // resident host memory, largest part first
  double device_bytes = 0;        // CUDA: per GPU (GPU 0 holds every rank with --shared-gpu); 0 on the host
  double host_bytes() const;
};

struct MemoryEstimate {
  MemoryPhase peak;         // the phase with the most host memory
  double device_bytes = 0;  // the most any phase takes per GPU (rough: not checked against a GPU)
};

MemoryEstimate estimate_memory(const Options& o);

// "17.7 GB" (GB: 10^9 bytes, as --max-memory-gb counts them).
std::string gigabytes(double bytes);
// "ll bf16, running: low-latency receive areas 17.4 GB, ...": the four largest parts.
std::string describe(const MemoryPhase& phase);

}  // namespace epx::bench
