// The interface every backend implements; Buffer forwards to it.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "epx/buffer.hpp"

namespace epx::detail {

struct GroupState {
  virtual ~GroupState() = default;
  // Collective, for buffer creation (core/creation.hpp): every rank's `record` (a few hundred
  // bytes), in rank order; the k-th call of each rank meets the k-th call of the others. Throws
  // Error(timeout) naming `what` when not every rank arrives within `timeout`.
  virtual std::vector<std::string> all_gather(int rank, const std::string& record, std::chrono::milliseconds timeout,
                                              std::string_view what) = 0;
};

class Backend {
 public:
  Backend(const Group& group, const BufferConfig& config) : group_(group), config_(config) {}
  virtual ~Backend() = default;

  const Group& group() const { return group_; }
  const BufferConfig& config() const { return config_; }

  virtual DispatchResult dispatch(const DispatchInput& in, const DispatchOptions& opt) = 0;
  virtual DispatchResult cached_dispatch(const DispatchInput& in, const Handle& h, const CachedDispatchOptions& opt) = 0;
  virtual CombineResult combine(const CombineInput& in, const Handle& h, const CombineOptions& opt) = 0;
  virtual DispatchBackwardResult dispatch_backward(const DispatchBackwardInput& in, const Handle& h) = 0;
  virtual CombineBackwardResult combine_backward(const CombineBackwardInput& in, const Handle& h,
                                                 const CombineOptions& opt) = 0;
  // Buffer::reject: posts `reason` as this rank's input error in the next call `op`, then throws.
  [[noreturn]] virtual void reject(Op op, const std::string& reason) = 0;
  // Buffer::expert_load / reset_expert_load: the per-local-expert load counters.
  virtual Tensor expert_load() const = 0;
  virtual void reset_expert_load() = 0;
  // An object this buffer shares with its peers' (the buffers created together, one per rank), or
  // null where the backend cannot tell (dispatch_all refuses buffers that were not made together).
  virtual const void* partners() const { return nullptr; }
  virtual void set_stream(void*) {}
  virtual void synchronize() {}
  virtual void wait_event(void*) {}
  virtual void record_event(void*) {}

 private:
  Group group_;
  BufferConfig config_;
};

std::unique_ptr<Backend> make_host_backend(const Group& group, const BufferConfig& config);
std::unique_ptr<Backend> make_cuda_backend(const Group& group, const BufferConfig& config);

}  // namespace epx::detail
