// Benchmark records and their JSON form (docs/benchmarks.md lists the fields).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace epx::bench {

struct Record {
  std::string op;      // dispatch, combine, dispatch_backward, combine_backward
  std::string dtype;   // wire format: bf16, fp8, fp8_ue8m0, nvfp4
  std::string combine_wire;  // the buffers' combine_wire (bf16, fp8, fp8_ue8m0); empty for baselines (not written)
  std::string layout;  // rank_major, expert_major
  int ranks = 0;
  int64_t tokens = 0;  // per rank
  int64_t hidden = 0;
  int64_t topk = 0;
  int64_t experts = 0;
  int64_t alignment = 1;
  std::string routing;
  int sms = 0;
  double time_us = 0;  // median
  double min_us = 0;
  double max_us = 0;
  int iters = 0;
  double kernel_us = 0;  // CUDA low-latency ops, graph timing: median kernel time per call (CUPTI); 0: not measured
  double logical_gbps = 0;  // DeepEP accounting: bytes received per rank / time
  double wire_gbps = 0;     // bytes that crossed to another rank, per rank / time
  double link_fraction = 0; // wire_gbps / the peer-copy GB/s measured in the same run (0: not measured)
  double logical_bytes = 0;
  // High-throughput ops: what the op must read and write in HBM on its busiest rank (rows only:
  // inputs read once, outputs written once; floors.hpp), and the floor those bytes give at the
  // rates this run's baselines measured with the record's SM budget (0: not computed).
  double hbm_read_bytes = 0, hbm_write_bytes = 0;
  double floor_us = 0, floor_ratio = 0;
  bool verified = false;
  std::string verify_error;
  std::string backend;
  std::string transport;  // "shared-gpu" for --shared-gpu runs, else empty (not written)
  std::string timing;     // CUDA low-latency ops: "graph" (replays of 10 calls) or "eager"; else empty
  std::string weights_at;  // low-latency ops with --ll-weights-at dispatch: "dispatch"; else empty
  std::string ranks_as;    // "processes" with --processes (one process per rank); else empty (threads)
  bool shared_expert = false;  // --shared-expert (written only when true)
  int64_t replicas = 0;        // --replicas (written only when > 0)
  int64_t capacity_rows = 0;   // --mode capacity: the buffers' capacity_rows (written with "mode" when > 0)
  std::string engines;    // CUDA high-throughput ops: the engines asked for ("dispatch=auto"); else empty
  std::string gpu;  // empty on the host backend
  std::string git_commit;
};

// Reference points measured beside epx (baselines.hpp): nothing of epx's to verify.
inline bool is_baseline(const std::string& op) {
  return op == "peer_copy" || op == "peer_copy_rows" || op == "nccl_alltoall" || op == "local_copy" || op == "local_read" ||
         op == "local_write";
}

// Writes the records as a JSON list: into path + ".tmp", renamed over path once complete, so the
// file at path is always a whole document (the last one written) even if the process dies
// while writing. Returns false (with errno set) when the file fails.
bool write_json(const std::string& path, const std::vector<Record>& records);

}  // namespace epx::bench
