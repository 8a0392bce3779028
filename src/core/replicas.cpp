#include "core/replicas.hpp"

#include <algorithm>
#include <string>

#include "core/check.hpp"
#include "core/validate.hpp"

namespace epx::detail {

ReplicaShape replica_shape(int64_t num_experts, int64_t num_physical_experts, int64_t max_replicas, int ranks,
                           const char* what) {
  require(num_physical_experts >= 0, what, ": num_physical_experts must be >= 0 (0 = no redundant experts), got ",
          num_physical_experts);
  if (num_physical_experts == 0) {
    require(max_replicas == 0, what, ": max_replicas goes with num_physical_experts > 0 (EPLB), got ", max_replicas);
    return {num_experts, num_experts, 0};
  }
  require(num_physical_experts >= num_experts, what, ": num_physical_experts (", num_physical_experts,
          ") must be >= num_experts (", num_experts, "): every logical expert needs a physical one");
  require(num_physical_experts % ranks == 0, what, ": num_physical_experts (", num_physical_experts,
          ") must be a multiple of the group size (", ranks, ") so every rank holds the same number of experts");
  // Each call reads the table into per-expert arrays of P entries on the host: bounded so that they fit.
  require(num_physical_experts <= (int64_t{1} << 20), what, ": num_physical_experts must be <= 2^20, got ",
          num_physical_experts);
  // With every row holding one entry and no id twice, a row holds at most P - E + 1 entries.
  const int64_t most = num_physical_experts - num_experts + 1;
  require(max_replicas >= 0 && max_replicas <= most, what, ": max_replicas must be in [0, P - E + 1 = ", most,
          "] (0 = P - E + 1), got ", max_replicas);
  return {num_experts, num_physical_experts, max_replicas > 0 ? max_replicas : most};
}

void validate_replica_tensor(const TensorView& table, const ReplicaShape& shape, const char* op, DeviceKind device) {
  if (!shape.enabled()) {
    require(!table.defined(), op, ": expert_replicas given but the buffer has no redundant experts; create it with "
            "num_physical_experts > 0 or drop expert_replicas");
    return;
  }
  require(table.defined(), op, ": expert_replicas is missing; a buffer with num_physical_experts=", shape.physical,
          " needs the replica table [E=", shape.logical, ", M=", shape.width, "] i32 at every dispatch");
  check_tensor(table, cat(op, ": expert_replicas"), words("[E=", shape.logical, ", M=", shape.width, "]"), DType::i32,
               {shape.logical, shape.width}, device);
}

std::string replica_out_of_range(const char* op, int64_t e, int64_t j, int64_t value, int64_t physical) {
  return cat(op, ": expert_replicas[", e, "][", j, "] = ", value,
             " is out of range; physical expert ids must be in [0, ", physical, ") or -1 for an unused entry");
}

std::string replica_repeated(const char* op, int64_t e, int64_t j, int64_t value, int64_t e0, int64_t j0) {
  return cat(op, ": expert_replicas[", e, "][", j, "] = ", value, " repeats expert_replicas[", e0, "][", j0,
             "]; a physical expert serves one logical expert, once");
}

std::string replica_empty_row(const char* op, int64_t e, int64_t width) {
  return cat(op, ": expert_replicas[", e, "] has no entry (all ", width,
             " are -1); every logical expert needs at least one physical expert");
}

ReplicaChoice read_replica_choice(const TensorView& table, const ReplicaShape& shape, int rank, int ranks,
                                  const char* op) {
  const int64_t per_rank = shape.physical / ranks;
  std::vector<int64_t> seen_at(shape.physical, -1);  // entry (e * M + j) holding each physical id
  ReplicaChoice choice{std::vector<std::vector<int32_t>>(shape.logical), rank};
  std::vector<int32_t> all;
  for (int64_t e = 0; e < shape.logical; ++e) {
    all.clear();
    for (int64_t j = 0; j < shape.width; ++j) {
      const int32_t p = at<int32_t>(table, e, j);
      if (p == -1) continue;
      if (p < 0 || p >= shape.physical)
        fail(ErrorCode::invalid_argument, replica_out_of_range(op, e, j, p, shape.physical));
      const int64_t before = seen_at[p];
      if (before >= 0)
        fail(ErrorCode::invalid_argument, replica_repeated(op, e, j, p, before / shape.width, before % shape.width));
      seen_at[p] = e * shape.width + j;
      all.push_back(p);
      if (p / per_rank == rank) choice.candidates[e].push_back(p);
    }
    if (all.empty()) fail(ErrorCode::invalid_argument, replica_empty_row(op, e, shape.width));
    if (choice.candidates[e].empty()) choice.candidates[e] = all;
  }
  return choice;
}

void choose_replicas(std::vector<int32_t>& slot_expert, int64_t topk, const ReplicaChoice& choice) {
  for (size_t i = 0; i < slot_expert.size(); ++i)
    if (slot_expert[i] >= 0) slot_expert[i] = choice.pick(slot_expert[i], static_cast<int64_t>(i) / topk);
}

Tensor route_to_replicas(const TensorView& table, const ReplicaShape& shape, std::vector<int32_t>& slot_expert,
                         int64_t tokens, int64_t topk, int rank, int ranks, const char* op) {
  validate_replica_tensor(table, shape, op, DeviceKind::host);
  if (!shape.enabled()) return {};
  choose_replicas(slot_expert, topk, read_replica_choice(table, shape, rank, ranks, op));
  Tensor chosen = Tensor::zeros_host(DType::i32, {tokens, topk});
  std::copy(slot_expert.begin(), slot_expert.end(), chosen.data<int32_t>());
  return chosen;
}

std::string replica_table_signature(const TensorView& table, const ReplicaShape& shape) {
  if (!shape.enabled()) return "";
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the entries, row by row
  for (int64_t e = 0; e < shape.logical; ++e)
    for (int64_t j = 0; j < shape.width; ++j) {
      hash ^= static_cast<uint32_t>(at<int32_t>(table, e, j));
      hash *= 1099511628211ull;
    }
  return cat(", expert_replicas hash ", hash);
}

}  // namespace epx::detail
