// Inputs, options and results of the four operations. docs/semantics.md is the full contract.
#pragma once
#include <cstdint>
#include <memory>

#include "epx/config.hpp"
#include "epx/tensor.hpp"

namespace epx {

namespace detail {
struct HandleState;
}

// What dispatch learned about the routing; combine and both backward passes reuse it.
// Valid only with the Buffer (and rank) that produced it.
class Handle {
 public:
  Handle() = default;
  explicit Handle(std::shared_ptr<const detail::HandleState> s) : state_(std::move(s)) {}
  bool valid() const { return state_ != nullptr; }
  const detail::HandleState& state() const { return *state_; }

 private:
  std::shared_ptr<const detail::HandleState> state_;
};

// The collective operations of a Buffer, for Buffer::reject.
enum class Op : int32_t { dispatch = 0, combine = 1, dispatch_backward = 2, combine_backward = 3, cached_dispatch = 4 };
const char* op_name(Op op);  // "dispatch", "combine", ..., "cached_dispatch"

struct DispatchInput {
  TensorView x;             // [T, H] bf16, or fp8_e4m3 (pre-quantized, needs x_scales and wire fp8)
  TensorView x_scales;      // [T, H/128] f32, only with fp8 x
  TensorView topk_idx;      // [T, K] i32 or i64; -1 = unused slot
  TensorView topk_weights;  // [T, K] f32, optional (needed for weighted combine)
  TensorView routing_map;   // [T, E] boolean: alternative to topk_idx
  TensorView probs;         // [T, E] f32 with routing_map, optional
  TensorView shared_gate;   // [T] f32, optional with shared_expert: the weight of token t's shared row
  // [E, M] i32, required with BufferConfig::num_physical_experts > 0 (EPLB), refused otherwise:
  // row e = the physical experts serving logical expert e, -1 for unused entries. Every rank
  // passes the same table; it is read at each call, so rewriting it between calls needs no sync.
  TensorView expert_replicas;
};

struct DispatchOptions {
  Layout layout = Layout::expert_major;
  // NVFP4 global scale: 0 = per token, 2688 / max|x[t]| (receivers keep 1/g per row);
  // > 0 = this value for every token.
  float nvfp4_global_scale = 0.0f;
};

// Cached dispatch (Buffer::dispatch with a handle): only x (and x_scales with pre-quantized fp8)
// of DispatchInput; the routing and the layout are the handle's.
struct CachedDispatchOptions {
  float nvfp4_global_scale = 0.0f;  // as DispatchOptions
};

struct DispatchResult {
  // Receive rows (N = num_rows in blocking mode, capacity_rows in capacity mode).
  Tensor recv_x;             // [N, H] bf16 | [N, H] fp8_e4m3 | [N, H/2] e2m1x2
  Tensor recv_scales;        // fp8: [N, H/128] f32; nvfp4: [N, H/16] fp8_e4m3
  Tensor recv_global_scale;  // nvfp4: [N] f32, the inverse global scale 1/g of each row
  Tensor recv_src;           // [N, 2] i32 (source rank, source token); padding rows (-1, -1)
  Tensor recv_weights;       // expert-major: [N] f32 router weight of the row (0 on padding)
  Tensor recv_topk_idx;      // rank-major: [N, K] i32 local expert id or -1
  Tensor recv_topk_weights;  // rank-major: [N, K] f32 (0 where recv_topk_idx is -1)
  Tensor expert_offsets;     // [L+1] i64 padded row offsets (expert-major); shared_expert: [L+2], segment 0 shared
  Tensor tokens_per_expert;  // [L] i64 unpadded counts; shared_expert: [L+1], T first
  Tensor rank_offsets;       // [R+1] i64 first row from each source rank (rank-major)

  // A cached dispatch returns recv_x, recv_scales and recv_global_scale (and handle, the one it
  // was given); the fields above and below are those of the dispatch that made the handle.
  Tensor recv_info;          // [4] i64 on the backend's device: rows received, num_rows, rows allocated,
                             // overflow (capacity mode reads sizes here, without a host sync)
  int64_t num_rows = 0;       // rows the layout needs (may exceed capacity_rows); -1 when only on the device
  bool overflow = false;      // capacity mode: num_rows > capacity_rows; rows past capacity not written
  int64_t dropped_slots = 0;  // (token, expert) pairs this rank sent that capacity_factor dropped
  // EPLB: [T, K] i32 on the source, the physical expert chosen for each slot (-1 unused; a
  // dropped slot keeps its choice); else empty.
  Tensor topk_physical;
  Handle handle;
};

struct CombineInput {
  TensorView y;           // [N, H] bf16 in the dispatch layout (N = rows of that dispatch's recv_x)
  TensorView shared_out;  // [T, H] bf16, optional shared-expert output added into the result
};

struct CombineOptions {
  // true: out[t] = sum_k w[t,k] * y[row(t,k)]  (expert-major only, needs topk weights)
  // false: plain sum of the rows.
  bool weighted = true;
};

struct CombineResult {
  Tensor out;             // [T, H] bf16
  bool overflow = false;  // the dispatch overflowed: rows past capacity contributed nothing
};

struct DispatchBackwardInput {
  TensorView grad_recv_x;        // [N, H] bf16, the dispatch layout
  TensorView grad_recv_weights;  // optional: expert-major [N] f32, rank-major [N, K] f32
};

struct DispatchBackwardResult {
  Tensor grad_x;             // [T, H] bf16 (unweighted combine of grad_recv_x)
  Tensor grad_topk_weights;  // [T, K] f32 when grad_recv_weights was given
  Tensor grad_shared_gate;   // [T] f32, shared_expert with grad_recv_weights: the shared rows' values
};

struct CombineBackwardInput {
  TensorView grad_out;  // [T, H] bf16
  TensorView y;         // [N, H] bf16, the combine's input (needed for grad of the weights)
};

struct CombineBackwardResult {
  Tensor grad_y;             // [N, H] bf16 in the dispatch layout (padding rows zero)
  Tensor grad_topk_weights;  // [T, K] f32 (weighted only): <grad_out[t], y[row(t,k)]>
  Tensor grad_shared_gate;   // [T] f32 (weighted, dispatch had a shared_gate): <grad_out[t], y[t]>
};

}  // namespace epx
