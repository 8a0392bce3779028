#include "epx/buffer.hpp"

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/creation.hpp"
#include "core/routing.hpp"

namespace epx {

Buffer::Buffer(const Group& group, const BufferConfig& config) {
  detail::require(group.state() != nullptr, "buffer: the group is empty; make it with HostWorld::group (or a CUDA group)");
  // Every rank takes part in the creation's agreement exactly once: here when its config is
  // invalid (every rank then fails with the reason), else in its backend's constructor, after
  // the backend's own checks.
  try {
    detail::validate_config(config, group.size());
  } catch (const Error& e) {
    detail::agree_on_creation(group, "buffer", describe(config), e.what(), config.timeout_ms, e.code());
  }
  switch (group.backend()) {
    case BackendKind::host: backend_ = detail::make_host_backend(group, config); break;
    case BackendKind::cuda:
#ifdef EPX_HAS_CUDA
      backend_ = detail::make_cuda_backend(group, config);
#else
      detail::fail(ErrorCode::unsupported, "buffer: this build of epx has no CUDA backend");
#endif
      break;
  }
}

Buffer::~Buffer() = default;
Buffer::Buffer(Buffer&&) noexcept = default;
Buffer& Buffer::operator=(Buffer&&) noexcept = default;

const BufferConfig& Buffer::config() const { return backend_->config(); }
const Group& Buffer::group() const { return backend_->group(); }
void Buffer::set_stream(void* stream) { backend_->set_stream(stream); }
void Buffer::synchronize() { backend_->synchronize(); }
void Buffer::wait_event(void* event) { backend_->wait_event(event); }
void Buffer::record_event(void* event) { backend_->record_event(event); }

DispatchResult Buffer::dispatch(const DispatchInput& in, const DispatchOptions& opt) {
  return backend_->dispatch(in, opt);
}
DispatchResult Buffer::dispatch(const DispatchInput& in, const Handle& h, const CachedDispatchOptions& opt) {
  return backend_->cached_dispatch(in, h, opt);
}
CombineResult Buffer::combine(const CombineInput& in, const Handle& h, const CombineOptions& opt) {
  return backend_->combine(in, h, opt);
}
DispatchBackwardResult Buffer::dispatch_backward(const DispatchBackwardInput& in, const Handle& h) {
  return backend_->dispatch_backward(in, h);
}
CombineBackwardResult Buffer::combine_backward(const CombineBackwardInput& in, const Handle& h,
                                               const CombineOptions& opt) {
  return backend_->combine_backward(in, h, opt);
}

Tensor Buffer::expert_load() const { return backend_->expert_load(); }
void Buffer::reset_expert_load() { backend_->reset_expert_load(); }

void Buffer::reject(Op op, const std::string& reason) {
  backend_->reject(op, reason);
  detail::fail(ErrorCode::internal, "Buffer::reject: the backend returned");  // it always throws
}

}  // namespace epx
