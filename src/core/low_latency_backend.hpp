// The interface of a low-latency backend, and the handle state every backend shares.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "core/creation.hpp"
#include "core/replicas.hpp"
#include "core/timeout.hpp"
#include "core/validate.hpp"
#include "core/wire.hpp"
#include "epx/group.hpp"
#include "epx/low_latency.hpp"

namespace epx::detail {

struct LowLatencyHandleState {
  const void* owner = nullptr;
  int set = 0;             // CUDA backend: the buffer set of the dispatch
  int64_t tokens = 0;      // T of this rank's dispatch
  int64_t num_tokens = 0;  // rows that counted (num_tokens, or T)
  std::vector<int32_t> slot_expert;  // [T*K] this rank's routing (-1 unused, and for rows >= num_tokens)
  bool weights_at_dispatch = false;   // ll_dispatch took the combine's weights
  std::vector<float> dispatch_weights;  // CPU backend: [T*K] those weights
  Tensor topk_physical;                 // CPU backend, EPLB: [T, K] the choice, until dispatch_recv returns it
  bool has_shared_gate = false;         // shared_expert: ll_dispatch took a shared_gate
  std::vector<float> shared_weight;     // CPU backend, shared_expert: [T] each token's shared-row weight (1 without a gate)
  // Receiver side: for each row (l, j < count[l]) of the dispatch output, where it came from.
  std::vector<int32_t> recv_count;   // [L]
  std::vector<int32_t> src_rank;     // [L * R * M]
  std::vector<int32_t> src_token;
  std::vector<int32_t> src_slot;
};

class LowLatencyBackend {
 public:
  LowLatencyBackend(const Group& group, const LowLatencyConfig& c)
      : group_(group),
        rank_(group.rank()),
        ranks_(group.size()),
        local_(physical_experts(c.num_experts, c.num_physical_experts) / group.size()),
        replicas_(replica_shape(c.num_experts, c.num_physical_experts, c.max_replicas, group.size(),
                                "low-latency buffer")),
        slots_(group.size() * c.max_tokens_per_rank),
        first_routed_(c.shared_expert ? 1 : 0),
        segments_(first_routed_ + local_),
        wire_(wire_row(c.wire, c.hidden)),
        timeout_(creation_timeout(c.timeout_ms)),  // a bad EPX_TIMEOUT_MS is one of the checks agreed on
        config_(c) {}
  virtual ~LowLatencyBackend() = default;
  const LowLatencyConfig& config() const { return config_; }
  const Group& group() const { return group_; }

  // As Backend::partners: shared with the peers' buffers made together, or null where unknown.
  virtual const void* partners() const { return nullptr; }
  virtual void dispatch_send(const LowLatencyDispatchInput& in) = 0;
  virtual LowLatencyDispatchResult dispatch_recv() = 0;
  virtual void combine_send(const LowLatencyCombineInput& in, const LowLatencyHandle& h) = 0;
  virtual Tensor combine_recv() = 0;
  // The fused forms; a backend may run them as one step.
  virtual LowLatencyDispatchResult dispatch(const LowLatencyDispatchInput& in) {
    dispatch_send(in);
    return dispatch_recv();
  }
  virtual Tensor combine(const LowLatencyCombineInput& in, const LowLatencyHandle& h) {
    combine_send(in, h);
    return combine_recv();
  }
  // LowLatencyBuffer::expert_load / reset_expert_load.
  virtual Tensor expert_load() const = 0;
  virtual void reset_expert_load() = 0;
  virtual void set_stream(void* /*stream*/) {}
  virtual void synchronize() {}
  // LowLatencyBuffer::reject: the send half of call `op` with its checks failing with `reason`
  // (take_rejection), so it fails on every rank as any refused input does. Always throws.
  [[noreturn]] void reject(LowLatencyOp op, const std::string& reason) {
    rejection_ = reason.empty() ? std::string("rejected by the caller") : reason;
    if (op == LowLatencyOp::dispatch) dispatch_send({});
    else combine_send({}, {});
    fail(ErrorCode::internal, "LowLatencyBuffer::reject: the refused call went on");
  }

 protected:
  // The first of a send half's checks: a pending rejection fails them with its reason.
  void take_rejection() {
    if (rejection_.empty()) return;
    const std::string reason = std::move(rejection_);
    rejection_.clear();
    throw Error(ErrorCode::invalid_argument, reason);
  }

  // The combine's weights, where a call gives them: [T, K] f32 at ll_dispatch (optional), or at a
  // weighted ll_combine unless its dispatch took them (then none: one place says what they are).
  void check_dispatch_weights(const LowLatencyDispatchInput& in, int64_t tokens, DeviceKind kind) const {
    if (in.topk_weights.defined())
      check_tensor(in.topk_weights, "ll_dispatch: topk_weights", cat("[T=", tokens, ", K=", config_.topk, "]"), DType::f32,
                   {tokens, config_.topk}, kind);
    if (!config_.shared_expert) {
      require(!in.shared_gate.defined(), "ll_dispatch: shared_gate given but the buffer has no shared expert; create "
              "it with shared_expert=true or drop shared_gate");
      return;
    }
    if (in.shared_gate.defined())
      check_tensor(in.shared_gate, "ll_dispatch: shared_gate", cat("[T=", tokens, "]"), DType::f32, {tokens}, kind);
  }
  void check_combine_weights(const LowLatencyCombineInput& in, const LowLatencyHandleState& h, DeviceKind kind) const {
    require(in.weighted || !h.has_shared_gate, "ll_combine: this handle's ll_dispatch took a shared_gate, which "
            "only a weighted combine applies; combine weighted, or dispatch without the gate");
    if (!in.weighted) return;
    if (h.weights_at_dispatch) {
      require(!in.topk_weights.defined(),
              "ll_combine: topk_weights were given to this handle's ll_dispatch, which sent them with the routing; "
              "pass none here");
      return;
    }
    check_tensor(in.topk_weights, "ll_combine: topk_weights",
                 cat("[T=", h.tokens, ", K=", config_.topk, "] (or given to ll_dispatch)"), DType::f32,
                 {h.tokens, config_.topk}, kind);
  }

  const Group group_;
  const int rank_, ranks_;
  const int64_t local_;  // local (physical) experts L
  const ReplicaShape replicas_;  // EPLB: P and M (replicas_.enabled() when on)
  const int64_t slots_;  // receive rows per expert R * M
  const int64_t first_routed_;  // the outputs' first routed expert: 1 with the shared expert, else 0
  const int64_t segments_;      // the outputs' experts: the shared one (if any), then the L routed ones
  const WireRow wire_;
  const std::chrono::milliseconds timeout_;
  int64_t dispatch_calls_ = 0, combine_calls_ = 0;  // calls so far (call n uses buffer set n % 2)

 private:
  LowLatencyConfig config_;
  std::string rejection_;  // reject(): the reason the next send half's checks fail with
};

std::unique_ptr<LowLatencyBackend> make_host_low_latency(const Group& group, const LowLatencyConfig& config);
std::unique_ptr<LowLatencyBackend> make_cuda_low_latency(const Group& group, const LowLatencyConfig& config);

}  // namespace epx::detail
