#include "bench/staging.hpp"

#include <cstring>

#include "verify/reference.hpp"

#ifdef EPX_HAS_CUDA
#include <cuda_runtime.h>

#include "epx/cuda.hpp"
#endif

namespace epx::bench {

#ifndef EPX_HAS_CUDA
namespace {
[[noreturn]] void no_cuda() { throw Error(ErrorCode::unsupported, "epx-bench: this build has no CUDA backend"); }
}  // namespace
#endif

Staging::Staging(int device) : device_(device) {
  if (device_ < 0) return;
#ifdef EPX_HAS_CUDA
  cudaSetDevice(device_);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  stream_ = s;
  for (auto& e : events_) {
    cudaEvent_t ev;
    cudaEventCreate(&ev);
    e = ev;
  }
#else
  no_cuda();
#endif
}

Staging::~Staging() {
#ifdef EPX_HAS_CUDA
  if (device_ < 0) return;
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  keep_.clear();
  for (auto e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (graph_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

TensorView Staging::place(const void* data, size_t bytes, DType dtype, std::initializer_list<int64_t> shape) {
  if (device_ < 0) return TensorView::of(const_cast<void*>(data), dtype, shape);
#ifdef EPX_HAS_CUDA
  void* p = nullptr;
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) throw Error(ErrorCode::internal, "epx-bench: cudaMalloc failed");
  cudaMemcpy(p, data, bytes, cudaMemcpyHostToDevice);
  keep_.emplace_back(p, [](void* q) { cudaFree(q); });
  return TensorView::of(p, dtype, shape, DeviceKind::cuda, device_);
#else
  (void)bytes;
  no_cuda();
#endif
}

void Staging::synchronize() const {
#ifdef EPX_HAS_CUDA
  if (device_ >= 0) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
#endif
}

Tensor Staging::fetch(const Tensor& t) const {
#ifdef EPX_HAS_CUDA
  synchronize();
  return epx::to_host(t);
#else
  return t;
#endif
}

DispatchResult Staging::fetch(const DispatchResult& d) const {
  // The device state stays with the caller's copy (freed on this stream).
  return verify::host_copy(d, [this](const Tensor& t) { return fetch(t); });
}

LowLatencyDispatchResult Staging::fetch(const LowLatencyDispatchResult& d) const {
  LowLatencyDispatchResult h = d;
  for (Tensor* t : {&h.recv_x, &h.recv_scales, &h.recv_global_scale, &h.recv_count, &h.recv_src, &h.recv_layout,
                    &h.topk_physical})
    *t = fetch(*t);
  return h;
}

void Staging::start() {
#ifdef EPX_HAS_CUDA
  if (device_ >= 0) {
    cudaEventRecord(static_cast<cudaEvent_t>(events_[0]), static_cast<cudaStream_t>(stream_));
    return;
  }
#endif
  t0_ = std::chrono::steady_clock::now();
}

void Staging::stop() {
#ifdef EPX_HAS_CUDA
  if (device_ >= 0) {
    cudaEventRecord(static_cast<cudaEvent_t>(events_[1]), static_cast<cudaStream_t>(stream_));
    return;
  }
#endif
  t1_ = std::chrono::steady_clock::now();
}

double Staging::elapsed_us() {
#ifdef EPX_HAS_CUDA
  if (device_ >= 0) {
    float ms = 0.0f;
    cudaEventSynchronize(static_cast<cudaEvent_t>(events_[1]));
    cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[0]), static_cast<cudaEvent_t>(events_[1]));
    return 1000.0 * ms;
  }
#endif
  return std::chrono::duration<double, std::micro>(t1_ - t0_).count();
}

void Staging::capture(int calls, const std::function<void()>& call) {
#ifdef EPX_HAS_CUDA
  auto stream = static_cast<cudaStream_t>(stream_);
  if (graph_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_));
  graph_ = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
    throw Error(ErrorCode::internal, "epx-bench: cudaStreamBeginCapture failed");
  try {
    for (int i = 0; i < calls; ++i) call();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  // Uploaded here, not by the first launch, so no replay pays for the upload's allocation.
  const bool ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess &&
                  cudaGraphUpload(exec, stream) == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess;
  if (graph) cudaGraphDestroy(graph);
  if (!ok) throw Error(ErrorCode::internal, "epx-bench: capturing the calls in a CUDA graph failed");
  graph_ = exec;
#else
  (void)calls;
  (void)call;
  no_cuda();
#endif
}

double Staging::replay_us() {
#ifdef EPX_HAS_CUDA
  start();
  if (cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_), static_cast<cudaStream_t>(stream_)) != cudaSuccess)
    throw Error(ErrorCode::internal, "epx-bench: cudaGraphLaunch failed");
  stop();
  return elapsed_us();
#else
  no_cuda();
#endif
}

}  // namespace epx::bench
