// The plan step of every call: the call's begin on the device, the plan exchange of the calls on
// a handle (a dispatch's runs in its plan kernel, route.cu), the drop rule, the status's publication.
#include "cuda/kernels/block_scan.cuh"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/ll_launch.hpp"
#include "cuda/kernels/exchange.cuh"

namespace epx::detail::kernels {

namespace {

__global__ void begin_call_kernel(CallState* cs, DeviceStatus* st) { begin_call_block(cs, st); }

__global__ void post_plan_kernel(PeerWindows w, WindowMap m, PlanHeader header, PlanMessage message, int phase,
                                 bool begins_call, CallState* cs, DeviceStatus* st) {
  if (begins_call) begin_call_block(cs, st);
  post_plan_block(w, m, header, nullptr, 0, phase, cs, st, &message);
}

__global__ void wait_kernel(PeerWindows w, WindowMap m, int kind, uint64_t increment, bool wait, uint64_t timeout_ns,
                            CallState* cs, DeviceStatus* st) {
  advance_and_wait(w, m, kind, increment, wait, timeout_ns, cs, st);
}

// The plan exchange in one launch (exchange.cuh): fewer launches on every call's critical path,
// for the host and for the GPU.
__global__ void __launch_bounds__(kScanThreads) exchange_plan_kernel(PeerWindows w, WindowMap m, Shape s, ExchangeJob job,
                                                                    uint64_t timeout_ns, CallState* cs, DeviceStatus* st) {
  if (job.begins_call) begin_call_block(cs, st);
  exchange_plan_block<kScanThreads>(w, m, s, job, timeout_ns, cs, st);
}

// Block e: this rank's (token, slot) pairs of expert e in order; keep while the global
// position (lower ranks' pairs first) is below the capacity.
__global__ void drop_kernel(Shape s, int64_t tokens, int32_t* slot_expert, float* slot_weight,
                            const int64_t* expert_prefix, const int64_t* drop_capacity, int64_t* dropped,
                            const DeviceStatus* st) {
  if (failed(st)) return;
  const int32_t e = blockIdx.x;
  const int64_t keep = *drop_capacity - expert_prefix[e];
  const int64_t n = block_scan_flags(
      tokens * s.topk, [&](int64_t i) { return slot_expert[i] == e; },
      [&](int64_t i, int64_t pos) {
        if (pos >= keep) {
          slot_expert[i] = -1;
          slot_weight[i] = 0.0f;
        }
      });
  const int64_t kept = min(n, max(keep, int64_t{0}));
  if (threadIdx.x == 0 && n > kept) atomicAdd(reinterpret_cast<unsigned long long*>(dropped), static_cast<unsigned long long>(n - kept));
}

__global__ void publish_status_kernel(const DeviceStatus* st, DeviceStatus* host) { publish(st, host); }

}  // namespace

void begin_call(const Ctx& ctx) { begin_call_kernel<<<1, 1, 0, ctx.stream>>>(ctx.state, ctx.status); }

void post_plan(const Ctx& ctx, const PlanHeader& header, const PlanMessage& message, int phase, bool begins_call) {
  post_plan_kernel<<<1, 256, 0, ctx.stream>>>(ctx.peers, ctx.map, header, message, phase, begins_call, ctx.state,
                                              ctx.status);
}

void wait_signals(const Ctx& ctx, int kind, uint64_t increment, bool wait) {
  wait_kernel<<<1, 32, 0, ctx.stream>>>(ctx.peers, ctx.map, kind, increment, wait, ctx.timeout_ns, ctx.state,
                                        ctx.status);
}

void exchange_plan(const Ctx& ctx, const ExchangeJob& job) {
  exchange_plan_kernel<<<1, kScanThreads, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, job, ctx.timeout_ns,
                                                          ctx.state, ctx.status);
}

void drop_slots(const Ctx& ctx, int64_t tokens, int32_t* slot_expert, float* slot_weight, const int64_t* expert_prefix,
                const int64_t* drop_capacity, int64_t* dropped) {
  drop_kernel<<<static_cast<unsigned>(ctx.shape.experts), kScanThreads, 0, ctx.stream>>>(
      ctx.shape, tokens, slot_expert, slot_weight, expert_prefix, drop_capacity, dropped, ctx.status);
}

void publish_status(const Ctx& ctx, DeviceStatus* host_status) { publish_status(ctx.status, host_status, ctx.stream); }

void publish_status(const DeviceStatus* status, DeviceStatus* host_status, cudaStream_t stream) {
  publish_status_kernel<<<1, 1, 0, stream>>>(status, host_status);
}

void preload_plan_kernels() { preload(begin_call_kernel, post_plan_kernel, wait_kernel, exchange_plan_kernel, drop_kernel,
          publish_status_kernel); }

void preload_kernels() {
  ll::preload_dispatch_kernels();  // a peer may wait inside a low-latency call too
  ll::preload_combine_kernels();
  preload_plan_kernels();
  preload_route_kernels();
  preload_dispatch_kernels();
  preload_combine_kernels();
  preload_combine_backward_kernels();
  preload_cached_dispatch_kernels();
  preload_broadcast_kernels();
}

}  // namespace epx::detail::kernels
