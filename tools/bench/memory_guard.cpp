// The memory check before a run: memory_guard.hpp.
#include "bench/memory_guard.hpp"

#include <fstream>
#include <sstream>

namespace epx::bench {

namespace {

// MemAvailable of /proc/meminfo in bytes (0 when unreadable): what the kernel can hand out
// without swapping, page cache it can drop included.
double mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (f >> key) {
    if (key == "MemAvailable:" && f >> kib) return kib * 1024;
    f.ignore(1 << 20, '\n');
  }
  return 0;
}

// The memory limit of this process's cgroup (0: none). cgroup v2's memory.max ("max": none) or
// v1's memory.limit_in_bytes (a huge number: none). The limit, not the limit less the usage:
// the usage counts page cache the kernel would drop for us.
double cgroup_limit() {
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    double bytes = 0;
    if (f >> bytes && bytes > 0 && bytes < 1e18) return bytes;
  }
  return 0;
}

bool fits(const Options& o, double budget) { return estimate_memory(o).peak.host_bytes() <= budget; }

// The largest --tokens below o.tokens that fits (0: none); the estimate grows with the tokens.
int64_t largest_tokens(Options o, double budget) {
  int64_t lo = 0, hi = o.tokens;  // fits(lo) (0: nothing yet), !fits(hi)
  while (hi - lo > 1) {
    o.tokens = lo + (hi - lo) / 2;
    (fits(o, budget) ? lo : hi) = o.tokens;
  }
  return lo;
}

// The most ranks below o.ranks that fit and divide the experts (0: none).
int largest_ranks(Options o, double budget) {
  const int ranks = o.ranks;
  for (o.ranks = ranks - 1; o.ranks >= 1; --o.ranks)
    if (o.experts % o.ranks == 0 && fits(o, budget)) return o.ranks;
  return 0;
}

}  // namespace

AvailableMemory available_memory(const Options& o) {
  if (o.max_memory_gb > 0) return {o.max_memory_gb * 1e9, "--max-memory-gb"};
  AvailableMemory a{mem_available(), "MemAvailable"};
  const double limit = cgroup_limit();
  if (limit > 0 && (a.bytes == 0 || limit < a.bytes)) a = {limit, "cgroup limit"};
  return a;
}

std::string memory_refusal(const Options& o, const MemoryEstimate& estimate, const AvailableMemory& available) {
  const double budget = kMemoryShare * available.bytes;
  if (available.bytes <= 0 || estimate.peak.host_bytes() <= budget) return {};  // unknown: nothing to compare with
  std::ostringstream why;
  why << "refusing to run: it needs about " << gigabytes(estimate.peak.host_bytes()) << " of host memory at its peak ("
      << describe(estimate.peak) << "), but " << gigabytes(available.bytes) << " is available (" << available.source
      << ") and a run may take " << static_cast<int>(kMemoryShare * 100) << "% of it (" << gigabytes(budget) << "). ";
  const int64_t tokens = largest_tokens(o, budget);
  const int ranks = largest_ranks(o, budget);
  if (tokens > 0 || ranks > 0) {
    why << "Smaller settings that fit:";
    if (tokens > 0) why << " --tokens " << tokens << (ranks > 0 ? ", or" : "");
    if (ranks > 0) why << " --ranks " << ranks;
    why << " (--max-memory-gb sets what is available).";
  } else {
    why << "Not even --tokens 1 or --ranks 1 fits: lower --hidden, or set what is available with --max-memory-gb.";
  }
  return why.str();
}

}  // namespace epx::bench
