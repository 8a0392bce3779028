// epx-bench: times dispatch, combine and the backward passes of one MoE layer over N ranks,
// verifies every result against the independent reference, prints a table and writes JSON.
#include <algorithm>
#include <cstdlib>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>

#include <functional>
#include <mutex>
#include <thread>

#include "bench/baselines.hpp"
#include "bench/ht_run.hpp"
#include "bench/processes.hpp"
#include "bench/json.hpp"
#include "bench/kernel_timer.hpp"
#include "bench/ll_outputs.hpp"
#include "bench/memory.hpp"
#include "bench/memory_guard.hpp"
#include "bench/options.hpp"
#include "bench/record_sink.hpp"
#include "bench/staging.hpp"
#include "verify/replicas.hpp"
#include "verify/reference.hpp"

#ifdef EPX_HAS_CUDA
#include <cuda_runtime.h>

#include "epx/cuda.hpp"
#endif

namespace epx::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Every rank's error in one exception (a peer's "rank r rejected its input" points at rank r's).
void throw_rank_errors(const std::vector<std::string>& errors) {
  std::string all;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) all += (all.empty() ? "rank " : "\n  rank ") + std::to_string(r) + ": " + errors[r];
  if (!all.empty()) throw Error(ErrorCode::internal, all);
}


Ranks make_ranks(const Options& o) {
  if (o.backend == "host") {
    auto world = std::make_shared<HostWorld>(o.ranks);
    return {[world](int r) { return world->group(r); }, [](const Group&) { return -1; }, ""};
  }
#ifdef EPX_HAS_CUDA
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  if (gpus < 1) throw Error(ErrorCode::unsupported, "epx-bench: --backend cuda but no GPU is visible");
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::shared_ptr<CudaWorld> world;
  if (o.shared_gpu) {
    world = std::make_shared<CudaWorld>(CudaWorld::shared_gpu(o.ranks, 0));
  } else {
    if (o.ranks > gpus)  // the shared-GPU transport is for tests (--shared-gpu)
      throw Error(ErrorCode::invalid_argument, "epx-bench: --ranks " + std::to_string(o.ranks) + " but only " +
                                                   std::to_string(gpus) +
                                                   " GPU(s) visible; the CUDA backend runs one rank per GPU (--shared-gpu "
                                                   "puts every rank on GPU 0, for the low-latency ops)");
    std::vector<int> devices;
    for (int d = 0; d < o.ranks; ++d) devices.push_back(d);
    world = std::make_shared<CudaWorld>(devices);
  }
  return {[world](int r) { return world->group(r); }, [](const Group& g) { return cuda_device(g); }, prop.name,
          prop.multiProcessorCount};
#else
  throw Error(ErrorCode::unsupported, "epx-bench: this build has no CUDA backend; use --backend host");
#endif
}

// Runs one configuration on all ranks. Each timed call starts together on every rank (a plain
// thread barrier outside epx) and the iteration's time is the slowest rank's.
std::vector<RankOutputs> run_config(const Options& o, const Ranks& ranks, const verify::Problem& p, Layout layout,
                                    bool with_combine) {
  std::vector<RankOutputs> outs(p.ranks);
  std::barrier start(p.ranks);
  const std::function<void()> arrive = [&] { start.arrive_and_wait(); };
  std::vector<std::string> errors(p.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < p.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        const Group g = ranks.group(r);
        outs[r] = run_rank(o, g, ranks.device(g), p, layout, with_combine, arrive);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        start.arrive_and_drop();  // the other ranks' barriers go on without it (their epx calls then time out)
      }
    });
  for (auto& t : threads) t.join();
  throw_rank_errors(errors);
  return outs;
}

// Low-latency mode: ll_dispatch and ll_combine (fused forms), verified against the reference.
constexpr int kGraphCalls = 10;  // calls per timed CUDA-graph replay (even: the buffer sets alternate)
std::vector<Record> run_low_latency(const Options& o, const Ranks& ranks, const verify::Problem& given, WireFormat wire) {
  // EPLB: the buffer routes `given`'s logical ids; rows, outputs and checks are the plain problem's.
  const verify::Problem p = given.replicas.empty() ? given : verify::physical_problem(given);
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk, l_count = p.cfg.num_experts / p.ranks;
  const int64_t slots = p.ranks * p.cfg.max_tokens_per_rank, first = p.cfg.shared_expert ? 1 : 0;
  LowLatencyConfig cfg{h, p.cfg.max_tokens_per_rank, given.cfg.num_experts, k_count, wire, 0};
  cfg.combine_wire = p.cfg.combine_wire;
  cfg.shared_expert = p.cfg.shared_expert;  // the outputs' expert 0 (no gate: weight 1)
  cfg.num_physical_experts = given.cfg.num_physical_experts;
  cfg.max_replicas = given.cfg.max_replicas;
  std::vector<LowLatencyDispatchResult> got(p.ranks);
  std::vector<Tensor> outs(p.ranks);
  std::vector<std::vector<uint16_t>> ys(p.ranks);
  std::vector<std::vector<double>> t_dispatch(p.ranks), t_combine(p.ranks);
  double kernel_dispatch_us = 0, kernel_combine_us = 0;  // CUPTI's kernel time per call (rank 0 records)
  std::vector<std::string> errors(p.ranks);
  std::barrier start(p.ranks);
  const std::function<void()> arrive = [&] { start.arrive_and_wait(); };
  std::mutex making_y;  // a y is whole until made (ll_outputs.hpp): one rank's at a time
  std::vector<std::thread> threads;
  for (int r = 0; r < p.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        const Group g = ranks.group(r);
        Staging io(ranks.device(g));
        {
          const std::lock_guard lock(making_y);
          ys[r] = ll_expert_outputs(p, r, o.seed * 17 + r);
        }
        start.arrive_and_wait();  // every y down to its used rows before any receive area exists
        LowLatencyDispatchInput in;
        in.x = io.view(p.inputs[r].x, DType::bf16, {p.inputs[r].tokens, h});
        in.topk_idx = io.view(given.inputs[r].idx, DType::i32, {p.inputs[r].tokens, k_count});
        if (!given.replicas.empty())
          in.expert_replicas = io.view(given.replicas, DType::i32, {given.cfg.num_experts, given.cfg.max_replicas});
        LowLatencyCombineInput ci;
        ci.y = io.view(ys[r], DType::bf16, {first + l_count, slots, h});
        const TensorView weights = io.view(p.inputs[r].weights, DType::f32, {p.inputs[r].tokens, k_count});
        if (o.ll_weights_at_dispatch) in.topk_weights = weights;  // sent with the routing
        else ci.topk_weights = weights;
        LowLatencyBuffer buffer(g, cfg);
        buffer.set_stream(io.stream());
        auto timed = [&](std::vector<double>& times, double& kernel_us, auto&& call) {
          if (!io.on_gpu() || o.ll_eager) return time_calls(o, arrive, io, times, call);
          // Kernel time, as decode runs it: kGraphCalls calls in one CUDA graph per replay, so
          // neither host launch time nor the ranks' start skew is in the per-call time.
          // Eager (EPX_PROFILE times their halves), one at a time: on the shared GPU a kernel queued
          // behind this rank's waiting one can keep a peer's first kernel from starting
          // (docs/cuda.md, the shared-GPU hold-back).
          for (int i = 0; i < o.warmup; ++i) {
            call();
            io.synchronize();
          }
          // The ranks capture together and replay once every rank's graph is uploaded.
          start.arrive_and_wait();
          io.capture(kGraphCalls, call);
          start.arrive_and_wait();
          for (int i = 0; i < o.warmup + o.iters; ++i) {
            start.arrive_and_wait();
            const double us = io.replay_us() / kGraphCalls;
            if (i >= o.warmup) times.push_back(us);
          }
          // The kernels' own time (DeepEP's measure), from o.iters more replays that CUPTI records
          // (kernel_timer.hpp), apart from the timed ones so recording costs them nothing.
          // A CUPTI failure costs only the kernel time: every rank goes through every barrier.
          if (!KernelRecording::available()) return;
          std::optional<KernelRecording> recording;
          auto note_failure = [](const std::exception& e) { std::fprintf(stderr, "%s (no kernel time)\n", e.what()); };
          start.arrive_and_wait();
          if (r == 0) try {
              recording.emplace();
            } catch (const std::exception& e) {
              note_failure(e);
            }
          start.arrive_and_wait();
          for (int i = 0; i < o.iters; ++i) {
            start.arrive_and_wait();
            io.replay_us();
          }
          start.arrive_and_wait();
          if (recording) try {
              kernel_us = per_call_median_us(recording->durations_by_stream(), p.ranks, o.iters, kGraphCalls);
            } catch (const std::exception& e) {
              note_failure(e);
            }
        };
        timed(t_dispatch[r], kernel_dispatch_us, [&] { got[r] = buffer.dispatch(in); });
        timed(t_combine[r], kernel_combine_us, [&] { outs[r] = buffer.combine(ci, got[r].handle); });
        got[r] = io.fetch(got[r]);  // host copies (views into the buffer on the GPU)
        outs[r] = io.fetch(outs[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        start.arrive_and_drop();  // as in run_config
      }
    });
  for (auto& t : threads) t.join();
  throw_rank_errors(errors);

  const std::vector<int64_t> all(p.ranks, p.cfg.max_tokens_per_rank);
  double rows = 0, remote = 0;  // routed (token, expert) rows received per rank, and those from other ranks
  for (int r = 0; r < p.ranks; ++r)
    for (int64_t o = first; o < first + l_count; ++o) {
      rows += got[r].recv_count.data<int32_t>()[o];
      remote += got[r].recv_count.data<int32_t>()[o] - got[r].recv_layout.data<int32_t>()[(o * p.ranks + r) * 2 + 1];
    }
  rows /= p.ranks;
  remote /= p.ranks;
  std::vector<const std::vector<double>*> td, tc;
  for (int r = 0; r < p.ranks; ++r) td.push_back(&t_dispatch[r]), tc.push_back(&t_combine[r]);
  Record d = base_record(o, ranks, given, "ll_dispatch", wire, "ll", td);
  set_bytes(d, rows * wire_row_bytes(wire, h), remote * wire_row_bytes(wire, h));
  Record c = base_record(o, ranks, given, "ll_combine", WireFormat::bf16, "ll", tc);
  if (o.backend == "cuda") d.sms = c.sms = ranks.sm_count;
  d.kernel_us = kernel_dispatch_us;
  c.kernel_us = kernel_combine_us;
  // Each (token, expert) row counted at its size in the combine wire (2H bytes for bf16).
  const double partial_bytes = wire_row_bytes(p.cfg.combine_wire, h);
  set_bytes(c, rows * partial_bytes, remote * partial_bytes);
  for (int r = 0; r < p.ranks && d.verify_error.empty(); ++r) {
    verify::Problem pw = p;
    pw.cfg.wire = wire;
    d.verify_error = verify::check_ll_dispatch(pw, all, r, 0.0f, got[r]);
    const std::vector<int32_t>& chosen = p.inputs[r].idx;  // EPLB: the rule's choice
    if (d.verify_error.empty() && !given.replicas.empty() &&
        !std::equal(chosen.begin(), chosen.end(), got[r].topk_physical.data<int32_t>()))
      d.verify_error = "rank " + std::to_string(r) + ": topk_physical is not the replica rule's choice";
  }
  for (int r = 0; r < p.ranks && c.verify_error.empty(); ++r) {
    c.verify_error = verify::check_ll_combine(p, all, ys, r, true, outs[r], "rank " + std::to_string(r) + " ll_combine out");
  }
  d.verified = d.verify_error.empty();
  c.verified = c.verify_error.empty();
  return {d, c};
}

// Prints the run's estimated peak memory; refuses (exit status 3) before anything runs when it
// would not fit (memory_guard.hpp).
bool memory_fits(const Options& o) {
  const MemoryEstimate estimate = estimate_memory(o);
  const AvailableMemory available = available_memory(o);
  std::printf("memory: about %s of host memory at the peak (%s)", gigabytes(estimate.peak.host_bytes()).c_str(),
              describe(estimate.peak).c_str());
  if (estimate.device_bytes > 0) std::printf("; roughly %s per GPU", gigabytes(estimate.device_bytes).c_str());
  std::printf("; %s available (%s)\n", gigabytes(available.bytes).c_str(), available.source.c_str());
  std::fflush(stdout);
  const std::string refusal = memory_refusal(o, estimate, available);
  if (!refusal.empty()) std::fprintf(stderr, "epx-bench: %s\n", refusal.c_str());
  return refusal.empty();
}

int run(const Options& o) {
  verify::ProblemSpec spec;
  spec.cfg.hidden = o.hidden;
  spec.cfg.max_tokens_per_rank = o.tokens;
  spec.cfg.num_experts = o.experts;
  spec.cfg.topk = o.topk;
  spec.cfg.expert_alignment = o.alignment;
  spec.cfg.combine_wire = o.combine_wire;
  spec.ranks = o.ranks;
  spec.routing = o.routing;
  spec.seed = o.seed;
  std::printf("epx-bench: backend %s, %d ranks, %lld tokens/rank%s, hidden %lld, top-%lld of %lld experts, %s routing, "
              "%d warm-up + %d timed iterations\n",
              o.backend.c_str(), o.ranks, static_cast<long long>(o.tokens),
              o.tokens_scaled ? " (preset scaled down for the host; --tokens for full size)" : "",
              static_cast<long long>(o.hidden), static_cast<long long>(o.topk), static_cast<long long>(o.experts),
              o.routing == verify::Routing::skewed ? "skewed" : "uniform", o.warmup, o.iters);
  std::fflush(stdout);
  if (!memory_fits(o)) return 3;
  RecordSink sink(o.json);  // every record printed and written as soon as it is measured
  spec.cfg.num_sms = o.sms;
  spec.cfg.send_blocks = o.send_blocks;
  spec.cfg.shared_expert = o.shared_expert;
  verify::Problem base = verify::make_problem(spec);
  if (o.replicas > 0) {  // EPLB: the same logical routing, served by N replicas of each expert
    base.cfg.num_physical_experts = o.replicas * o.experts;
    base.cfg.max_replicas = o.replicas;
    base.replicas = verify::spread_replicas(o.experts, o.replicas);
  }
  // The shared-GPU transport runs one stream per rank on one GPU: each needs a hardware queue of
  // its own, or a rank's waiting kernel can hold up a peer's queued behind it (docs/cuda.md).
  if (o.shared_gpu) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  std::vector<std::vector<double>> bytes_to;  // the bf16 dispatch's traffic, for the NCCL baseline
  const bool any_ht = wants(o, "dispatch") || wants(o, "combine") || wants(o, "dispatch_backward") ||
                      wants(o, "combine_backward");
  std::vector<Config> configs;
  for (Layout layout : any_ht ? o.layouts : std::vector<Layout>{})
    for (WireFormat wire : o.wires) configs.emplace_back(layout, wire);
  if (o.processes) {  // before anything here touches CUDA: the ranks' processes fork from this one
    std::fprintf(stderr, "[processes] %zu configurations, one process per rank ...\n", configs.size());
    for (Record& r : run_processes(o, base, configs, bytes_to)) sink.add(std::move(r));
  } else {
    const Ranks ranks = make_ranks(o);
    size_t done = 0;
    for (const auto& [layout, wire] : configs) {
      std::fprintf(stderr, "[%zu/%zu] %s %s ...\n", ++done, configs.size(), std::string(layout_name(layout)).c_str(),
                   std::string(wire_name(wire)).c_str());
      verify::Problem p = base;
      p.cfg.wire = wire;
      if (o.capacity_mode) use_capacity_mode(o, p, layout);
      // combine and the backward passes take bf16 whatever the dispatch wire; run them once.
      const bool with_combine = wire == o.wires.front();
      const auto outs = run_config(o, ranks, p, layout, with_combine);
      if (bytes_to.empty() && wire == WireFormat::bf16) bytes_to = traffic_matrix(outs, 2.0 * p.cfg.hidden);
      if (wants(o, "dispatch")) sink.add(make_record(o, ranks, p, "dispatch", wire, layout, outs));
      if (!with_combine) continue;
      for (const char* op : {"combine", "dispatch_backward", "combine_backward"})
        if (wants(o, op)) sink.add(make_record(o, ranks, p, op, WireFormat::bf16, layout, outs));
    }
    if (wants(o, "ll_dispatch") || wants(o, "ll_combine"))
      for (WireFormat wire : o.wires) {
        std::fprintf(stderr, "[ll] %s ...\n", std::string(wire_name(wire)).c_str());
        for (Record& r : run_low_latency(o, ranks, base, wire))  // ll_combine moves bf16 whatever the wire: once
          if (wants(o, r.op) && (r.op == "ll_dispatch" || wire == o.wires.front())) sink.add(std::move(r));
      }
  }
  if (!bytes_to.empty())
    for (Record& r : measure_baselines(o, bytes_to)) sink.add(std::move(r));
  sink.add_link_fractions();  // every record's wire rate as a fraction of a plain peer copy's in this run
  sink.add_floors(o.shared_gpu);  // every high-throughput record's time against its HBM floor in this run
  const std::vector<Record>& records = sink.records();
  const bool all_ok = std::all_of(records.begin(), records.end(), [](const Record& r) {
    return r.verified || is_baseline(r.op);
  });
  if (!o.json.empty()) std::printf("wrote %zu records to %s\n", records.size(), o.json.c_str());
  std::printf("%s\n", all_ok ? "all results verified" : "VERIFICATION FAILED");
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace epx::bench

int main(int argc, char** argv) {
  try {
    return epx::bench::run(epx::bench::parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-bench: %s\n", e.what());
    return 1;
  }
}
