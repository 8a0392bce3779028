#include "core/check.hpp"
#include "core/creation.hpp"
#include "core/low_latency_backend.hpp"
#include "core/replicas.hpp"
#include "core/wire.hpp"
#include "epx/codec.hpp"

namespace epx {

std::string describe(const LowLatencyConfig& c) {
  return detail::cat("hidden=", c.hidden, " max_tokens_per_rank=", c.max_tokens_per_rank, " num_experts=", c.num_experts,
                     " topk=", c.topk, " wire=", wire_name(c.wire), " timeout_ms=", c.timeout_ms,
                     " check_finite=", c.check_finite ? 1 : 0, " shared_expert=", c.shared_expert ? 1 : 0,
                     " combine_wire=", wire_name(c.combine_wire), " num_physical_experts=", c.num_physical_experts,
                     " max_replicas=", detail::resolved_max_replicas(c.num_experts, c.num_physical_experts,
                                                                     c.max_replicas));
}

namespace {
void validate(const LowLatencyConfig& c, int ranks) {
  using detail::require;
  require(c.hidden > 0, "low-latency buffer: hidden must be > 0");
  require(c.max_tokens_per_rank > 0, "low-latency buffer: max_tokens_per_rank must be > 0");
  require(c.num_experts > 0 && (c.num_physical_experts > 0 || c.num_experts % ranks == 0),
          "low-latency buffer: num_experts (", c.num_experts,
          ") must be a positive multiple of the group size (", ranks, ")");
  require(c.topk >= 1 && c.topk <= c.num_experts && c.topk <= 64, "low-latency buffer: topk must be in [1, min(64, E)], got ",
          c.topk);
  require(c.timeout_ms >= 0, "low-latency buffer: timeout_ms must be >= 0");
  if (c.wire == WireFormat::fp8 || c.wire == WireFormat::fp8_ue8m0)
    require(c.hidden % kFp8Block == 0, "low-latency buffer: wire ", wire_name(c.wire), " needs hidden to be a multiple of ",
            kFp8Block, ", got ", c.hidden);
  if (c.wire == WireFormat::nvfp4)
    require(c.hidden % kNvfp4Block == 0, "low-latency buffer: wire nvfp4 needs hidden to be a multiple of ", kNvfp4Block,
            ", got ", c.hidden);
  detail::validate_combine_wire(c.combine_wire, c.hidden, "low-latency buffer");
  detail::replica_shape(c.num_experts, c.num_physical_experts, c.max_replicas, ranks, "low-latency buffer");
}
}  // namespace

LowLatencyBuffer::LowLatencyBuffer(const Group& group, const LowLatencyConfig& config) {
  detail::require(group.state() != nullptr, "low-latency buffer: the group is empty");
  // As Buffer's: every rank agrees once, here if its config is invalid, else in its backend.
  try {
    validate(config, group.size());
  } catch (const Error& e) {
    detail::agree_on_creation(group, "low-latency buffer", describe(config), e.what(), config.timeout_ms, e.code());
  }
  if (group.backend() == BackendKind::host) {
    backend_ = detail::make_host_low_latency(group, config);
    return;
  }
#ifdef EPX_HAS_CUDA
  backend_ = detail::make_cuda_low_latency(group, config);
#else
  detail::fail(ErrorCode::unsupported, "low-latency buffer: this build of epx has no CUDA backend");
#endif
}

LowLatencyBuffer::~LowLatencyBuffer() = default;
LowLatencyBuffer::LowLatencyBuffer(LowLatencyBuffer&&) noexcept = default;
LowLatencyBuffer& LowLatencyBuffer::operator=(LowLatencyBuffer&&) noexcept = default;

const LowLatencyConfig& LowLatencyBuffer::config() const { return backend_->config(); }
const Group& LowLatencyBuffer::group() const { return backend_->group(); }

LowLatencyDispatchResult LowLatencyBuffer::dispatch(const LowLatencyDispatchInput& in) {
  return backend_->dispatch(in);
}

Tensor LowLatencyBuffer::combine(const LowLatencyCombineInput& in, const LowLatencyHandle& handle) {
  return backend_->combine(in, handle);
}

void LowLatencyBuffer::dispatch_send(const LowLatencyDispatchInput& in) { backend_->dispatch_send(in); }
LowLatencyDispatchResult LowLatencyBuffer::dispatch_recv() { return backend_->dispatch_recv(); }
void LowLatencyBuffer::combine_send(const LowLatencyCombineInput& in, const LowLatencyHandle& handle) {
  backend_->combine_send(in, handle);
}
Tensor LowLatencyBuffer::combine_recv() { return backend_->combine_recv(); }
Tensor LowLatencyBuffer::expert_load() const { return backend_->expert_load(); }
void LowLatencyBuffer::reset_expert_load() { backend_->reset_expert_load(); }
void LowLatencyBuffer::set_stream(void* stream) { backend_->set_stream(stream); }
void LowLatencyBuffer::synchronize() { backend_->synchronize(); }

void LowLatencyBuffer::reject(LowLatencyOp op, const std::string& reason) {
  backend_->reject(op, reason);
  detail::fail(ErrorCode::internal, "LowLatencyBuffer::reject: the backend returned");  // it always throws
}

}  // namespace epx
