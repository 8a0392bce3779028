// The plan step of every call and the routing that precedes a dispatch's transfer.
#include "cuda/kernels/block_scan.cuh"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/finite_scan.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/ll_launch.hpp"
#include "cuda/kernels/receive_layout.cuh"

namespace epx::detail::kernels {

namespace {

__device__ int64_t read_index(const RoutingInput& in, int64_t t, int64_t k) {
  return in.idx64 ? static_cast<const int64_t*>(in.topk_idx)[t * in.idx_stride + k]
                  : static_cast<const int32_t*>(in.topk_idx)[t * in.idx_stride + k];
}

// Slot k of token t (id checked) into e[k], w[k]; false for an id out of range (reported).
__device__ bool canonical_slot(const Shape& s, const RoutingInput& in, int64_t t, int64_t k, int64_t id, float weight,
                               int32_t* e, float* w, DeviceStatus* st) {
  const bool valid = id >= -1 && id < s.experts;
  if (!valid) report(st, kStatusBadExpert, s.rank, t, k, id);
  e[k] = valid ? static_cast<int32_t>(id) : -1;
  w[k] = !valid || id < 0 ? 0.0f : in.topk_weights ? weight : 1.0f;
  return valid;
}

// One thread per token: read its routing, check it, count its experts. topk_idx: slots in groups
// of 8 whose ids and weights are loaded before any is stored (no dependent round per slot), and
// repeats found in registers within a group (earlier groups read back, K > 8 only). With
// check_finite (fc.parts), then block b scans rows b, b + grid, ... of x (and x_scales).
__global__ void canonicalize_kernel(Shape s, RoutingInput in, int64_t tokens, int32_t* slot_expert, float* slot_weight,
                                    int64_t* counts, DeviceStatus* st, FiniteCheck fc) {
  constexpr int kGroup = 8;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t* e = slot_expert + t * s.topk;
    float* w = slot_weight + t * s.topk;
    if (in.topk_idx) {
      for (int64_t k0 = 0; k0 < s.topk; k0 += kGroup) {
        int64_t id[kGroup];
        float weight[kGroup];
#pragma unroll
        for (int i = 0; i < kGroup; ++i) id[i] = k0 + i < s.topk ? read_index(in, t, k0 + i) : -1;
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
          weight[i] = k0 + i < s.topk && in.topk_weights ? in.topk_weights[t * in.weight_stride + k0 + i] : 1.0f;
#pragma unroll
        for (int i = 0; i < kGroup; ++i)
          if (k0 + i < s.topk && !canonical_slot(s, in, t, k0 + i, id[i], weight[i], e, w, st)) id[i] = -1;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          if (id[i] < 0) continue;
          bool repeat = false;
          for (int64_t j = 0; j < k0 && !repeat; ++j)
            if (e[j] == id[i]) repeat = true, report(st, kStatusRepeatedExpert, s.rank, t, j, id[i]);
#pragma unroll
          for (int j = 0; j < i; ++j)
            if (!repeat && id[j] == id[i]) repeat = true, report(st, kStatusRepeatedExpert, s.rank, t, k0 + j, id[i]);
          if (counts) atomicAdd(reinterpret_cast<unsigned long long*>(&counts[id[i]]), 1ull);
        }
      }
      continue;
    }
    int64_t k = 0;
    for (int64_t x = 0; x < s.experts; ++x) {
      if (!in.routing_map[t * in.map_stride + x]) continue;
      if (k == s.topk) {  // more experts than slots: reported as slot K
        report(st, kStatusBadExpert, s.rank, t, s.topk, x);
        break;
      }
      e[k] = static_cast<int32_t>(x);
      w[k] = in.probs ? in.probs[t * in.probs_stride + x] : 1.0f;
      ++k;
    }
    for (; k < s.topk; ++k) e[k] = -1, w[k] = 0.0f;
    if (counts)  // a map names each expert once: no repeats
      for (int64_t j = 0; j < s.topk; ++j)
        if (e[j] >= 0) atomicAdd(reinterpret_cast<unsigned long long*>(&counts[e[j]]), 1ull);
  }
  scan_finite_all(fc, tokens, blockIdx.x, gridDim.x, s.rank, st);
}

// Thread 0: the call's number and a clean status.
__global__ void begin_call_kernel(CallState* cs, DeviceStatus* st) {
  cs->call += 1;
  *st = DeviceStatus{};
}

// One block: write header (+ counts) into every rank's plan slot for this rank, then signal.
__device__ void post_plan_block(const PeerWindows& w, const WindowMap& m, PlanHeader header, const int64_t* counts,
                                int64_t count_len, int phase, const CallState* cs, DeviceStatus* st) {
  const int slot = plan_slot(cs, phase);
  if (threadIdx.x == 0) {
    header.call_index = static_cast<int64_t>(cs->call) - 1;
    const int32_t code = *reinterpret_cast<volatile int32_t*>(&st->code);
    if (code != 0 && header.error == 0) {  // this rank's own input error, found on the device
      header.error = code;
      header.detail[0] = st->a;
      header.detail[1] = st->b;
      header.detail[2] = st->c;
    }
  }
  for (int p = 0; p < w.ranks; ++p) {
    char* plan = at_window<char>(w, p, m.plans + (slot * w.ranks + w.rank) * m.plan_stride);
    if (threadIdx.x == 0) *reinterpret_cast<PlanHeader*>(plan) = header;
    for (int64_t i = threadIdx.x; i < count_len; i += blockDim.x)
      reinterpret_cast<int64_t*>(plan + sizeof(PlanHeader))[i] = counts[i];
  }
  block_done_signal(w, m, kSignalPlan);
}

// Thread 0: advances this rank's target of signal `kind` and (if `wait`) waits for every rank.
__device__ void advance_and_wait(const PeerWindows& w, const WindowMap& m, int kind, uint64_t increment, bool wait,
                                 uint64_t timeout_ns, CallState* cs, DeviceStatus* st) {
  if (threadIdx.x != 0) return;
  cs->targets[kind] += increment;  // every rank advances its targets alike
  if (wait) wait_all(w, m, kind, cs->targets[kind], timeout_ns, st);
}

// One block: every rank's plan against this rank's (same call, signature; a peer's rejection),
// the drop capacity, and with counts each expert's pairs on lower ranks.
__device__ void check_plans_block(const PeerWindows& w, const WindowMap& m, const Shape& s, PlanHeader mine, int phase,
                                  bool with_counts, double capacity_factor, int64_t* expert_prefix,
                                  int64_t* drop_capacity, const CallState* cs, DeviceStatus* st) {
  if (failed(st)) return;  // a timeout, or this rank's own error: already reported
  const int slot = plan_slot(cs, phase);
  mine.call_index = static_cast<int64_t>(cs->call) - 1;
  auto plan = [&](int p) {
    return at_window<const char>(w, w.rank, m.plans + (slot * w.ranks + p) * m.plan_stride);
  };
  if (threadIdx.x == 0) {
    int64_t total_tokens = 0;
    // A peer in this call that rejected its input stops it with its reason, whatever the others'
    // signatures (a front end's rejection, Buffer::reject, may not know the options), as on the
    // CPU: rejections first, then calls or options that differ.
    for (int p = 0; p < w.ranks; ++p) {
      const PlanHeader* h = reinterpret_cast<const PlanHeader*>(plan(p));
      if (h->call_kind == mine.call_kind && h->call_index == mine.call_index && h->error != 0 && p != w.rank)
        report(st, kStatusPeerRejected, p, h->error, h->detail[0], h->detail[1], h->detail[2]);
    }
    for (int p = 0; p < w.ranks; ++p) {
      const PlanHeader* h = reinterpret_cast<const PlanHeader*>(plan(p));
      if (h->call_kind != mine.call_kind || h->call_index != mine.call_index || h->signature != mine.signature)
        report(st, kStatusCallMismatch, p, h->call_kind, h->call_index, h->signature);
      total_tokens += h->tokens;
    }
    *drop_capacity = capacity_factor > 0.0
                         ? static_cast<int64_t>(ceil(capacity_factor * static_cast<double>(total_tokens * s.topk) /
                                                     static_cast<double>(s.experts)))
                         : -1;
  }
  if (!with_counts) return;
  for (int64_t e = threadIdx.x; e < s.experts; e += blockDim.x) {
    int64_t prefix = 0;
    for (int p = 0; p < w.rank; ++p) prefix += reinterpret_cast<const int64_t*>(plan(p) + sizeof(PlanHeader))[e];
    expert_prefix[e] = prefix;
  }
}

__global__ void post_plan_kernel(PeerWindows w, WindowMap m, PlanHeader header, const int64_t* counts,
                                 int64_t count_len, int phase, const CallState* cs, DeviceStatus* st) {
  post_plan_block(w, m, header, counts, count_len, phase, cs, st);
}

__global__ void wait_kernel(PeerWindows w, WindowMap m, int kind, uint64_t increment, bool wait, uint64_t timeout_ns,
                            CallState* cs, DeviceStatus* st) {
  advance_and_wait(w, m, kind, increment, wait, timeout_ns, cs, st);
}

// Thread 0, last in the exchange: the status so far and (with a layout) the sizes, for the host's
// one read; the host waits for the kernel (an event), so the fence only orders the writes.
__device__ void write_report(const ReportJob& job, int ranks, const RecvArrays* r, const DeviceStatus* st) {
  PlanReport* to = job.to;
  const volatile DeviceStatus* now = st;
  to->status.rank = now->rank;
  to->status.a = now->a;
  to->status.b = now->b;
  to->status.c = now->c;
  to->status.d = now->d;
  to->status.code = now->code;
  if (r) {
    for (int i = 0; i < 4; ++i) to->info[i] = r->info[i];
    for (int p = 0; p <= ranks; ++p) to->rank_offsets[p] = r->rank_offsets[p];
  }
  to->dropped = job.dropped ? *job.dropped : 0;
  __threadfence_system();
}

// The plan exchange in one launch (post, wait, check, the receiver's layout when the dispatch
// asks for it, and blocking mode's report): fewer launches on every call's critical path, for the
// host and for the GPU.
__global__ void exchange_plan_kernel(PeerWindows w, WindowMap m, Shape s, PlanHeader header, const int64_t* counts,
                                     int64_t count_len, int phase, bool with_counts, double capacity_factor,
                                     int64_t* expert_prefix, int64_t* drop_capacity, bool with_layout, LayoutJob layout,
                                     ReportJob report, uint64_t timeout_ns, CallState* cs, DeviceStatus* st) {
  post_plan_block(w, m, header, counts, count_len, phase, cs, st);
  advance_and_wait(w, m, kSignalPlan, 1, true, timeout_ns, cs, st);
  __syncthreads();  // thread 0 saw every rank's signal (acquire): the block reads their plans
  check_plans_block(w, m, s, header, phase, with_counts, capacity_factor, expert_prefix, drop_capacity, cs, st);
  if (with_layout) {
    __syncthreads();  // thread 0's verdict (a mismatch or a peer's rejection fails the call) for every thread
    receive_layout_block(w, m, s, phase, layout, cs, st);  // thread 0 goes on, after the others' writes
  }
  if (threadIdx.x == 0 && report.to) write_report(report, w.ranks, with_layout ? &layout.r : nullptr, st);
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

int blocks_for(int64_t n, int threads) { return static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(1, (n + threads - 1) / threads))); }

}  // namespace

void canonicalize_routing(const Ctx& ctx, const RoutingInput& in, int64_t tokens, int32_t* slot_expert,
                          float* slot_weight, int64_t* counts, const FiniteCheck& check) {
  if (tokens == 0) return;
  // check_finite: a block per row, up to 1024 (blocks_for's cap; each then scans several rows).
  const int blocks = std::max(blocks_for(tokens, 128), check.parts ? blocks_for(tokens, 1) : 0);
  canonicalize_kernel<<<blocks, 128, 0, ctx.stream>>>(ctx.shape, in, tokens, slot_expert, slot_weight, counts,
                                                      ctx.status, check);
}

void begin_call(const Ctx& ctx) { begin_call_kernel<<<1, 1, 0, ctx.stream>>>(ctx.state, ctx.status); }

void post_plan(const Ctx& ctx, const PlanHeader& header, const int64_t* counts, int64_t count_len, int phase) {
  post_plan_kernel<<<1, 256, 0, ctx.stream>>>(ctx.peers, ctx.map, header, counts, counts ? count_len : 0, phase,
                                              ctx.state, ctx.status);
}

void wait_signals(const Ctx& ctx, int kind, uint64_t increment, bool wait) {
  wait_kernel<<<1, 32, 0, ctx.stream>>>(ctx.peers, ctx.map, kind, increment, wait, ctx.timeout_ns, ctx.state,
                                        ctx.status);
}

void exchange_plan(const Ctx& ctx, const PlanHeader& mine, const int64_t* counts, int64_t count_len, int phase,
                   bool with_counts, double capacity_factor, int64_t* expert_prefix, int64_t* drop_capacity,
                   const LayoutJob* layout, ReportJob report) {
  exchange_plan_kernel<<<1, kScanThreads, 0, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, mine, counts, counts ? count_len : 0,
                                                  phase, with_counts, capacity_factor, expert_prefix, drop_capacity,
                                                  layout != nullptr, layout ? *layout : LayoutJob{}, report,
                                                  ctx.timeout_ns, ctx.state, ctx.status);
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

void preload_plan_kernels() { preload(begin_call_kernel, canonicalize_kernel, post_plan_kernel, wait_kernel, exchange_plan_kernel, drop_kernel,
          publish_status_kernel); }

void preload_kernels() {
  ll::preload_kernels();  // a peer may wait inside a low-latency call too
  preload_plan_kernels();
  preload_positions_kernels();
  preload_dispatch_kernels();
  preload_combine_kernels();
  preload_combine_backward_kernels();
  preload_cached_dispatch_kernels();
  preload_broadcast_kernels();
}

}  // namespace epx::detail::kernels
