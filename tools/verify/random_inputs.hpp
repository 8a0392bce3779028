// Random MoE problems for tests and epx-bench: every rank's inputs, generated on one thread.
#pragma once
#include <cstdint>
#include <vector>

#include "epx/epx.hpp"

namespace epx::verify {

struct RankInput {
  int64_t tokens = 0;
  std::vector<uint16_t> x;       // [T, H] bf16
  std::vector<uint8_t> x_fp8;    // [T, H] e4m3, when the problem is pre-quantized
  std::vector<float> x_scales;   // [T, H/128]
  std::vector<int32_t> idx;      // [T, K], -1 = unused
  std::vector<float> weights;    // [T, K]
  bool has_weights = true;
  std::vector<float> shared_gate;  // [T] with cfg.shared_expert, optional (empty: no gate)

  // Views for Buffer::dispatch (topk form).
  DispatchInput view(int64_t hidden, int64_t topk) const;
};

struct Problem {
  BufferConfig cfg;
  int ranks = 1;
  bool prequantized = false;  // x given as fp8 + scales (cfg.wire must be fp8)
  std::vector<RankInput> inputs;
  // cfg.num_physical_experts > 0 (EPLB): the replica table every rank passes, [E, M] (verify/replicas.hpp).
  std::vector<int32_t> replicas;
};

enum class Routing { uniform, skewed };

struct ProblemSpec {
  BufferConfig cfg;
  int ranks = 1;
  std::vector<int64_t> tokens;  // per rank; empty = max_tokens_per_rank on every rank
  Routing routing = Routing::uniform;
  double unused_slot_fraction = 0.0;  // share of slots set to -1
  bool exact_values = false;  // x with 4 significant bits, so small integer multiples are exact
  bool prequantized = false;
  uint64_t seed = 1;
};

Problem make_problem(const ProblemSpec& spec);

// The same problem (routing, tokens) with new token values (a cached dispatch's input).
Problem with_fresh_x(const Problem& p, uint64_t seed);

// The dense form of a problem's top-k routing (routing_map [T, E] + probs [T, E] per rank), and
// the top-k problem it is equivalent to (each token's experts ascending, unused slots last).
struct DenseRouting {
  std::vector<std::vector<uint8_t>> maps;
  std::vector<std::vector<float>> probs;
  Problem sorted;
};
DenseRouting dense_routing(const Problem& p);

// Random bf16 values, never zero: sign random, magnitude 2^u with u uniform in [-16, 2).
std::vector<uint16_t> random_bf16(int64_t count, uint64_t seed, bool exact_values = false);

}  // namespace epx::verify
