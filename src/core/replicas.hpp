// Redundant experts (EPLB): the replica table of a dispatch and the rule that picks, for each
// (token, slot), which physical expert serves its logical expert. One rule for every backend
// (docs/semantics.md, "Redundant experts (EPLB)").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "epx/tensor.hpp"

namespace epx::detail {

// The EPLB fields of a buffer config, resolved: P physical experts and M replica columns.
struct ReplicaShape {
  int64_t logical = 0;   // E
  int64_t physical = 0;  // P (= E when EPLB is off)
  int64_t width = 0;     // M (0 when off)
  bool enabled() const { return width > 0; }
};

// A buffer without redundant experts: P = E, no table.
inline ReplicaShape no_replicas(int64_t num_experts) { return {num_experts, num_experts, 0}; }

// max_replicas as the buffer uses it (0 with EPLB on: P - E + 1), so that configs meaning the same agree.
inline int64_t resolved_max_replicas(int64_t num_experts, int64_t num_physical_experts, int64_t max_replicas) {
  return num_physical_experts > 0 && max_replicas == 0 ? num_physical_experts - num_experts + 1 : max_replicas;
}

// The experts the ranks hold: P with EPLB, else E.
inline int64_t physical_experts(int64_t num_experts, int64_t num_physical_experts) {
  return num_physical_experts > 0 ? num_physical_experts : num_experts;
}

// Checks num_physical_experts and max_replicas against E and the group size (throws
// invalid_argument with `what` first) and resolves them.
ReplicaShape replica_shape(int64_t num_experts, int64_t num_physical_experts, int64_t max_replicas, int ranks,
                           const char* what);

// expert_replicas of one call: present exactly when EPLB is on, [E, M] i32 on `device`.
void validate_replica_tensor(const TensorView& table, const ReplicaShape& shape, const char* op, DeviceKind device);

// The candidates of each logical expert for one source rank, in table order: the entries of row e
// held by that rank if any, else every entry of row e.
struct ReplicaChoice {
  std::vector<std::vector<int32_t>> candidates;  // [E]
  int rank = 0;
  // The physical expert of logical expert e for token t: candidates[e][(t + rank) % n].
  int32_t pick(int32_t logical, int64_t token) const {
    const std::vector<int32_t>& c = candidates[logical];
    return c[static_cast<size_t>((token + rank) % static_cast<int64_t>(c.size()))];
  }
};

// The words of a bad table's first violation (every backend's, so that a device check says the same):
// entry [e][j] out of range, entry [e][j] repeating [e0][j0], row e without an entry.
std::string replica_out_of_range(const char* op, int64_t e, int64_t j, int64_t value, int64_t physical);
std::string replica_repeated(const char* op, int64_t e, int64_t j, int64_t value, int64_t e0, int64_t j0);
std::string replica_empty_row(const char* op, int64_t e, int64_t width);

// Reads a host table and checks its values (each row one entry at least, ids in [0, P) or -1,
// no physical id twice in the table); throws invalid_argument naming expert_replicas[e][j].
ReplicaChoice read_replica_choice(const TensorView& table, const ReplicaShape& shape, int rank, int ranks,
                                  const char* op);

// Rewrites logical expert ids (-1 kept) of [tokens, topk] slots to the physical ones chosen.
void choose_replicas(std::vector<int32_t>& slot_expert, int64_t topk, const ReplicaChoice& choice);

// One dispatch's replica step on the host: checks expert_replicas (present exactly when EPLB is on),
// rewrites the slots [tokens, topk] to the physical experts chosen for source rank `rank`, and
// returns them as topk_physical ([tokens, topk] i32; undefined when EPLB is off).
Tensor route_to_replicas(const TensorView& table, const ReplicaShape& shape, std::vector<int32_t>& slot_expert,
                         int64_t tokens, int64_t topk, int rank, int ranks, const char* op);

// What the plan exchange compares so that every rank routes by the same table: "" when EPLB is
// off, else a hash of the table's entries (a table that differs between ranks would send tokens
// to a physical expert its owner counts as another logical expert's: wrong results, no error).
std::string replica_table_signature(const TensorView& table, const ReplicaShape& shape);

}  // namespace epx::detail
