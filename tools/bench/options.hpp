// epx-bench command line.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "epx/epx.hpp"
#include "verify/random_inputs.hpp"

namespace epx::bench {

struct Options {
  std::string backend;  // "host" or "cuda"
  std::string preset = "v3";
  int ranks = 2;
  int64_t tokens = -1;  // -1: from the preset (scaled down on the host backend)
  int64_t hidden = -1;
  int64_t experts = -1;
  int64_t topk = -1;
  int64_t alignment = 1;
  int sms = 0;  // SM budget for GPU kernels (0 = backend default); recorded
  int64_t send_blocks = 0;  // BufferConfig::send_blocks (0 = backend default)
  verify::Routing routing = verify::Routing::uniform;
  std::vector<WireFormat> wires;
  WireFormat combine_wire = WireFormat::bf16;  // BufferConfig / LowLatencyConfig::combine_wire; recorded
  std::vector<Layout> layouts;
  std::vector<std::string> ops;  // dispatch, combine, dispatch_backward, combine_backward
  int warmup = -1;  // -1: 2 (host: 1)
  int iters = -1;   // -1: 20 (host: 5)
  uint64_t seed = 1;
  std::string json;
  double max_memory_gb = 0;  // host memory the run may count on (0: MemAvailable or the cgroup limit)
  bool tokens_scaled = false;  // the host backend shrank the preset's token count
  bool shared_gpu = false;     // CUDA: every rank on GPU 0 (the tests' transport)
  bool shared_expert = false;  // BufferConfig::shared_expert (expert-major only)
  int64_t replicas = 0;        // EPLB: replicas per logical expert (0: off), verify::spread_replicas
  bool ll_eager = false;       // low-latency ops timed call by call (host launch included), not as graph replays
  bool ll_weights_at_dispatch = false;  // the combine's weights given to ll_dispatch instead of ll_combine
  bool processes = false;  // CUDA, high-throughput ops: one process per rank (bench/processes.hpp)
  bool capacity_mode = false;  // high-throughput buffers in CapacityMode::capacity (recorded)
  int64_t capacity_rows = 0;   // their capacity_rows (0: the most rows any rank's layout needs)
};

// Parses argv; prints usage and exits on --help or a bad flag.
Options parse_options(int argc, char** argv);

}  // namespace epx::bench
