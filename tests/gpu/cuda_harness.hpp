// Runs a problem on the CUDA backend (device inputs, outputs copied back) so the same
// reference checks as the CPU backend's apply.
#pragma once
#include <cuda_runtime.h>

#include <functional>
#include <thread>
#include <utility>

#include "epx/cuda.hpp"
#include "harness.hpp"

namespace epx::test {

// A device copy of a host array; freed with the object.
class DeviceArray {
 public:
  DeviceArray() = default;
  template <typename T>
  explicit DeviceArray(const std::vector<T>& v) : bytes_(v.size() * sizeof(T)) {
    cudaMalloc(&ptr_, bytes_ ? bytes_ : 1);
    cudaMemcpy(ptr_, v.data(), bytes_, cudaMemcpyHostToDevice);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceArray() { cudaFree(ptr_); }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

inline TensorView device_view(const DeviceArray& a, DType t, std::initializer_list<int64_t> shape, int device) {
  return TensorView::of(a.get(), t, shape, DeviceKind::cuda, device);
}

inline DispatchResult to_host(const DispatchResult& d) {
  return verify::host_copy(d, [](const Tensor& t) { return epx::to_host(t); });
}

// Receive rows can never exceed this: every token of every rank once per local expert, plus
// padding (or the capacity in capacity mode).
inline int64_t rows_bound(const verify::Problem& p) {
  if (p.cfg.mode == CapacityMode::capacity) return p.cfg.capacity_rows;
  const int64_t l_count =  // the physical experts of a rank (EPLB: P / R)
      (p.cfg.num_physical_experts > 0 ? p.cfg.num_physical_experts : p.cfg.num_experts) / p.ranks;
  const int64_t shared = p.cfg.shared_expert ? p.cfg.max_tokens_per_rank + p.cfg.expert_alignment : 0;
  return p.ranks * p.cfg.max_tokens_per_rank * std::min(p.cfg.topk, l_count) + l_count * p.cfg.expert_alignment + shared;
}

// The CUDA twin of run_problem: same inputs, same calls, results on the host. group(r): rank r's
// group (of a CudaWorld, or joined by cuda_group_init_rank). An EPLB problem (p.replicas) passes
// its table at the dispatch.
inline std::vector<RankRun> run_problem_cuda(const std::function<Group(int)>& group, const verify::Problem& p,
                                             const RunOptions& o) {
  std::vector<RankRun> runs(p.ranks);
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  const bool weighted = o.dispatch.layout == Layout::expert_major && p.inputs[0].has_weights;
  const verify::Problem fresh = fresh_x_problem(p);  // the cached dispatch's x
  const std::vector<std::string> errors = verify::run_threads(p.ranks, [&](int r) {
    const Group g = group(r);
    const int dev = cuda_device(g);
    cudaSetDevice(dev);
    RankRun& run = runs[r];
    const verify::RankInput& in = p.inputs[r];
    const int64_t tokens = in.tokens;
    // Device arrays before the buffer, so they are freed after it: a cudaFree waits for the GPU's
    // running kernels and holds back other threads' launches, which must not happen while peers on
    // a shared GPU are inside a call; the buffer's release waits for them (docs/cuda.md).
    const int64_t bound = rows_bound(p);
    run.y = verify::random_bf16(bound * h, 100 + r);
    run.shared = verify::random_bf16(tokens * h, 200 + r);
    run.grad_recv_x = verify::random_bf16(bound * h, 300 + r);
    run.grad_out = verify::random_bf16(tokens * h, 400 + r);
    run.grad_recv_weights.resize(bound * k_count);
    for (size_t i = 0; i < run.grad_recv_weights.size(); ++i) run.grad_recv_weights[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
    DeviceArray x(in.x), x8(in.x_fp8), xs(in.x_scales), idx(in.idx), w(in.weights), gate(in.shared_gate);
    DeviceArray y(run.y), shared(run.shared), gx(run.grad_recv_x), gwr(run.grad_recv_weights), go(run.grad_out);
    const verify::RankInput& again = fresh.inputs[r];
    DeviceArray cx(again.x), cx8(again.x_fp8), cxs(again.x_scales), table(p.replicas);
    Buffer buffer(g, p.cfg);
    DispatchInput din;
    if (p.prequantized) {
      din.x = device_view(x8, DType::fp8_e4m3, {tokens, h}, dev);
      din.x_scales = device_view(xs, DType::f32, {tokens, h / kFp8Block}, dev);
    } else {
      din.x = device_view(x, DType::bf16, {tokens, h}, dev);
    }
    din.topk_idx = device_view(idx, DType::i32, {tokens, k_count}, dev);
    if (in.has_weights) din.topk_weights = device_view(w, DType::f32, {tokens, k_count}, dev);
    if (!in.shared_gate.empty()) din.shared_gate = device_view(gate, DType::f32, {tokens}, dev);
    if (!p.replicas.empty())
      din.expert_replicas = device_view(table, DType::i32,
                                        {p.cfg.num_experts, static_cast<int64_t>(p.replicas.size()) / p.cfg.num_experts}, dev);
    DispatchResult d = buffer.dispatch(din, o.dispatch);
    buffer.synchronize();
    run.dispatched = to_host(d);
    if (o.cached) {
      DispatchInput cin;
      if (p.prequantized) {
        cin.x = device_view(cx8, DType::fp8_e4m3, {tokens, h}, dev);
        cin.x_scales = device_view(cxs, DType::f32, {tokens, h / kFp8Block}, dev);
      } else {
        cin.x = device_view(cx, DType::bf16, {tokens, h}, dev);
      }
      DispatchResult cd = buffer.dispatch(cin, d.handle, {o.dispatch.nvfp4_global_scale});
      buffer.synchronize();
      run.cached.recv_x = epx::to_host(cd.recv_x);
      run.cached.recv_scales = epx::to_host(cd.recv_scales);
      run.cached.recv_global_scale = epx::to_host(cd.recv_global_scale);
    }
    if (!o.combine) return;
    const int64_t rows = d.recv_x.size(0);
    run.y.resize(rows * h);  // the reference reads exactly the rows of this dispatch
    CombineResult c = buffer.combine(
        {device_view(y, DType::bf16, {rows, h}, dev), o.shared_expert ? device_view(shared, DType::bf16, {tokens, h}, dev) : TensorView{}},
        d.handle, {weighted});
    buffer.synchronize();
    run.combined.out = epx::to_host(c.out);
    run.combined.overflow = run.dispatched.overflow;  // capacity mode: known from recv_info
    if (!o.backward) return;
    run.grad_recv_x.resize(rows * h);
    const int64_t per_row = o.dispatch.layout == Layout::expert_major ? 1 : k_count;
    run.grad_recv_weights.resize(rows * per_row);
    TensorView gw = o.dispatch.layout == Layout::expert_major ? device_view(gwr, DType::f32, {rows}, dev) : device_view(gwr, DType::f32, {rows, k_count}, dev);
    DispatchBackwardResult db = buffer.dispatch_backward({device_view(gx, DType::bf16, {rows, h}, dev), gw}, d.handle);
    buffer.synchronize();
    run.dispatch_grad.grad_x = epx::to_host(db.grad_x);
    run.dispatch_grad.grad_topk_weights = epx::to_host(db.grad_topk_weights);
    run.dispatch_grad.grad_shared_gate = epx::to_host(db.grad_shared_gate);
    CombineBackwardResult cb = buffer.combine_backward(
        {device_view(go, DType::bf16, {tokens, h}, dev), device_view(y, DType::bf16, {rows, h}, dev)}, d.handle, {weighted});
    buffer.synchronize();
    run.combine_grad.grad_y = epx::to_host(cb.grad_y);
    run.combine_grad.grad_topk_weights = epx::to_host(cb.grad_topk_weights);
    run.combine_grad.grad_shared_gate = epx::to_host(cb.grad_shared_gate);
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return runs;
}

inline std::vector<RankRun> run_problem_cuda(const CudaWorld& world, const verify::Problem& p, const RunOptions& o) {
  return run_problem_cuda([&](int r) { return world.group(r); }, p, o);
}

// The GPUs this process sees (0 where CUDA finds none).
inline int gpu_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// How a parameterized case's ranks reach each other: NCCL with one GPU per rank (GPUs 0, 1, ...),
// or every rank on GPU 0 over the tests' shared-GPU transport.
enum class Transport { nccl, shared_gpu };

inline CudaWorld world_of(Transport t, int ranks) {
  if (t == Transport::shared_gpu) return CudaWorld::shared_gpu(ranks, 0);
  std::vector<int> devices(ranks);
  for (int r = 0; r < ranks; ++r) devices[r] = r;
  return CudaWorld(devices);
}

// The short names the parameterized cases' tables use.
namespace case_names {
using W = WireFormat;
using L = Layout;
constexpr auto N = Transport::nccl;
constexpr auto S = Transport::shared_gpu;
constexpr auto U = verify::Routing::uniform;
constexpr auto K = verify::Routing::skewed;
}  // namespace case_names

}  // namespace epx::test
