// The plan exchange every call begins with, as one block's work: this rank's plan into every
// rank's plan slot, the wait for every rank's, the checks (same call and options, no peer's
// rejection), the receiver's layout when a dispatch asks for it, and blocking mode's report. Run
// by the exchange kernel of the calls on a handle (plan.cu) and by the last block of a dispatch's
// plan kernel (route.cu).
#pragma once
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/receive_layout.cuh"

namespace epx::detail::kernels {

// One block: write header (+ counts, + a rejection's message) into every rank's plan slot for
// this rank, then signal.
__device__ inline void post_plan_block(const PeerWindows& w, const WindowMap& m, PlanHeader header,
                                       const int64_t* counts, int64_t count_len, int phase, const CallState* cs,
                                       DeviceStatus* st, const PlanMessage* message = nullptr) {
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
    if (message && threadIdx.x == 0) *reinterpret_cast<PlanMessage*>(plan + kPlanMessageAt) = *message;
    for (int64_t i = threadIdx.x; i < count_len; i += blockDim.x)
      reinterpret_cast<int64_t*>(plan + kPlanCountsAt)[i] = counts[i];
  }
  block_done_signal(w, m, kSignalPlan);
}

// Thread 0: advances this rank's target of signal `kind` and (if `wait`) waits for every rank.
__device__ inline void advance_and_wait(const PeerWindows& w, const WindowMap& m, int kind, uint64_t increment,
                                        bool wait, uint64_t timeout_ns, CallState* cs, DeviceStatus* st) {
  if (threadIdx.x != 0) return;
  cs->targets[kind] += increment;  // every rank advances its targets alike
  if (wait) wait_all(w, m, kind, cs->targets[kind], timeout_ns, st);
}

// One block: every rank's plan against this rank's (same call, signature; a peer's rejection),
// the drop capacity, and with counts each expert's pairs on lower ranks.
__device__ inline void check_plans_block(const PeerWindows& w, const WindowMap& m, const Shape& s, PlanHeader mine,
                                         int phase, bool with_counts, double capacity_factor, int64_t* expert_prefix,
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
      else if (h->replica_hash != mine.replica_hash)
        report(st, kStatusReplicaMismatch, p);
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
    for (int p = 0; p < w.rank; ++p) prefix += reinterpret_cast<const int64_t*>(plan(p) + kPlanCountsAt)[e];
    expert_prefix[e] = prefix;
  }
}

// Thread 0, last in the exchange: the status so far and (with a layout) the sizes, for the host's
// one read. No fence: the host reads them only after an event behind the kernel, and a kernel's
// writes to mapped host memory are visible once it has completed.
__device__ inline void write_report(const ReportJob& job, int ranks, const RecvArrays* r, const DeviceStatus* st) {
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
}

// The whole exchange of job.phase (every thread of a kThreads block calls it). replica_hash: a
// dispatch with EPLB, its table's hash (written by another block, before this one's last_block).
template <int kThreads>
__device__ inline void exchange_plan_block(const PeerWindows& w, const WindowMap& m, const Shape& s,
                                           const ExchangeJob& job, uint64_t timeout_ns, CallState* cs,
                                           DeviceStatus* st, const uint64_t* replica_hash = nullptr) {
  PlanHeader header = job.header;
  if (replica_hash) header.replica_hash = static_cast<int64_t>(*reinterpret_cast<const volatile uint64_t*>(replica_hash));
  post_plan_block(w, m, header, job.counts, job.count_len, job.phase, cs, st);
  advance_and_wait(w, m, kSignalPlan, 1, true, timeout_ns, cs, st);
  __syncthreads();  // thread 0 saw every rank's signal (acquire): the block reads their plans
  // Every rank's exchange has started, so no peer still waits for SMs to start its own: the
  // call's next kernel (launch_after_prior) may take them now and wait there for this one's end.
  let_next_kernel_start();
  check_plans_block(w, m, s, header, job.phase, job.with_counts, job.capacity_factor, job.expert_prefix,
                    job.drop_capacity, cs, st);
  if (job.with_layout) {
    __syncthreads();  // thread 0's verdict (a mismatch or a peer's rejection fails the call) for every thread
    receive_layout_block<kThreads>(w, m, s, job.phase, job.layout, cs, st);  // thread 0 goes on, after the others' writes
  }
  if (threadIdx.x == 0 && job.report.to)
    write_report(job.report, w.ranks, job.with_layout ? &job.layout.r : nullptr, st);
}

}  // namespace epx::detail::kernels
