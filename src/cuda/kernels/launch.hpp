// Host-side launchers of the CUDA backend's kernels. Each returns after enqueueing on ctx.stream.
#pragma once
#include <cuda_runtime.h>

#include "cuda/kernels/device_types.hpp"
#include "epx/config.hpp"

namespace epx::detail::kernels {

struct Ctx {
  PeerWindows peers;
  WindowMap map;
  Shape shape;
  DeviceStatus* status;  // device memory
  uint64_t timeout_ns;
  int blocks;            // grid of the data-moving kernels (the SM budget)
  cudaStream_t stream;
};

// Routing input as the kernels read it: top-k (i32 or i64) or a dense bool map.
struct RoutingInput {
  const void* topk_idx = nullptr;  // [T, K], row stride idx_stride elements
  bool idx64 = false;
  int64_t idx_stride = 0;
  const float* topk_weights = nullptr;  // [T, K] or null
  int64_t weight_stride = 0;
  const uint8_t* routing_map = nullptr;  // [T, E] or null
  int64_t map_stride = 0;
  const float* probs = nullptr;  // [T, E] or null
  int64_t probs_stride = 0;
};

// Canonical routing: slot_expert/slot_weight [T*K], counts [E] (+= per expert), errors
// reported in ctx.status. counts must be zeroed.
void canonicalize_routing(const Ctx& ctx, const RoutingInput& in, int64_t tokens, int32_t* slot_expert,
                          float* slot_weight, int64_t* counts);

// Posts this rank's plan (header + counts[E], or no counts) to every rank and signals it.
// The header's error fields are taken from ctx.status.
void post_plan(const Ctx& ctx, const PlanHeader& header, const int64_t* counts, int parity);
// Waits for signal `kind` of every rank to reach `target`.
void wait_signals(const Ctx& ctx, int kind, uint64_t target);
// Checks every rank's plan: same call, no rejected input. Fills drop_capacity (when
// capacity_factor > 0, else -1) and per-expert prefix counts of lower ranks [E].
void check_plans(const Ctx& ctx, const PlanHeader& mine, int parity, bool with_counts, double capacity_factor,
                 int64_t* expert_prefix, int64_t* drop_capacity);
// The drop rule on this rank's slots; adds the dropped count to *dropped.
void drop_slots(const Ctx& ctx, int64_t tokens, int32_t* slot_expert, float* slot_weight, const int64_t* expert_prefix,
                const int64_t* drop_capacity, int64_t* dropped);
// send_pos [T*R] and tokens_to_rank [R].
void send_positions(const Ctx& ctx, int64_t tokens, const int32_t* slot_expert, int32_t* send_pos,
                    int64_t* tokens_to_rank);

// The token rows a forward transfer sends.
struct SendRows {
  const char* x = nullptr;  // bf16 rows, or fp8 codes when prequantized
  int64_t x_stride_bytes = 0;
  const float* x_scales = nullptr;  // prequantized fp8 only
  int64_t scales_stride = 0;
  WireFormat wire = WireFormat::bf16;
  float nvfp4_global_scale = 0.0f;
  bool with_meta = true;  // token index, slots and weights travel too (dispatch)
};

// Forward transfer: every token once to every rank holding one of its slots, then signals.
void send_tokens(const Ctx& ctx, const SendRows& rows, int64_t tokens, const int32_t* slot_expert,
                 const float* slot_weight, const int32_t* send_pos, const int64_t* tokens_to_rank);

// Receive side of dispatch, into the handle's receive arrays.
struct RecvArrays {
  int64_t* info;            // [0] rows received M, [1] num_rows, [2] capacity, [3] overflow
  int64_t* rank_offsets;    // [R+1]
  int64_t* tokens_per_expert;  // [L]
  int64_t* expert_offsets;  // [L+1]
  int32_t* src_rank;        // [R*max_tokens]
  int32_t* src_token;
  int32_t* slot_expert;     // [R*max_tokens*K] local expert
  float* slot_weight;
  int64_t* slot_row;        // expert-major row, or rank-major row; -1
};
void receive_layout(const Ctx& ctx, const RecvArrays& r, Layout layout, int64_t alignment, int64_t capacity_rows);

struct RecvOutputs {
  char* x;          // [capacity, x_bytes]
  char* scales;     // [capacity, scale_bytes] or null
  char* global;     // [capacity] f32 or null
  int64_t x_bytes, scale_bytes, global_bytes;
  int32_t* src;     // [capacity, 2]
  float* weights;   // expert-major [capacity]
  int32_t* topk_idx;  // rank-major [capacity, K]
  float* topk_weights;
};
void expand_rows(const Ctx& ctx, const RecvArrays& r, const RecvOutputs& out, Layout layout);

// Reverse transfer for combine (and dispatch_backward): partial sums of y (+ per-slot values
// gathered from slot_values when not null: expert-major [N], rank-major [N, K]).
void combine_send(const Ctx& ctx, const RecvArrays& r, Layout layout, const uint16_t* y, int64_t y_stride, bool weighted,
                  const float* slot_values, int64_t slot_values_stride);
// Source side: out[t] = sum over ranks in order (+ shared); per-slot values into slot_out [T*K].
void combine_reduce(const Ctx& ctx, int64_t tokens, const int32_t* send_pos, const int32_t* slot_expert,
                    const uint16_t* shared, int64_t shared_stride, uint16_t* out, float* slot_out);

// combine_backward on the expert rank: grad_y rows from the forwarded grad_out; with weighted,
// the weight gradients go back to the sources (reverse transfer of slot values only).
void expand_grad(const Ctx& ctx, const RecvArrays& r, Layout layout, bool weighted, const uint16_t* y, int64_t y_stride,
                 uint16_t* grad_y);

// Copies the device status to host-mapped memory (no atomics on host memory).
void publish_status(const Ctx& ctx, DeviceStatus* host_status);

}  // namespace epx::detail::kernels
