// Routing: which experts each local token goes to, in one canonical form for every backend.
#pragma once
#include <cstdint>
#include <vector>

#include "epx/config.hpp"
#include "epx/ops.hpp"

namespace epx::detail {

struct Routing {
  int64_t tokens = 0;
  int64_t topk = 0;
  std::vector<int32_t> expert;  // [T*K] global expert id, or -1 for an unused (or dropped) slot
  std::vector<float> weight;    // [T*K] router weight; 1 where no weights were given, 0 on unused slots
  bool has_weights = false;

  int32_t slot_expert(int64_t t, int64_t k) const { return expert[t * topk + k]; }
};

// Checks a buffer config on its own (not against other ranks); throws invalid_argument.
void validate_config(const BufferConfig& c, int ranks);

// Checks x (and x_scales) against the config and wire format; throws invalid_argument.
void validate_dispatch_x(const DispatchInput& in, const BufferConfig& c, DeviceKind device);

// Validates topk_idx/topk_weights or routing_map/probs (host memory) and builds the canonical
// routing: a dense map becomes top-k slots in increasing expert order, unused slots -1.
// Rejects ids outside [-1, E), an expert twice in one token, more than K experts per token.
Routing routing_from_input(const DispatchInput& in, const BufferConfig& c);

// shared_expert: each token's shared-row weight, its gate (a host [T] f32, any row stride), or 1
// without one. Both modes' CPU backends read it so.
std::vector<float> shared_gate_weights(const TensorView& gate, int64_t tokens);

// Tokens of this rank per expert: [E].
std::vector<int64_t> count_per_expert(const Routing& r, int64_t num_experts);

// Per-expert capacity for capacity_factor: ceil(cf * total_tokens * K / E).
int64_t expert_capacity(double capacity_factor, int64_t total_tokens, int64_t topk, int64_t num_experts);

// The drop rule: expert e keeps its first `capacity` (token, slot) pairs in (source rank,
// source token) order. counts[s][e] are every rank's pre-drop counts. Marks this rank's dropped
// slots -1 (weight 0) and returns how many it dropped.
int64_t drop_over_capacity(Routing& r, const std::vector<std::vector<int64_t>>& counts, int rank,
                           int64_t capacity);

}  // namespace epx::detail
