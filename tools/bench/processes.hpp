// epx-bench --processes: one process per rank, as a training or serving job runs its GPUs (and as
// DeepEP's benchmark does), so no host API call of one rank waits in the driver behind another's.
#pragma once
#include <utility>
#include <vector>

#include "bench/json.hpp"
#include "bench/options.hpp"
#include "verify/reference.hpp"

namespace epx::bench {

// The high-throughput configurations (layout, dispatch wire) in the order epx-bench runs them.
using Config = std::pair<Layout, WireFormat>;

// Forks one process per rank before anything in this process touches CUDA; rank 0 makes the NCCL
// id, every rank joins with cuda_group_init_rank, runs its calls (each timed call starts together
// on every rank: a process-shared barrier), checks its own results against the reference (the
// other ranks' inputs rebuilt from the seed) and leaves times, bytes and checks in shared memory.
// Returns the records (marked "ranks_as": "processes") and, when a bf16 dispatch ran, its traffic
// matrix for the NCCL baseline. CUDA builds only.
std::vector<Record> run_processes(const Options& o, const verify::Problem& base, const std::vector<Config>& configs,
                                  std::vector<std::vector<double>>& bytes_to);

}  // namespace epx::bench
