// Low-latency mode, for decode: a fixed maximum of tokens per rank, per-expert receive buffers
// [L, R * max_tokens, H], and dispatch/combine split into a send half and a receive half so the
// caller can compute in between. docs/low-latency.md is the contract.
#pragma once
#include <cstdint>
#include <memory>

#include "epx/config.hpp"
#include "epx/group.hpp"
#include "epx/tensor.hpp"

namespace epx {

struct LowLatencyConfig {
  int64_t hidden = 0;
  int64_t max_tokens_per_rank = 0;  // M: the most tokens any rank passes to one call
  int64_t num_experts = 0;          // E, a multiple of the group size
  int64_t topk = 0;
  WireFormat wire = WireFormat::bf16;
  int64_t timeout_ms = 0;           // 0 = EPX_TIMEOUT_MS or 60000
  // ll_dispatch refuses x holding a NaN or an infinity in a row that counts (t < num_tokens), as
  // BufferConfig::check_finite; the CUDA backend scans on the device, and (like a bad expert id)
  // the next call raises it on every rank.
  bool check_finite = false;
  // The fused shared expert, as BufferConfig's: ll_dispatch's outputs get one more leading
  // expert, the shared one, holding this rank's own tokens (rows 0..num_tokens-1), and
  // ll_combine adds its output row after the routed ones. Both backends.
  // docs/low-latency.md.
  bool shared_expert = false;
  // As BufferConfig::combine_wire: each (token, rank) partial of ll_combine crosses back as bf16,
  // or quantized to fp8 / fp8_ue8m0. docs/low-latency.md.
  WireFormat combine_wire = WireFormat::bf16;
  // Redundant experts (EPLB), as BufferConfig's: P physical experts, M replica columns.
  int64_t num_physical_experts = 0;
  int64_t max_replicas = 0;
};
// One line with every field, used to compare configs across ranks and in messages.
std::string describe(const LowLatencyConfig& c);

struct LowLatencyDispatchInput {
  TensorView x;            // [T, H] bf16, T <= M
  TensorView topk_idx;     // [T, K] i32 or i64, -1 = unused slot
  TensorView num_tokens;   // optional [1] i32: only the first num_tokens rows count (read where the data lives)
  float nvfp4_global_scale = 0.0f;  // as DispatchOptions: 0 = per token
  // Optional [T, K] f32: the weights a weighted ll_combine of this dispatch sums with, given now so
  // they travel with the routing and the combine waits for nothing but the expert outputs (its own
  // topk_weights then stay empty). docs/low-latency.md.
  TensorView topk_weights;
  // [E, M] i32 with num_physical_experts > 0 (refused otherwise), as DispatchInput's.
  TensorView expert_replicas;
  // Optional [T] f32 with shared_expert: the weight of token t's shared row in a weighted
  // ll_combine (1 without it).
  TensorView shared_gate;
};

namespace detail {
struct LowLatencyHandleState;
}

// What ll_dispatch learned; ll_combine reuses it. Valid with the buffer that made it.
class LowLatencyHandle {
 public:
  LowLatencyHandle() = default;
  explicit LowLatencyHandle(std::shared_ptr<const detail::LowLatencyHandleState> s) : state_(std::move(s)) {}
  bool valid() const { return state_ != nullptr; }
  const detail::LowLatencyHandleState& state() const { return *state_; }
  const std::shared_ptr<const detail::LowLatencyHandleState>& state_ptr() const { return state_; }

 private:
  std::shared_ptr<const detail::LowLatencyHandleState> state_;
};

struct LowLatencyDispatchResult {
  // With shared_expert every leading [L] is [1 + L], the shared expert first.
  Tensor recv_x;             // [L, R*M, H] bf16 | [L, R*M, H] fp8_e4m3 | [L, R*M, H/2] e2m1x2
  Tensor recv_scales;        // fp8: [L, R*M, H/128] f32; nvfp4: [L, R*M, H/16] fp8_e4m3
  Tensor recv_global_scale;  // nvfp4: [L, R*M] f32, 1/g of each row
  Tensor recv_count;         // [L] i32: rows of each local expert (rows past it are zero)
  Tensor recv_src;           // [L, R*M, 2] i32 (source rank, source token); (-1, -1) past the count
  Tensor recv_layout;        // [L, R, 2] i32 (first row, rows) of each source rank in each expert
  Tensor topk_physical;      // EPLB: [T, K] i32 the physical expert chosen for each slot (-1 unused); else empty
  LowLatencyHandle handle;
};

struct LowLatencyCombineInput {
  TensorView y;             // [L, R*M, H] bf16 ([1 + L, ...] with shared_expert): expert outputs, rows as dispatched
  TensorView topk_weights;  // [T, K] f32 (weighted combine), the dispatch's T; empty when ll_dispatch took them
  bool weighted = true;     // false: plain sum of the expert rows
};

namespace detail {
class LowLatencyBackend;
struct AllRanksAccess;
}

// The collective calls of a LowLatencyBuffer, for LowLatencyBuffer::reject.
enum class LowLatencyOp : int32_t { dispatch = 0, combine = 1 };

// Collective to create (every rank, same config, same order as other buffers). Calls are
// collective too. At most two calls of each kind may be in flight: the receive half of call n
// must run before the send half of call n + 2 (two buffer sets alternate).
class LowLatencyBuffer {
 public:
  LowLatencyBuffer(const Group& group, const LowLatencyConfig& config);
  ~LowLatencyBuffer();
  LowLatencyBuffer(LowLatencyBuffer&&) noexcept;
  LowLatencyBuffer& operator=(LowLatencyBuffer&&) noexcept;

  const LowLatencyConfig& config() const;
  const Group& group() const;

  // Fused forms: send then receive.
  LowLatencyDispatchResult dispatch(const LowLatencyDispatchInput& in);
  Tensor combine(const LowLatencyCombineInput& in, const LowLatencyHandle& handle);  // [T, H] bf16

  // CUDA: the stream the calls run on (a cudaStream_t; null: the buffer's own), e.g. one being
  // captured into a CUDA graph; and a wait for the calls so far. The CPU backend ignores both.
  void set_stream(void* stream);
  void synchronize();

  // As Buffer::expert_load / reset_expert_load: [L] i64 rows received per local (physical)
  // expert over every ll_dispatch since creation or the last reset (recv_count summed).
  Tensor expert_load() const;
  void reset_expert_load();

  // Split forms. The send half returns at once; the receive half waits for every peer.
  void dispatch_send(const LowLatencyDispatchInput& in);
  LowLatencyDispatchResult dispatch_recv();
  void combine_send(const LowLatencyCombineInput& in, const LowLatencyHandle& handle);
  Tensor combine_recv();

  // For bindings and front ends whose own checks fail before they can build a call's input:
  // takes part in this rank's next call `op` (its send half) as a rank whose input is bad, so
  // every rank fails that call at once: this rank throws invalid_argument with `reason`, its
  // peers throw peer_failed naming this rank (and quoting the reason on the CPU backend; the CUDA
  // low-latency window carries no message). The call uses its buffer set as any call does. The
  // buffer stays usable. Always throws.
  [[noreturn]] void reject(LowLatencyOp op, const std::string& reason);

 private:
  friend struct detail::AllRanksAccess;  // all_ranks.cpp: which buffers were made together
  std::unique_ptr<detail::LowLatencyBackend> backend_;
};

}  // namespace epx
