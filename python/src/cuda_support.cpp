#include "cuda_support.hpp"

#include <algorithm>

#ifdef EPX_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epx::python {

namespace {

#ifdef EPX_HAS_CUDA
// The streams that may reuse the memory and are not the consumer, each once.
std::vector<void*> waiting_streams(const StreamOrder& o) {
  std::vector<void*> streams;
  for (void* s : {o.producer, o.buffer_stream ? o.buffer_stream->load() : nullptr})
    if (s && s != o.consumer && std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
  return streams;
}

// Best effort: a destructor cannot throw, and an error here (e.g. at interpreter exit, with CUDA
// torn down) leaves nothing better to do than to release.
void order_after_consumer(const StreamOrder& o, const std::vector<void*>& streams) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(o.device);
  auto consumer = static_cast<cudaStream_t>(o.consumer);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaEvent_t used = nullptr;
  if (cudaStreamIsCapturing(consumer, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone &&
      cudaEventCreateWithFlags(&used, cudaEventDisableTiming) == cudaSuccess) {
    if (cudaEventRecord(used, consumer) == cudaSuccess)
      for (void* s : streams) cudaStreamWaitEvent(static_cast<cudaStream_t>(s), used, 0);
    cudaEventDestroy(used);  // its resources go once it completes
  }
  cudaGetLastError();  // nothing to report it to
  cudaSetDevice(previous);
}
#endif

struct OutputGuard {
  std::vector<Tensor> outputs;
  StreamOrder order;

  ~OutputGuard() {
#ifdef EPX_HAS_CUDA
    if (order.consumer) {
      const std::vector<void*> streams = waiting_streams(order);
      if (!streams.empty()) order_after_consumer(order, streams);
    }
#endif
    outputs.clear();  // now their memory may go back
  }
};

}  // namespace

std::shared_ptr<void> guard_outputs(std::vector<Tensor> outputs, const StreamOrder& order) {
  auto guard = std::make_shared<OutputGuard>();
  guard->outputs = std::move(outputs);
  guard->order = order;
  return guard;
}

#ifdef EPX_HAS_CUDA
RelaxedCapture::RelaxedCapture() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  previous_ = static_cast<int>(mode);
}
RelaxedCapture::~RelaxedCapture() {
  auto mode = static_cast<cudaStreamCaptureMode>(previous_);
  cudaThreadExchangeStreamCaptureMode(&mode);
}
#else
RelaxedCapture::RelaxedCapture() = default;
RelaxedCapture::~RelaxedCapture() = default;
#endif

}  // namespace epx::python
