// Buffer: the communication state of one MoE layer shape on one rank. Creating it is
// collective: every rank of the group constructs one, with the same config, in the same order.
#pragma once
#include <memory>
#include <string>

#include "epx/config.hpp"
#include "epx/group.hpp"
#include "epx/ops.hpp"

namespace epx {

namespace detail {
class Backend;
struct AllRanksAccess;
}

class Buffer {
 public:
  Buffer(const Group& group, const BufferConfig& config);
  ~Buffer();
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;

  const BufferConfig& config() const;
  const Group& group() const;

  // CUDA: the stream (cudaStream_t) every later call of this buffer runs on; default: a
  // non-blocking stream the buffer owns. Outputs are allocated and freed stream-ordered on it,
  // so a stream you set must outlive them. The host backend ignores it.
  void set_stream(void* stream);
  // CUDA: waits until every call made so far on this buffer's stream is done (outputs are
  // complete, inputs no longer read: the calls read their inputs on the stream after they return,
  // so free or overwrite an input only after this or an event recorded after the call); the host
  // backend returns at once. Unlike cudaDeviceSynchronize, it never waits
  // on other ranks sharing the GPU.
  void synchronize();
  // CUDA stream semantics in the manner of DeepEP's previous_event / async_finish: later calls
  // wait for `event` (a cudaEvent_t recorded on another stream, e.g. the compute stream), and
  // record_event(e) records e on this buffer's stream after the calls made so far, for another
  // stream to wait on. The host backend ignores both.
  void wait_event(void* event);
  void record_event(void* event);

  // All five are collective: every rank calls them in the same order.
  DispatchResult dispatch(const DispatchInput& in, const DispatchOptions& opt = {});
  // Cached dispatch: the rows of x (same T, new values) once more in the layout of the dispatch
  // that made `handle`, with no routing and no plan exchange (DeepEP's dispatch with a handle;
  // activation recompute). `in` holds x (and x_scales) only. Every rank passes a handle of the
  // same dispatch. recv_x is what that dispatch would return for this x, bit for bit.
  DispatchResult dispatch(const DispatchInput& in, const Handle& handle, const CachedDispatchOptions& opt = {});
  CombineResult combine(const CombineInput& in, const Handle& handle, const CombineOptions& opt = {});
  DispatchBackwardResult dispatch_backward(const DispatchBackwardInput& in, const Handle& handle);
  CombineBackwardResult combine_backward(const CombineBackwardInput& in, const Handle& handle,
                                         const CombineOptions& opt = {});

  // Load of this rank's local (physical) experts: [L] i64 on the backend's device, the (token,
  // slot) rows each received over every dispatch since creation or the last reset_expert_load
  // (after capacity-factor dropping; padding and shared rows not counted; a cached dispatch
  // counts nothing). A view of the buffer's counters, valid as long as the buffer: it shows
  // later calls' counts. Not collective. The CUDA backend counts on the device, stream-ordered:
  // synchronize before reading the view on the host; reset_expert_load is stream-ordered too.
  Tensor expert_load() const;
  void reset_expert_load();

  // For bindings and front ends whose own checks fail before they can build a call's input:
  // takes part in this rank's next collective call `op` as a rank whose input is bad, so every
  // rank fails that same call at once: this rank throws invalid_argument with `reason`, its peers
  // throw peer_failed naming this rank and the reason. The buffer stays usable. Always throws.
  [[noreturn]] void reject(Op op, const std::string& reason);

 private:
  friend struct detail::AllRanksAccess;  // all_ranks.cpp: which buffers were made together
  std::unique_ptr<detail::Backend> backend_;
};

}  // namespace epx
