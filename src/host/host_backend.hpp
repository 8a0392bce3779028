// The CPU backend: the executable specification of docs/semantics.md.
//
// Every operation runs the same three steps as the GPU design: (1) a plan exchange, where
// each rank publishes its counts and any input error and all ranks agree to go on or to fail
// together; (2) a transfer, where each source writes rows straight into its peers' receive
// areas; (3) the receiver lays the rows out. Barriers separate the steps and time out.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/handle.hpp"
#include "core/replicas.hpp"
#include "core/routing.hpp"
#include "core/wire.hpp"
#include "host/host_group.hpp"

namespace epx::detail {

class HostBackend final : public Backend {
 public:
  HostBackend(const Group& group, const BufferConfig& config);  // collective

  DispatchResult dispatch(const DispatchInput& in, const DispatchOptions& opt) override;
  DispatchResult cached_dispatch(const DispatchInput& in, const Handle& h, const CachedDispatchOptions& opt) override;
  CombineResult combine(const CombineInput& in, const Handle& h, const CombineOptions& opt) override;
  DispatchBackwardResult dispatch_backward(const DispatchBackwardInput& in, const Handle& h) override;
  CombineBackwardResult combine_backward(const CombineBackwardInput& in, const Handle& h,
                                         const CombineOptions& opt) override;
  [[noreturn]] void reject(Op op, const std::string& reason) override;
  Tensor expert_load() const override { return load_; }
  const void* partners() const override { return shared_.get(); }
  void reset_expert_load() override;

 private:
  // One collective call: numbered, so ranks can check they make the same calls in order.
  struct Call {
    std::string name;  // "dispatch #3"
    int64_t index;
  };
  Call begin_call(const char* op);

  // Step 1. Publishes this rank's mailbox (error empty = input fine), waits for every rank,
  // then throws on all ranks alike if any rank's input was bad or the calls disagree.
  // Returns every rank's mailbox.
  std::vector<const Mailbox*> exchange_plan(const Call& call, Mailbox mine);

  void sync(const Call& call, const char* step);
  // Runs `body`; if it throws, breaks the barrier so peers fail fast instead of timing out.
  template <typename F>
  auto guarded(const Call& call, F&& body) -> decltype(body());

  // Dispatch's routing in physical experts: with EPLB, reads the call's replica table and
  // rewrites each slot's logical expert to the replica chosen; returns [T, K] of the choice
  // (empty without EPLB).
  // Adds a dispatch's routed segment counts to the load counters.
  void count_load(const RecvLayout& r);

  // Checks that a handle came from this buffer's dispatch.
  const HandleState& state_of(const Handle& h, const Call& call) const;
  // The start of a call on a dispatch's handle (combine and the backward passes): the handle is
  // checked, the call's signature taken, the inputs validated; then the plans are exchanged, so
  // an error on any rank fails every rank with its message.
  const HandleState& start_handle_call(const Call& call, const Handle& handle,
                                       const std::function<std::string(const HandleState&)>& signature,
                                       const std::function<void(const HandleState&)>& validate);

  // Forward transfer: writes `row_bytes` produced by encode(t, dst) for every (token, rank)
  // pair the handle sends, into the peers' forward areas.
  void push_forward(const HandleState& h, int64_t row_bytes, const std::function<void(int64_t, uint8_t*)>& encode);
  const uint8_t* forward_payload(int64_t src_rank, int64_t pos) const;

  // Reverse transfer: for every received row i, fill(i, row, slots) writes its bf16 partial
  // (if rows) and per-slot values (if slots); the partial goes into the source's reverse area
  // in the form `wire` gives it (encode_partial: bf16 as it is, or quantized to fp8).
  void push_reverse(const HandleState& h, const WireRow& wire, bool rows, bool slots,
                    const std::function<void(int64_t, uint16_t*, float*)>& fill);
  // After a reverse transfer, on the source: [T, H] bf16, each token's returned rows (in the
  // form `wire` gave them, add_partial) summed in rank order from 0, then add_local(t, acc)'s
  // local terms (the shared expert's, shared_out's), fp32, rounded once.
  Tensor sum_returned_rows(const HandleState& h, const WireRow& wire,
                           const std::function<void(int64_t, float*)>& add_local) const;
  // After a reverse transfer with slots, on the source: [T, K] f32 of the per-slot values,
  // each from the rank holding that slot's expert; 0 for unused or dropped slots.
  Tensor gather_slot_values(const HandleState& h) const;

  int rank_;
  int ranks_;
  ReplicaShape replicas_;   // EPLB: P and M; without it P = E
  int64_t local_experts_;   // local physical experts, P / R
  WireRow wire_;
  WireRow combine_wire_;   // how combine's partials cross back (BufferConfig::combine_wire)
  WireRow gradient_wire_;  // dispatch_backward's partials: always bf16 (docs/semantics.md)
  int64_t fwd_row_bytes_;  // max(wire row, bf16 row): gradients travel forward in bf16
  std::chrono::milliseconds timeout_;
  std::shared_ptr<SharedBuffer> shared_;
  int64_t calls_ = 0;
  Tensor load_;  // [L] i64: Buffer::expert_load
};

template <typename F>
auto HostBackend::guarded(const Call& call, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::exception& e) {
    shared_->barrier.abort(call.name + ": rank " + std::to_string(rank_) + " failed: " + e.what());
    throw;
  }
}

}  // namespace epx::detail
