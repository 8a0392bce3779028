// The CUDA backend's part of a dispatch handle (HandleState::device): the device arrays that
// combine, the backward passes and a cached dispatch reuse.
#pragma once
#include <memory>

#include "core/handle.hpp"
#include "cuda/kernels/launch.hpp"

namespace epx::detail {

// Everything a dispatch leaves for combine and the backward passes, in one allocation.
struct DeviceHandle final : BackendPayload {
  std::shared_ptr<void> memory;
  int32_t* slot_expert;   // [T*K]
  float* slot_weight;     // [T*K]
  float* shared_weight;   // [T] BufferConfig::shared_expert: each shared row's weight (its gate, or 1), else null
  int64_t* counts;        // [E] before dropping (the drop rule's plan)
  int64_t* expert_prefix;  // [E]
  int64_t* drop_capacity;  // [1]
  int64_t* dropped;        // [1]
  kernels::ChunkPositions pos;  // pos.send_pos: each token's stream position at each rank, or -1
  kernels::RecvArrays recv;
};

// The CUDA backend's payload of a handle it made (state_of checked the owner, so the type is its own).
inline const DeviceHandle& device_of(const HandleState& h) { return static_cast<const DeviceHandle&>(*h.device); }

}  // namespace epx::detail
