// Where a rank's inputs live and how its results come back, per backend: host memory as is,
// or device copies (CUDA). Also the per-rank timer: wall clock on the host, CUDA events on GPUs.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "epx/epx.hpp"

namespace epx::bench {

class Staging {
 public:
  // device < 0: host backend.
  explicit Staging(int device);
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  // A view of `data` where the backend reads it (copied to the GPU once for CUDA).
  template <typename T>
  TensorView view(const std::vector<T>& data, DType dtype, std::initializer_list<int64_t> shape) {
    return place(data.data(), data.size() * sizeof(T), dtype, shape);
  }
  // Host copies of every output tensor.
  DispatchResult fetch(const DispatchResult& d) const;
  LowLatencyDispatchResult fetch(const LowLatencyDispatchResult& d) const;
  Tensor fetch(const Tensor& t) const;

  void* stream() const { return stream_; }
  // Waits for everything enqueued on the stream (GPUs; nothing on the host backend).
  void synchronize() const;
  // Marks the start and end of one timed call; elapsed_us() waits for the end.
  void start();
  void stop();
  double elapsed_us();

  // GPUs only: records `calls` invocations of call() on the stream as one CUDA graph (replacing
  // any earlier one); replay_us() runs it between the start and stop events and waits.
  bool on_gpu() const { return device_ >= 0; }
  void capture(int calls, const std::function<void()>& call);
  double replay_us();

 private:
  TensorView place(const void* data, size_t bytes, DType dtype, std::initializer_list<int64_t> shape);
  int device_;
  void* stream_ = nullptr;
  void* events_[2] = {nullptr, nullptr};
  void* graph_ = nullptr;  // cudaGraphExec_t
  std::chrono::steady_clock::time_point t0_, t1_;
  std::vector<std::shared_ptr<void>> keep_;
};

}  // namespace epx::bench
