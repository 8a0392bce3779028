// Host side of the CUDA backend: the protocol every call follows (its start, the plan exchange
// every rank takes part in, refusals, the device's findings raised in the words of the CPU backend).
#include "cuda/cuda_backend.hpp"

#include <cstddef>
#include <cstring>
#include <functional>

#include "core/replicas.hpp"
#include "core/validate.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_handle.hpp"
#include "cuda/replica_errors.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

namespace {

const char* call_kind_name(int32_t kind) {
  switch (kind) {
    case 0: return "dispatch";
    case 1: return "combine";
    case 2: return "dispatch_backward";
    case 3: return "combine_backward";
    case 4: return "cached_dispatch";
  }
  return "an unknown call";
}

// The words for an input error found on the device (same as the CPU backend's).
std::string input_error(int32_t code, int64_t a, int64_t b, int64_t c, const BufferConfig& cfg,
                        const ReplicaShape& replicas) {
  if (code == kStatusNonFinite)  // c: tensor << 32 | the value's fp32 bits
    return cat("dispatch: ", (c >> 32) ? "x_scales[" : "x[", a, "][", b, "] is not finite (",
               nonfinite_name(bits_float(static_cast<uint32_t>(c))), ")");
  if (code == kStatusBadExpert && b == cfg.topk)
    return cat("dispatch: routing_map row ", a, " selects more than topk=", cfg.topk, " experts");
  if (code == kStatusBadExpert)
    return cat("dispatch: topk_idx[", a, ", ", b, "] = ", c, " is out of range; expert ids must be in [0, ",
               cfg.num_experts, ") or -1 for an unused slot");
  if (code == kStatusRepeatedExpert)
    return cat("dispatch: token ", a, " selects expert ", c, " twice (first in slot ", b, "); each expert at most once per token");
  const std::string table = replica_error("dispatch", code, a, b, c, replicas);
  return table.empty() ? cat("error code ", code) : table;
}

}  // namespace

// Stable hash of the options that must agree across ranks.
int64_t call_signature(std::initializer_list<int64_t> values) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

std::string CudaBackend::Call::name() const {
  const std::string own = cat(call_kind_name(kind), " #", unsynced_before ? index + 1 : index);
  return unsynced_before ? cat("the call before ", own, " (it ran without a host sync)") : own;
}

CudaBackend::Call CudaBackend::begin_call(CallKind kind) {
  Call call{kind, calls_, kind == kCachedDispatch};
  if (broken_) fail(ErrorCode::peer_failed, call.name(), " (rank ", rank_, "): the group already failed: ", broken_reason_);
  EPX_CUDA(cudaSetDevice(device_));
  // A blocking call reads the device on the host, which a CUDA graph capture cannot hold: refused
  // before the call counts, so the host's and the device's call numbers stay together.
  if (config().mode == CapacityMode::blocking && capturing(stream_))
    fail(ErrorCode::invalid_argument, call.name(), " (rank ", rank_, "): a blocking-mode call cannot be captured in a ",
         "CUDA graph (it reads the device on the host); capture capacity-mode calls (BufferConfig::mode = "
         "CapacityMode::capacity)");
  check_earlier_calls(call);  // its timeout message tells the earlier call's host steps
  host_steps_.begin();
  // The host's call count and the device's advance together (plan slots are found from either).
  ++calls_;
  if (call.begun_on_device) kernels::begin_call(ctx());
  host_steps_.mark("call begun");
  return call;
}

void CudaBackend::begin_on_device(Call& call) {
  if (call.begun_on_device) return;
  kernels::begin_call(ctx());
  call.begun_on_device = true;
}

// The host-mapped status is the previous call's (published at its end, cleared by this call's
// begin kernel); a failure there was not raised yet when that call ran without a host sync.
void CudaBackend::check_earlier_calls(const Call& call) {
  if (!own_rejection_.empty()) {
    const std::string reason = std::move(own_rejection_);
    own_rejection_.clear();
    fail(ErrorCode::peer_failed, "the call before ", call.name(), " (rank ", rank_, ", it ran without a host sync): rank ",
         rank_, " rejected its input, so the group stops: ", reason);
  }
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  if (st.code == kStatusOk) return;
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  raise(st, Call{call.kind, call.index - 1, true, true});
}

void CudaBackend::raise(const DeviceStatus& st, const Call& call) {
  const std::string who = cat(call.name(), " (rank ", rank_, "): ");
  switch (st.code) {
    case kStatusBadExpert:
    case kStatusRepeatedExpert:
    case kStatusNonFinite:
    case kStatusReplicaOutOfRange:
    case kStatusReplicaRepeated:
    case kStatusReplicaEmptyRow:
      throw Error(ErrorCode::invalid_argument, input_error(st.code, st.a, st.b, st.c, config(), replicas_));
    case kStatusPeerRejected: {
      std::string reason;
      if (st.a == kStatusHostRejected) {
        // A host rejection is posted in the call's first plan exchange (phase 0).
        const char* msg = window_->local() + map_.plans + (call.plan_slot(0) * ranks_ + st.rank) * map_.plan_stride +
                          kPlanMessageAt;
        char text[sizeof(PlanMessage::text)] = {};
        EPX_CUDA(cudaMemcpy(text, msg, sizeof text - 1, cudaMemcpyDeviceToHost));
        reason = text;
      } else if (st.a == kStatusTimeout || st.a == kStatusPeerRejected || st.a == kStatusCallMismatch ||
                 st.a == kStatusReplicaMismatch) {
        // The peer failed for a reason of the group's, not of its input: its own error says which.
        fail(ErrorCode::peer_failed, who, "rank ", st.rank,
             st.a == kStatusTimeout ? " gave up waiting for another rank" : " stopped after another rank failed",
             " (its own error says which), so the group stops");
      } else {
        reason = input_error(static_cast<int32_t>(st.a), st.b, st.c, st.d, config(), replicas_);
      }
      fail(ErrorCode::peer_failed, who, "rank ", st.rank, " rejected its input, so the group stops: ", reason);
    }
    case kStatusCallMismatch:
      fail(ErrorCode::config_mismatch, who, "rank ", st.rank, " is in '", call_kind_name(static_cast<int32_t>(st.a)), " #",
           st.b, "' or uses other options; every rank must make the same collective calls in the same order, with "
           "the same options and handles of the same dispatch");
    case kStatusReplicaMismatch:
      fail(ErrorCode::config_mismatch, who, "rank ", st.rank, " passes another expert_replicas table (their hashes "
           "differ); every rank must pass the same replica table at every dispatch");
    case kStatusTimeout: {
      static const char* steps[] = {"plan exchange", "transfer", "return transfer"};
      broken_ = true;
      broken_reason_ = cat(call.name(), " (", steps[st.a % 3], "): rank ", rank_, " waited ", timeout_.count(),
                           " ms for rank(s) ", st.rank,
                           ", which never arrived (crashed, hung, or called collective operations in a different order; "
                           "its signal here read ", st.c, ", awaited ", st.b,
                           "); this rank's host reached the steps of this call at: ", host_steps_.summary(),
                           "; ", signals_now());
      throw Error(ErrorCode::timeout, broken_reason_);
    }
    default:
      fail(ErrorCode::internal, who, "device reported status ", st.code);
  }
}

// What this rank's signal counters read now, after a wait gave up: a count that arrived after
// all tells a late peer from one that never signalled.
std::string CudaBackend::signals_now() const {
  std::vector<uint64_t> counts(static_cast<size_t>(kSignalKinds) * ranks_);
  if (cudaMemcpy(counts.data(), window_->local() + map_.signals, counts.size() * sizeof(uint64_t),
                 cudaMemcpyDeviceToHost) != cudaSuccess)
    return "its signals could not be read";
  static constexpr const char* kinds[] = {"plan", "forward", "reverse"};
  static_assert(std::size(kinds) == kSignalKinds, "a name for every signal kind");
  std::string text = "its signals from ranks 0.." + std::to_string(ranks_ - 1) + " read now:";
  for (int k = 0; k < kSignalKinds; ++k) {
    text += cat(" ", kinds[k], " [");
    for (int p = 0; p < ranks_; ++p) text += cat(p ? " " : "", counts[static_cast<size_t>(k) * ranks_ + p]);
    text += "]";
  }
  return text;
}

void CudaBackend::sync_and_check(const Call& call) {
  kernels::publish_status(ctx(), host_status_);
  sync_and_raise(call);
}

void CudaBackend::sync_and_raise(const Call& call) {
  EPX_CUDA(cudaStreamSynchronize(stream_));
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  if (st.code == kStatusOk) return;
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  raise(st, call);
}

bool CudaBackend::plan_ok() {
  EPX_CUDA(cudaEventSynchronize(plan_done_));
  // Also what an earlier call published after it returned (its transfer's findings: the stream
  // is past it now): the call then runs on and raises it at its end, with its own.
  return reinterpret_cast<volatile PlanReport*>(plan_report_)->status.code == kStatusOk &&
         reinterpret_cast<volatile DeviceStatus*>(host_status_)->code == kStatusOk;
}

bool CudaBackend::copies_wait_for_plan() const {
  return config().mode == CapacityMode::blocking && copy_combine_ && ranks_ > 1;
}

void CudaBackend::end_call(const Call& call, bool plan_failed, bool published) {
  if (published) {
    if (plan_failed) sync_and_raise(call);
  } else if (plan_failed) {
    sync_and_check(call);
  } else {
    kernels::publish_status(ctx(), host_status_);
  }
}

PlanHeader CudaBackend::plan_header(const Call& call, const std::string& error, int64_t tokens, int64_t signature) const {
  PlanHeader h;
  std::memset(&h, 0, sizeof h);
  h.call_kind = call.kind;
  h.error = error.empty() ? kStatusOk : kStatusHostRejected;
  h.call_index = call.index;
  h.tokens = tokens;
  h.signature = signature;
  return h;
}

void CudaBackend::reject(const Call& call, int phases, const std::string& error, int64_t tokens, int64_t signature) {
  const PlanHeader h = plan_header(call, error, tokens, signature);
  // The peers quote it: a reason longer than the slot ends in "..." (this rank throws it whole).
  PlanMessage message{};
  std::strncpy(message.text, error.c_str(), sizeof message.text - 1);
  if (error.size() > sizeof message.text - 1) std::memcpy(message.text + sizeof message.text - 4, "...", 3);
  for (int phase = 0; phase < phases; ++phase) {  // peers wait for every exchange of the call
    kernels::post_plan(ctx(), h, message, phase, phase == 0 && !call.begun_on_device);
    kernels::wait_signals(ctx(), kSignalPlan, 1, /*wait=*/false);  // keeps this rank's targets in step
  }
  // In capacity mode the peers find the rejection on the device and raise it at their next call
  // (no host sync): this rank's next call raises it too, so that every rank skips that call alike.
  if (config().mode == CapacityMode::capacity) own_rejection_ = error;
  throw Error(ErrorCode::invalid_argument, error);
}

void CudaBackend::reject(Op op, const std::string& reason) {
  static_assert(static_cast<int>(Op::dispatch) == kDispatch && static_cast<int>(Op::combine) == kCombine &&
                static_cast<int>(Op::dispatch_backward) == kDispatchBackward &&
                static_cast<int>(Op::combine_backward) == kCombineBackward &&
                static_cast<int>(Op::cached_dispatch) == kCachedDispatch);
  Call call = begin_call(static_cast<CallKind>(op));
  // A dispatch with dropping has two plan exchanges; peers wait for both (dispatch()).
  const int phases = op == Op::dispatch && config().capacity_factor > 0.0 ? 2 : 1;
  if (op == Op::dispatch && broadcast_) {  // as dispatch() does
    begin_on_device(call);
    kernels::release_broadcast(ctx());
  }
  reject(call, phases, reason, 0, call_signature({-1}));
}

kernels::ExchangeJob CudaBackend::exchange_job(const Call& call, int phase, int64_t tokens, int64_t signature,
                                               const int64_t* counts, int64_t count_len, int64_t* expert_prefix,
                                               int64_t* drop_capacity, const kernels::LayoutJob* layout,
                                               const int64_t* dropped) const {
  kernels::ExchangeJob j;
  j.header = plan_header(call, "", tokens, signature);
  j.counts = counts;
  j.count_len = counts ? count_len : 0;
  j.phase = phase;
  j.begins_call = phase == 0 && !call.begun_on_device;
  j.with_counts = expert_prefix != nullptr;
  j.capacity_factor = expert_prefix ? config().capacity_factor : 0.0;
  j.expert_prefix = expert_prefix;
  j.drop_capacity = drop_capacity ? drop_capacity : scratch_;
  if (layout) {
    j.with_layout = true;
    j.layout = *layout;
  }
  // The drop rule's exchange (expert_prefix) is not the call's last. The kernel writes every field of
  // the report's status (plan_ok reads it after plan_done_, recorded behind this launch); the clear
  // is only a belt, harmless even while an earlier call's kernel still runs (it writes before this one).
  if (config().mode == CapacityMode::blocking && expert_prefix == nullptr) {
    std::memset(&plan_report_->status, 0, sizeof(DeviceStatus));
    j.report = {plan_report_, dropped};
  }
  return j;
}

void CudaBackend::exchanged(const kernels::ExchangeJob& job) {
  if (job.report.to) EPX_CUDA(cudaEventRecord(plan_done_, stream_));
}

void CudaBackend::exchange_plan(const Call& call, int64_t tokens, int64_t signature) {
  const kernels::ExchangeJob job = exchange_job(call, 0, tokens, signature, nullptr, 0);
  kernels::exchange_plan(ctx(), job);
  exchanged(job);
}

const HandleState& CudaBackend::state_of(const Handle& h, const Call& call) const {
  require(h.valid(), call.name(), ": the handle is empty; pass the handle returned by dispatch");
  require(h.state().owner == this, call.name(),
          ": the handle belongs to another buffer or rank; pass the handle this buffer's dispatch returned");
  return h.state();
}

const HandleState& CudaBackend::start_handle_call(const Call& call, const Handle& handle, int64_t options,
                                                  const std::function<void(const HandleState&)>& validate) {
  std::string error;
  const HandleState* h = nullptr;
  try {
    h = &state_of(handle, call);
    validate(*h);
  } catch (const Error& e) {
    error = e.what();
  }
  // The handle's dispatch is part of what must agree (handle.hpp: dispatch_call).
  const int64_t signature =
      call_signature({options, h ? static_cast<int64_t>(h->layout) : -1, h ? h->dispatch_call : -1});
  if (!error.empty()) reject(call, 1, error, h ? h->tokens : 0, signature);
  exchange_plan(call, h->tokens, signature);
  host_steps_.mark("plan posted");
  return *h;
}

}  // namespace epx::detail
