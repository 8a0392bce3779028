// epx-bench: times dispatch, combine and the backward passes of one MoE layer over N ranks,
// verifies every result against the independent reference, prints a table and writes JSON.
#include <algorithm>
#include <cstdlib>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>

#include <functional>
#include <thread>

#include "bench/baselines.hpp"
#include "bench/json.hpp"
#include "bench/options.hpp"
#include "bench/staging.hpp"
#include "verify/reference.hpp"

#ifdef EPX_HAS_CUDA
#include <cuda_runtime.h>

#include "epx/cuda.hpp"
#endif

namespace epx::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Everything one rank produced for one (layout, wire) configuration.
struct RankOutputs {
  DispatchResult dispatched;
  std::vector<uint16_t> y, grad_x_in, grad_out;
  std::vector<float> grad_w_in;
  CombineResult combined;
  DispatchBackwardResult dispatch_grad;
  CombineBackwardResult combine_grad;
  std::map<std::string, std::vector<double>> times_us;  // op -> per iteration
};

bool wants(const Options& o, const std::string& op) { return std::find(o.ops.begin(), o.ops.end(), op) != o.ops.end(); }

// Runs call() warmup + iters times, each start aligned across ranks by `start`; keeps the timed ones.
template <typename Call>
void time_calls(const Options& o, std::barrier<>& start, Staging& io, std::vector<double>& times, Call&& call) {
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    start.arrive_and_wait();
    io.start();
    call();
    io.stop();
    const double us = io.elapsed_us();
    if (i >= o.warmup) times.push_back(us);
  }
}

// Every rank's error in one exception (a peer's "rank r rejected its input" points at rank r's).
void throw_rank_errors(const std::vector<std::string>& errors) {
  std::string all;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) all += (all.empty() ? "rank " : "\n  rank ") + std::to_string(r) + ": " + errors[r];
  if (!all.empty()) throw Error(ErrorCode::internal, all);
}

// The ranks of the run: host threads of a HostWorld, or GPUs of a CudaWorld (one per GPU).
struct Ranks {
  std::function<Group(int)> group;
  std::function<int(const Group&)> device;  // -1 on the host backend
  std::string gpu_name;
  int sm_count = 0;  // of GPU 0 (the low-latency kernels take them all)
};

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
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  const bool weighted = layout == Layout::expert_major;
  std::vector<std::string> errors(p.ranks);
  auto rank_main = [&](int r) {
    const Group g = ranks.group(r);
    Staging io(ranks.device(g));
    RankOutputs& out = outs[r];
    auto timed = [&](const std::string& op, auto&& call) { time_calls(o, start, io, out.times_us[op], call); };
    Buffer buffer(g, p.cfg);
    buffer.set_stream(io.stream());
    const verify::RankInput& in = p.inputs[r];
    const int64_t tokens = in.tokens;
    DispatchInput din;
    din.x = io.view(in.x, DType::bf16, {tokens, h});
    din.topk_idx = io.view(in.idx, DType::i32, {tokens, k_count});
    din.topk_weights = io.view(in.weights, DType::f32, {tokens, k_count});
    DispatchOptions dopt;
    dopt.layout = layout;
    DispatchResult d;
    timed("dispatch", [&] { d = buffer.dispatch(din, dopt); });
    out.dispatched = io.fetch(d);
    if (!with_combine) return;
    const int64_t rows = d.recv_x.size(0);
    out.y = verify::random_bf16(rows * h, o.seed * 7 + r);
    const TensorView y = io.view(out.y, DType::bf16, {rows, h});
    if (wants(o, "combine")) {
      CombineResult c;
      timed("combine", [&] { c = buffer.combine({y, {}}, d.handle, {weighted}); });
      out.combined.out = io.fetch(c.out);
    }
    if (wants(o, "dispatch_backward")) {
      out.grad_x_in = verify::random_bf16(rows * h, o.seed * 11 + r);
      out.grad_w_in.assign(rows * (weighted ? 1 : k_count), 0.5f);
      for (size_t i = 0; i < out.grad_w_in.size(); ++i) out.grad_w_in[i] = static_cast<float>(i % 17) * 0.125f - 1.0f;
      const TensorView gw = weighted ? io.view(out.grad_w_in, DType::f32, {rows}) : io.view(out.grad_w_in, DType::f32, {rows, k_count});
      const TensorView gx = io.view(out.grad_x_in, DType::bf16, {rows, h});
      DispatchBackwardResult b;
      timed("dispatch_backward", [&] { b = buffer.dispatch_backward({gx, gw}, d.handle); });
      out.dispatch_grad.grad_x = io.fetch(b.grad_x);
      out.dispatch_grad.grad_topk_weights = io.fetch(b.grad_topk_weights);
    }
    if (wants(o, "combine_backward")) {
      out.grad_out = verify::random_bf16(tokens * h, o.seed * 13 + r);
      const TensorView go = io.view(out.grad_out, DType::bf16, {tokens, h});
      CombineBackwardResult b;
      timed("combine_backward", [&] { b = buffer.combine_backward({go, y}, d.handle, {weighted}); });
      out.combine_grad.grad_y = io.fetch(b.grad_y);
      out.combine_grad.grad_topk_weights = io.fetch(b.grad_topk_weights);
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < p.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        rank_main(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  throw_rank_errors(errors);
  return outs;
}

// Empty when every rank's result of `op` equals the reference.
std::string verify_op(const std::string& op, const verify::Problem& p, Layout layout, const std::vector<RankOutputs>& outs) {
  const auto kept = verify::kept_routing(p);
  std::vector<verify::Expected> layouts;
  for (int r = 0; r < p.ranks; ++r) layouts.push_back(verify::expected_dispatch(p, kept, r, layout));
  auto gather = [&](auto member) {
    std::vector<std::decay_t<decltype(outs[0].*member)>> v;
    for (const auto& o : outs) v.push_back(o.*member);
    return v;
  };
  const int64_t h = p.cfg.hidden;
  const bool weighted = layout == Layout::expert_major;
  std::string err;
  for (int r = 0; r < p.ranks && err.empty(); ++r) {
    const RankOutputs& o = outs[r];
    const int64_t tokens = p.inputs[r].tokens;
    if (op == "dispatch") {
      err = verify::check_dispatch(p, kept, r, layout, 0.0f, o.dispatched);
    } else if (op == "combine") {
      const auto want = verify::expected_combine(p, kept, layouts, gather(&RankOutputs::y), r, layout, weighted, nullptr);
      err = verify::compare_bits(o.combined.out.data<uint16_t>(), want.data(), tokens * h, 2, "combine out");
    } else if (op == "dispatch_backward") {
      const auto want = verify::expected_combine(p, kept, layouts, gather(&RankOutputs::grad_x_in), r, layout, false, nullptr);
      err = verify::compare_bits(o.dispatch_grad.grad_x.data<uint16_t>(), want.data(), tokens * h, 2, "grad_x");
      const auto want_w = verify::expected_gathered_weights(p, kept, layouts, gather(&RankOutputs::grad_w_in), r, layout);
      if (err.empty())
        err = verify::compare_bits(o.dispatch_grad.grad_topk_weights.data<float>(), want_w.data(),
                                   static_cast<int64_t>(want_w.size()), 4, "grad_topk_weights");
    } else if (op == "combine_backward") {
      const auto want = verify::expected_grad_y(p, layouts[r], gather(&RankOutputs::grad_out), weighted);
      err = verify::compare_bits(o.combine_grad.grad_y.data<uint16_t>(), want.data(), static_cast<int64_t>(want.size()),
                                 2, "grad_y");
      if (err.empty() && weighted) {
        const auto want_w = verify::expected_grad_w(p, kept, layouts, gather(&RankOutputs::grad_out), gather(&RankOutputs::y), r);
        err = verify::compare_bits(o.combine_grad.grad_topk_weights.data<float>(), want_w.data(),
                                   static_cast<int64_t>(want_w.size()), 4, "grad_topk_weights");
      }
    }
    if (!err.empty()) err = "rank " + std::to_string(r) + ": " + err;
  }
  return err;
}

// DeepEP's accounting: a rank receives each token once per destination rank (its own tokens
// included); `row_bytes` per token. Returns {logical bytes, bytes from other ranks}, per rank.
std::pair<double, double> bytes_per_rank(const std::vector<RankOutputs>& outs, double row_bytes) {
  double logical = 0, wire = 0;
  for (size_t r = 0; r < outs.size(); ++r) {
    const int64_t* off = outs[r].dispatched.rank_offsets.data<int64_t>();
    const double received = static_cast<double>(off[outs.size()]);
    logical += received * row_bytes;
    wire += (received - static_cast<double>(off[r + 1] - off[r])) * row_bytes;
  }
  return {logical / static_cast<double>(outs.size()), wire / static_cast<double>(outs.size())};
}

// bytes[s][d] rank s sent to rank d in a dispatch (rows from rank_offsets x row bytes).
std::vector<std::vector<double>> traffic_matrix(const std::vector<RankOutputs>& outs, double row_bytes) {
  const size_t n = outs.size();
  std::vector<std::vector<double>> bytes(n, std::vector<double>(n, 0.0));
  for (size_t d = 0; d < n; ++d) {
    const int64_t* off = outs[d].dispatched.rank_offsets.data<int64_t>();
    for (size_t s = 0; s < n; ++s) bytes[s][d] = static_cast<double>(off[s + 1] - off[s]) * row_bytes;
  }
  return bytes;
}

double wire_row_bytes(WireFormat w, int64_t h) {
  switch (w) {
    case WireFormat::bf16: return 2.0 * h;
    case WireFormat::fp8:
    case WireFormat::fp8_ue8m0: return h + 4.0 * (h / kFp8Block);
    case WireFormat::nvfp4: return h / 2.0 + h / kNvfp4Block + 4.0;
  }
  return 0;
}

// The fields every record has; times from each rank's per-iteration times (slowest rank counts).
Record base_record(const Options& o, const Ranks& ranks, const verify::Problem& p, const std::string& op, WireFormat wire,
                   const std::string& layout, const std::vector<const std::vector<double>*>& times) {
  Record rec;
  rec.op = op;
  rec.dtype = std::string(wire_name(wire));
  rec.layout = layout;
  rec.ranks = p.ranks;
  rec.tokens = o.tokens;
  rec.hidden = p.cfg.hidden;
  rec.topk = p.cfg.topk;
  rec.experts = p.cfg.num_experts;
  rec.alignment = p.cfg.expert_alignment;
  rec.routing = o.routing == verify::Routing::skewed ? "skewed" : "uniform";
  rec.sms = o.backend == "cuda" ? (o.sms > 0 ? o.sms : 24) : 0;  // 24: the CUDA backend's default grid
  rec.iters = o.iters;
  rec.backend = o.backend;
  rec.gpu = ranks.gpu_name;
  rec.git_commit = EPX_GIT_COMMIT;
  if (o.shared_gpu) rec.transport = "shared-gpu";
  if (o.backend == "cuda" && op.rfind("ll_", 0) == 0) rec.timing = o.ll_eager ? "eager" : "graph";
  if (op.rfind("ll_", 0) == 0 && o.ll_weights_at_dispatch) rec.weights_at = "dispatch";
  if (o.backend == "cuda" && op.rfind("ll_", 0) != 0) {  // the engines asked for (docs/cuda.md)
    auto asked = [](const char* name) {
      const char* v = std::getenv(name);
      return std::string(v ? v : "auto");
    };
    rec.engines = "dispatch=" + asked("EPX_DISPATCH_ENGINE") + ",combine=" + asked("EPX_COMBINE_ENGINE");
  }
  std::vector<double> t(o.iters, 0.0);
  for (const auto* rank_times : times)
    for (int i = 0; i < o.iters; ++i) t[i] = std::max(t[i], (*rank_times)[i]);
  std::sort(t.begin(), t.end());
  rec.time_us = o.iters % 2 ? t[o.iters / 2] : 0.5 * (t[o.iters / 2 - 1] + t[o.iters / 2]);
  rec.min_us = t.front();
  rec.max_us = t.back();
  return rec;
}

void set_bytes(Record& rec, double logical, double wire_bytes) {
  rec.logical_bytes = logical;
  rec.logical_gbps = logical / (rec.time_us * 1e3);
  rec.wire_gbps = wire_bytes / (rec.time_us * 1e3);
}

Record make_record(const Options& o, const Ranks& ranks, const verify::Problem& p, const std::string& op, WireFormat wire,
                   Layout layout, const std::vector<RankOutputs>& outs) {
  std::vector<const std::vector<double>*> times;
  for (const auto& out : outs) times.push_back(&out.times_us.at(op));
  Record rec = base_record(o, ranks, p, op, wire, std::string(layout_name(layout)), times);
  const auto [logical, wire_bytes] = bytes_per_rank(outs, op == "dispatch" ? wire_row_bytes(wire, p.cfg.hidden) : 2.0 * p.cfg.hidden);
  set_bytes(rec, logical, wire_bytes);
  rec.verify_error = verify_op(op, p, layout, outs);
  rec.verified = rec.verify_error.empty();
  return rec;
}

// Low-latency mode: ll_dispatch and ll_combine (fused forms), verified against the reference.
constexpr int kGraphCalls = 10;  // calls per timed CUDA-graph replay (even: the buffer sets alternate)
std::vector<Record> run_low_latency(const Options& o, const Ranks& ranks, const verify::Problem& p, WireFormat wire) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk, l_count = p.cfg.num_experts / p.ranks;
  const int64_t slots = p.ranks * p.cfg.max_tokens_per_rank;
  LowLatencyConfig cfg{h, p.cfg.max_tokens_per_rank, p.cfg.num_experts, k_count, wire, 0};
  std::vector<LowLatencyDispatchResult> got(p.ranks);
  std::vector<Tensor> outs(p.ranks);
  std::vector<std::vector<uint16_t>> ys(p.ranks);
  std::vector<std::vector<double>> t_dispatch(p.ranks), t_combine(p.ranks);
  std::vector<std::string> errors(p.ranks);
  std::barrier start(p.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < p.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        const Group g = ranks.group(r);
        Staging io(ranks.device(g));
        ys[r] = verify::random_bf16(l_count * slots * h, o.seed * 17 + r);
        LowLatencyDispatchInput in;
        in.x = io.view(p.inputs[r].x, DType::bf16, {p.inputs[r].tokens, h});
        in.topk_idx = io.view(p.inputs[r].idx, DType::i32, {p.inputs[r].tokens, k_count});
        LowLatencyCombineInput ci;
        ci.y = io.view(ys[r], DType::bf16, {l_count, slots, h});
        const TensorView weights = io.view(p.inputs[r].weights, DType::f32, {p.inputs[r].tokens, k_count});
        if (o.ll_weights_at_dispatch) in.topk_weights = weights;  // sent with the routing
        else ci.topk_weights = weights;
        LowLatencyBuffer buffer(g, cfg);
        buffer.set_stream(io.stream());
        auto timed = [&](std::vector<double>& times, auto&& call) {
          if (!io.on_gpu() || o.ll_eager) return time_calls(o, start, io, times, call);
          // Kernel time, as decode runs it: kGraphCalls calls in one CUDA graph per replay, so
          // neither host launch time nor the ranks' start skew is in the per-call time.
          for (int i = 0; i < o.warmup; ++i) call();  // eager (EPX_PROFILE times their halves)
          io.capture(kGraphCalls, call);
          for (int i = 0; i < o.warmup + o.iters; ++i) {
            start.arrive_and_wait();
            const double us = io.replay_us() / kGraphCalls;
            if (i >= o.warmup) times.push_back(us);
          }
        };
        timed(t_dispatch[r], [&] { got[r] = buffer.dispatch(in); });
        timed(t_combine[r], [&] { outs[r] = buffer.combine(ci, got[r].handle); });
        got[r] = io.fetch(got[r]);  // host copies (views into the buffer on the GPU)
        outs[r] = io.fetch(outs[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  throw_rank_errors(errors);

  const std::vector<int64_t> all(p.ranks, p.cfg.max_tokens_per_rank);
  double rows = 0, remote = 0;  // (token, expert) rows received per rank, and those from other ranks
  for (int r = 0; r < p.ranks; ++r)
    for (int64_t l = 0; l < l_count; ++l) {
      rows += got[r].recv_count.data<int32_t>()[l];
      remote += got[r].recv_count.data<int32_t>()[l] - got[r].recv_layout.data<int32_t>()[(l * p.ranks + r) * 2 + 1];
    }
  rows /= p.ranks;
  remote /= p.ranks;
  std::vector<const std::vector<double>*> td, tc;
  for (int r = 0; r < p.ranks; ++r) td.push_back(&t_dispatch[r]), tc.push_back(&t_combine[r]);
  Record d = base_record(o, ranks, p, "ll_dispatch", wire, "ll", td);
  set_bytes(d, rows * wire_row_bytes(wire, h), remote * wire_row_bytes(wire, h));
  Record c = base_record(o, ranks, p, "ll_combine", WireFormat::bf16, "ll", tc);
  if (o.backend == "cuda") d.sms = c.sms = ranks.sm_count;
  set_bytes(c, rows * 2.0 * h, remote * 2.0 * h);
  for (int r = 0; r < p.ranks && d.verify_error.empty(); ++r) {
    verify::Problem pw = p;
    pw.cfg.wire = wire;
    d.verify_error = verify::check_ll_dispatch(pw, all, r, 0.0f, got[r]);
  }
  for (int r = 0; r < p.ranks && c.verify_error.empty(); ++r) {
    c.verify_error = verify::check_ll_combine(p, all, ys, r, true, outs[r], "rank " + std::to_string(r) + " ll_combine out");
  }
  d.verified = d.verify_error.empty();
  c.verified = c.verify_error.empty();
  return {d, c};
}

void print_table(const std::vector<Record>& records) {
  std::printf("%-18s %-10s %-13s %4s %11s %11s %11s %10s %10s %6s %s\n", "op", "dtype", "layout", "sms", "median_us",
              "min_us", "max_us", "logical", "wire", "link", "verified");
  std::printf("%-18s %-10s %-13s %4s %11s %11s %11s %10s %10s %6s\n", "", "", "", "", "", "", "", "GB/s", "GB/s", "frac");
  for (const Record& r : records)
    std::printf("%-18s %-10s %-13s %4lld %11.1f %11.1f %11.1f %10.2f %10.2f %6.2f %s\n", r.op.c_str(), r.dtype.c_str(),
                r.layout.c_str(), static_cast<long long>(r.sms), r.time_us, r.min_us, r.max_us, r.logical_gbps,
                r.wire_gbps, r.link_fraction,
                r.verified ? "yes" : r.op == "peer_copy" || r.op == "nccl_alltoall" ? "(baseline)"
                                                                                     : ("NO: " + r.verify_error).c_str());
}

int run(const Options& o) {
  verify::ProblemSpec spec;
  spec.cfg.hidden = o.hidden;
  spec.cfg.max_tokens_per_rank = o.tokens;
  spec.cfg.num_experts = o.experts;
  spec.cfg.topk = o.topk;
  spec.cfg.expert_alignment = o.alignment;
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
  spec.cfg.num_sms = o.sms;
  verify::Problem base = verify::make_problem(spec);
  // The shared-GPU transport runs one stream per rank on one GPU: each needs a hardware queue of
  // its own, or a rank's waiting kernel can hold up a peer's queued behind it (docs/cuda.md).
  if (o.shared_gpu) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  const Ranks ranks = make_ranks(o);

  std::vector<Record> records;
  std::vector<std::vector<double>> bytes_to;  // the bf16 dispatch's traffic, for the NCCL baseline
  const size_t configs = o.layouts.size() * o.wires.size();
  size_t done = 0;
  const bool any_ht = wants(o, "dispatch") || wants(o, "combine") || wants(o, "dispatch_backward") ||
                      wants(o, "combine_backward");
  for (Layout layout : any_ht ? o.layouts : std::vector<Layout>{})
    for (WireFormat wire : o.wires) {
      std::fprintf(stderr, "[%zu/%zu] %s %s ...\n", ++done, configs, std::string(layout_name(layout)).c_str(),
                   std::string(wire_name(wire)).c_str());
      verify::Problem p = base;
      p.cfg.wire = wire;
      // combine and the backward passes take bf16 whatever the dispatch wire; run them once.
      const bool with_combine = wire == o.wires.front();
      const auto outs = run_config(o, ranks, p, layout, with_combine);
      if (bytes_to.empty() && wire == WireFormat::bf16) bytes_to = traffic_matrix(outs, 2.0 * p.cfg.hidden);
      if (wants(o, "dispatch")) records.push_back(make_record(o, ranks, p, "dispatch", wire, layout, outs));
      if (!with_combine) continue;
      for (const char* op : {"combine", "dispatch_backward", "combine_backward"})
        if (wants(o, op)) records.push_back(make_record(o, ranks, p, op, WireFormat::bf16, layout, outs));
    }
  if (wants(o, "ll_dispatch") || wants(o, "ll_combine"))
    for (WireFormat wire : o.wires) {
      std::fprintf(stderr, "[ll] %s ...\n", std::string(wire_name(wire)).c_str());
      for (Record& r : run_low_latency(o, ranks, base, wire))  // ll_combine moves bf16 whatever the wire: once
        if (wants(o, r.op) && (r.op == "ll_dispatch" || wire == o.wires.front())) records.push_back(std::move(r));
    }
  if (!bytes_to.empty())
    for (Record& r : measure_baselines(o, bytes_to)) records.push_back(std::move(r));
  // Every record's wire rate as a fraction of what a plain peer copy got in this run.
  for (const Record& base : records)
    if (base.op == "peer_copy")
      for (Record& r : records) r.link_fraction = r.wire_gbps / base.wire_gbps;
  print_table(records);
  const bool all_ok = std::all_of(records.begin(), records.end(), [](const Record& r) {
    return r.verified || r.op == "peer_copy" || r.op == "nccl_alltoall";
  });
  if (!o.json.empty()) {
    if (!write_json(o.json, records)) {
      std::fprintf(stderr, "epx-bench: cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::printf("wrote %zu records to %s\n", records.size(), o.json.c_str());
  }
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
