// Reference points measured in the same run as epx (CUDA only): what the link gives to a plain
// peer copy, and what NCCL's all-to-all takes to move the same bytes as a dispatch.
#pragma once
#include <vector>

#include "bench/json.hpp"
#include "bench/options.hpp"

namespace epx::bench {

// bytes_to[s][d]: bytes rank s sends to rank d in the all-to-all (the dispatch's bf16 traffic).
// Returns records "peer_copy" (both directions at once, copy engines), "peer_copy_rows" (the same
// with a rank's dispatch rows, in four pieces) and "nccl_alltoall" (with 2 GPUs or more),
// "local_copy" (a copy within GPU 0 of what a rank's dispatch receives, by the SM budget's blocks,
// by every SM and by the copy engines: sms 0), "local_read" and "local_write" (reads, writes of 4x
// those bytes by 8, 16, the budget's and every SM); none without CUDA.
std::vector<Record> measure_baselines(const Options& o, const std::vector<std::vector<double>>& bytes_to);

}  // namespace epx::bench
