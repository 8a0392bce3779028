// High-throughput runs of one rank: ht_run.hpp.
#include "bench/ht_run.hpp"

#include <algorithm>
#include <cstdlib>

#include "bench/floors.hpp"
#include "verify/replicas.hpp"

namespace epx::bench {

RankOutputs run_rank(const Options& o, const Group& g, int device, const verify::Problem& p, Layout layout,
                     bool with_combine, const std::function<void()>& arrive) {
  const int r = g.rank();
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  const bool weighted = layout == Layout::expert_major;
  Staging io(device);
  RankOutputs out;
  auto timed = [&](const std::string& op, auto&& call) { time_calls(o, arrive, io, out.times_us[op], call); };
  Buffer buffer(g, p.cfg);
  buffer.set_stream(io.stream());
  const verify::RankInput& in = p.inputs[r];
  const int64_t tokens = in.tokens;
  DispatchInput din;
  din.x = io.view(in.x, DType::bf16, {tokens, h});
  din.topk_idx = io.view(in.idx, DType::i32, {tokens, k_count});
  din.topk_weights = io.view(in.weights, DType::f32, {tokens, k_count});
  if (!p.replicas.empty())
    din.expert_replicas = io.view(p.replicas, DType::i32, {p.cfg.num_experts, p.cfg.max_replicas});
  DispatchOptions dopt;
  dopt.layout = layout;
  DispatchResult d;
  timed("dispatch", [&] { d = buffer.dispatch(din, dopt); });
  out.dispatched = io.fetch(d);
  if (!with_combine) return out;
  const int64_t rows = d.recv_x.size(0);
  make_rank_inputs(o, p, r, rows, weighted, out);
  const TensorView y = io.view(out.y, DType::bf16, {rows, h});
  if (wants(o, "combine")) {
    CombineResult c;
    timed("combine", [&] { c = buffer.combine({y, {}}, d.handle, {weighted}); });
    out.combined.out = io.fetch(c.out);
  }
  if (wants(o, "dispatch_backward")) {
    const TensorView gw =
        weighted ? io.view(out.grad_w_in, DType::f32, {rows}) : io.view(out.grad_w_in, DType::f32, {rows, k_count});
    const TensorView gx = io.view(out.grad_x_in, DType::bf16, {rows, h});
    DispatchBackwardResult b;
    timed("dispatch_backward", [&] { b = buffer.dispatch_backward({gx, gw}, d.handle); });
    out.dispatch_grad.grad_x = io.fetch(b.grad_x);
    out.dispatch_grad.grad_topk_weights = io.fetch(b.grad_topk_weights);
  }
  if (wants(o, "combine_backward")) {
    const TensorView go = io.view(out.grad_out, DType::bf16, {tokens, h});
    CombineBackwardResult b;
    timed("combine_backward", [&] { b = buffer.combine_backward({go, y}, d.handle, {weighted}); });
    out.combine_grad.grad_y = io.fetch(b.grad_y);
    out.combine_grad.grad_topk_weights = io.fetch(b.grad_topk_weights);
  }
  return out;
}

void use_capacity_mode(const Options& o, verify::Problem& p, Layout layout) {
  int64_t rows = o.capacity_rows;
  if (rows == 0) {
    const verify::Problem q = p.replicas.empty() ? p : verify::physical_problem(p);
    const auto kept = verify::kept_routing(q);
    for (int r = 0; r < q.ranks; ++r)
      rows = std::max(rows, static_cast<int64_t>(verify::expected_dispatch(q, kept, r, layout).rows.size()));
    rows = std::max<int64_t>(rows, 1);
  }
  p.cfg.mode = CapacityMode::capacity;
  p.cfg.capacity_rows = rows;
}

void make_rank_inputs(const Options& o, const verify::Problem& p, int r, int64_t rows, bool weighted, RankOutputs& out) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  out.y = verify::random_bf16(rows * h, o.seed * 7 + r);
  if (wants(o, "dispatch_backward")) {
    out.grad_x_in = verify::random_bf16(rows * h, o.seed * 11 + r);
    out.grad_w_in.assign(rows * (weighted ? 1 : k_count), 0.5f);
    for (size_t i = 0; i < out.grad_w_in.size(); ++i) out.grad_w_in[i] = static_cast<float>(i % 17) * 0.125f - 1.0f;
  }
  if (wants(o, "combine_backward")) out.grad_out = verify::random_bf16(p.inputs[r].tokens * h, o.seed * 13 + r);
}

namespace {
// EPLB: the choice dispatch reports is the rule's (verify/replicas.hpp).
std::string check_topk_physical(const std::vector<int32_t>& want, const Tensor& got, int rank) {
  if (got.numel() != static_cast<int64_t>(want.size()) || !std::equal(want.begin(), want.end(), got.data<int32_t>()))
    return "rank " + std::to_string(rank) + ": topk_physical is not the replica rule's choice";
  return "";
}
}  // namespace

std::string verify_op(const std::string& op, const verify::Problem& given, Layout layout,
                      const std::vector<RankOutputs>& outs, int only) {
  // EPLB: the outputs are those of the plain problem of P experts in the rule's physical routing.
  const verify::Problem p = given.replicas.empty() ? given : verify::physical_problem(given);
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
  for (int r = only < 0 ? 0 : only; r < (only < 0 ? p.ranks : only + 1) && err.empty(); ++r) {
    const RankOutputs& o = outs[r];
    const int64_t tokens = p.inputs[r].tokens;
    if (op == "dispatch") {
      err = verify::check_dispatch(p, kept, r, layout, 0.0f, o.dispatched);
      if (err.empty() && !given.replicas.empty()) err = check_topk_physical(p.inputs[r].idx, o.dispatched.topk_physical, r);
    } else if (op == "combine") {
      const auto want = verify::expected_combine(p, kept, layouts, gather(&RankOutputs::y), r, layout, weighted, nullptr);
      err = verify::compare_bits(o.combined.out.data<uint16_t>(), want.data(), tokens * h, 2, "combine out");
    } else if (op == "dispatch_backward") {
      const auto want = verify::expected_grad_x(p, kept, layouts, gather(&RankOutputs::grad_x_in), r, layout);
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

std::pair<double, double> rank_bytes(const DispatchResult& d, int r, int ranks, double row_bytes) {
  const int64_t* off = d.rank_offsets.data<int64_t>();
  const double received = static_cast<double>(off[ranks]);
  return {received * row_bytes, (received - static_cast<double>(off[r + 1] - off[r])) * row_bytes};
}

// DeepEP's accounting: a rank receives each token once per destination rank (its own tokens
// included); `row_bytes` per token. Returns {logical bytes, bytes from other ranks}, per rank.
std::pair<double, double> bytes_per_rank(const std::vector<RankOutputs>& outs, double row_bytes) {
  double logical = 0, wire = 0;
  const int ranks = static_cast<int>(outs.size());
  for (int r = 0; r < ranks; ++r) {
    const auto [l, w] = rank_bytes(outs[r].dispatched, r, ranks, row_bytes);
    logical += l;
    wire += w;
  }
  return {logical / ranks, wire / ranks};
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
  rec.combine_wire = std::string(wire_name(p.cfg.combine_wire));
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
  rec.shared_expert = o.shared_expert;
  rec.replicas = o.replicas;
  if (p.cfg.mode == CapacityMode::capacity && op.rfind("ll_", 0) != 0) rec.capacity_rows = p.cfg.capacity_rows;
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
  // dispatch rows in its wire, combine's partials in the combine wire, the backward passes' in bf16.
  const double row_bytes = op == "dispatch"  ? wire_row_bytes(wire, p.cfg.hidden)
                           : op == "combine" ? wire_row_bytes(p.cfg.combine_wire, p.cfg.hidden)
                                             : 2.0 * p.cfg.hidden;
  const auto [logical, wire_bytes] = bytes_per_rank(outs, row_bytes);
  set_bytes(rec, logical, wire_bytes);
  std::vector<HbmBytes> per_rank;
  for (int r = 0; r < static_cast<int>(outs.size()); ++r)
    per_rank.push_back(rank_hbm_bytes(op, p, wire, layout == Layout::expert_major, outs[r], r));
  const HbmBytes hbm = busiest(per_rank);
  rec.hbm_read_bytes = hbm.read;
  rec.hbm_write_bytes = hbm.write;
  rec.verify_error = verify_op(op, p, layout, outs);
  rec.verified = rec.verify_error.empty();
  return rec;
}

}  // namespace epx::bench
