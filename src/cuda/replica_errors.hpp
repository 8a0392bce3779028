// The words of a replica-table violation that a kernel found (kernels/replicas.cuh reports it as
// kStatusReplica*: a = the entry's index e * W + j, or the row; b = its value; c = the earlier
// entry it repeats), as the CPU backend says them (core/replicas.hpp).
#pragma once
#include <string>

#include "core/replicas.hpp"
#include "cuda/kernels/device_types.hpp"

namespace epx::detail {

// "" for a code that is not a table's.
inline std::string replica_error(const char* op, int32_t code, int64_t a, int64_t b, int64_t c,
                                 const ReplicaShape& shape) {
  const int64_t w = shape.width > 0 ? shape.width : 1;
  switch (code) {
    case kStatusReplicaOutOfRange: return replica_out_of_range(op, a / w, a % w, b, shape.physical);
    case kStatusReplicaRepeated: return replica_repeated(op, a / w, a % w, b, c / w, c % w);
    case kStatusReplicaEmptyRow: return replica_empty_row(op, a, shape.width);
  }
  return "";
}

}  // namespace epx::detail
