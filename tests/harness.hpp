// Test harness: run a whole problem (dispatch, combine, both backward passes) on a host
// group and keep every rank's inputs and outputs for comparison with the reference.
#pragma once
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "verify/random_inputs.hpp"
#include "verify/reference.hpp"
#include "verify/run_ranks.hpp"

namespace epx::test {

struct RankRun {
  DispatchResult dispatched;
  DispatchResult cached;            // cached dispatch of fresh_x_problem(p)'s x with the dispatch's handle
  std::vector<uint16_t> y;          // combine input [rows, H] (padding rows random too)
  std::vector<uint16_t> shared;     // shared-expert rows [T, H]
  CombineResult combined;
  std::vector<uint16_t> grad_recv_x;
  std::vector<float> grad_recv_weights;
  DispatchBackwardResult dispatch_grad;
  std::vector<uint16_t> grad_out;
  CombineBackwardResult combine_grad;
};

struct RunOptions {
  DispatchOptions dispatch;
  bool combine = true;
  bool backward = true;
  bool shared_expert = true;
  bool cached = true;  // a cached dispatch of new x after the dispatch
};

// The problem with BufferConfig::shared_expert on, and with `gate`, a shared_gate on each rank
// (values in [-1, 1] in steps of 1/8, zero included).
inline verify::Problem with_shared_expert(verify::Problem p, bool gate) {
  p.cfg.shared_expert = true;
  for (int r = 0; r < p.ranks; ++r) {
    auto& in = p.inputs[r];
    in.shared_gate.clear();
    for (int64_t t = 0; gate && t < in.tokens; ++t) in.shared_gate.push_back(0.125f * static_cast<float>((t * 5 + r) % 17) - 1.0f);
  }
  return p;
}

// The fused shared expert's test modes (both backends' suites): blocking; capacity mode with room
// for every row; capacity mode with room for the shared segment and 3 routed rows (overflow); and
// capacity-factor dropping (0.5, with skewed routing).
enum class SharedMode { blocking, capacity, overflow, dropping };

inline const char* shared_mode_name(SharedMode m) {
  const char* names[] = {"blocking", "capacity", "overflow", "dropping"};
  return names[static_cast<int>(m)];
}

// cfg for `mode` (cfg's shape already set: ranks, tokens, experts, topk, alignment).
inline void apply_shared_mode(BufferConfig& cfg, SharedMode mode, int ranks) {
  const int64_t a = cfg.expert_alignment, shared_rows = (cfg.max_tokens_per_rank + a - 1) / a * a;
  if (mode == SharedMode::capacity || mode == SharedMode::overflow) {
    cfg.mode = CapacityMode::capacity;
    cfg.capacity_rows = mode == SharedMode::capacity
                            ? shared_rows + ranks * cfg.max_tokens_per_rank * cfg.topk + cfg.num_experts * a
                            : shared_rows + 3;
  }
  if (mode == SharedMode::dropping) cfg.capacity_factor = 0.5;
}

// A shared-expert problem of `ranks` ranks on cfg (shared_expert set here): rank r has
// tokens - 3r tokens (mod tokens + 1), rank 1 none; 10% unused slots; skewed routing when
// dropping; router weights when `weights`, a shared_gate on every rank when `gate`.
inline verify::Problem shared_problem(const BufferConfig& cfg, int ranks, SharedMode mode, bool gate, bool weights,
                                      uint64_t seed, bool prequantized = false) {
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.prequantized = prequantized;
  spec.ranks = ranks;
  const int64_t tokens = cfg.max_tokens_per_rank;
  for (int r = 0; r < ranks; ++r) spec.tokens.push_back(r == 1 ? 0 : tokens - 3 * r % (tokens + 1));
  spec.routing = mode == SharedMode::dropping ? verify::Routing::skewed : verify::Routing::uniform;
  spec.unused_slot_fraction = 0.1;
  spec.seed = seed;
  verify::Problem p = verify::make_problem(spec);
  for (auto& in : p.inputs) in.has_weights = weights;
  return with_shared_expert(p, gate);
}

// The mode's effect happened: an overflow lost rows somewhere, dropping dropped slots.
template <class Runs>
void expect_shared_mode_effect(const Runs& runs, SharedMode mode) {
  if (mode == SharedMode::overflow) {
    bool any = false;
    for (const auto& run : runs) any |= run.dispatched.overflow;
    EXPECT_TRUE(any) << "the overflow case lost no rows";
  }
  if (mode == SharedMode::dropping) {
    int64_t dropped = 0;
    for (const auto& run : runs) dropped += run.dispatched.dropped_slots;
    EXPECT_GT(dropped, 0);
  }
}

// The cached dispatch's input: the problem's routing with other token values.
inline verify::Problem fresh_x_problem(const verify::Problem& p) { return verify::with_fresh_x(p, 77); }

// A cached dispatch's input: the rows of `in` (x, and x_scales with pre-quantized fp8) only.
inline DispatchInput x_only(const DispatchInput& in) {
  DispatchInput out;
  out.x = in.x;
  out.x_scales = in.x_scales;
  return out;
}

// The cached dispatch's input of rank r.
inline DispatchInput cached_input(const verify::Problem& fresh, int r) {
  return x_only(fresh.inputs[r].view(fresh.cfg.hidden, fresh.cfg.topk));
}

// The code of the epx::Error that call() throws (its words into *what); internal when it throws
// none, never what a test expects.
inline ErrorCode code_of(const std::function<void()>& call, std::string* what = nullptr) {
  try {
    call();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  return ErrorCode::internal;
}

inline TensorView bf16_view(const std::vector<uint16_t>& v, int64_t rows, int64_t h) {
  return TensorView::of(const_cast<uint16_t*>(v.data()), DType::bf16, {rows, h});
}

// Runs the problem; fails the test (and returns early) if any rank threw.
inline std::vector<RankRun> run_problem(const verify::Problem& p, const RunOptions& o) {
  std::vector<RankRun> runs(p.ranks);
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  const bool weighted = o.dispatch.layout == Layout::expert_major && p.inputs[0].has_weights;
  const verify::Problem fresh = fresh_x_problem(p);
  auto errors = verify::run_ranks(p.ranks, [&](const Group& g) {
    const int r = g.rank();
    RankRun& run = runs[r];
    Buffer buffer(g, p.cfg);
    run.dispatched = buffer.dispatch(p.inputs[r].view(h, k_count), o.dispatch);
    if (o.cached) run.cached = buffer.dispatch(cached_input(fresh, r), run.dispatched.handle, {o.dispatch.nvfp4_global_scale});
    if (!o.combine) return;
    const int64_t rows = run.dispatched.recv_x.size(0), tokens = p.inputs[r].tokens;
    run.y = verify::random_bf16(rows * h, 100 + r);
    run.shared = verify::random_bf16(tokens * h, 200 + r);
    run.combined = buffer.combine({bf16_view(run.y, rows, h), o.shared_expert ? bf16_view(run.shared, tokens, h) : TensorView{}},
                                  run.dispatched.handle, {weighted});
    if (!o.backward) return;
    run.grad_recv_x = verify::random_bf16(rows * h, 300 + r);
    const int64_t per_row = o.dispatch.layout == Layout::expert_major ? 1 : k_count;
    run.grad_recv_weights.resize(rows * per_row);
    for (size_t i = 0; i < run.grad_recv_weights.size(); ++i) run.grad_recv_weights[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
    TensorView gw = o.dispatch.layout == Layout::expert_major ? TensorView::of(run.grad_recv_weights.data(), DType::f32, {rows})
                                 : TensorView::of(run.grad_recv_weights.data(), DType::f32, {rows, k_count});
    run.dispatch_grad = buffer.dispatch_backward({bf16_view(run.grad_recv_x, rows, h), gw}, run.dispatched.handle);
    run.grad_out = verify::random_bf16(tokens * h, 400 + r);
    run.combine_grad = buffer.combine_backward({bf16_view(run.grad_out, tokens, h), bf16_view(run.y, rows, h)},
                                               run.dispatched.handle, {weighted});
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return runs;
}

// BufferConfig::shared_expert: both backward passes' grad_shared_gate of rank s against the
// reference (combine_backward's only when weighted with a gate).
inline void expect_shared_gate_grads(const verify::Problem& p, const verify::Expected& layout, const RankRun& run, int s,
                                     bool weighted) {
  const int64_t h = p.cfg.hidden, tokens = p.inputs[s].tokens;
  const auto want_gathered = verify::expected_shared_gate_grad(p, layout, s, [&](int64_t row) { return run.grad_recv_weights[row]; });
  ASSERT_TRUE(run.dispatch_grad.grad_shared_gate.defined());
  ASSERT_EQ(verify::compare_bits(run.dispatch_grad.grad_shared_gate.data<float>(), want_gathered.data(), tokens, 4,
                                 "dispatch_backward grad_shared_gate"), "")
      << "rank " << s;
  const bool gate = !p.inputs[s].shared_gate.empty();
  ASSERT_EQ(run.combine_grad.grad_shared_gate.defined(), weighted && gate) << "rank " << s;
  if (!(weighted && gate)) return;
  const auto want_dot = verify::expected_shared_gate_grad(p, layout, s, [&](int64_t row) {
    return verify::lane_dot(&run.grad_out[layout.rows[row].src_token * h], &run.y[row * h], h);
  });
  ASSERT_EQ(verify::compare_bits(run.combine_grad.grad_shared_gate.data<float>(), want_dot.data(), tokens, 4,
                                 "combine_backward grad_shared_gate"), "")
      << "rank " << s;
}

// Compares every output of every rank with the reference, bit for bit.
inline void expect_matches_reference(const verify::Problem& p, const RunOptions& o, const std::vector<RankRun>& runs) {
  const Layout layout = o.dispatch.layout;
  const auto kept = verify::kept_routing(p);
  std::vector<verify::Expected> layouts;
  for (int r = 0; r < p.ranks; ++r) {
    layouts.push_back(verify::expected_dispatch(p, kept, r, layout));
    ASSERT_EQ(verify::check_dispatch(p, kept, r, layout, o.dispatch.nvfp4_global_scale, runs[r].dispatched), "");
  }
  if (o.cached) {  // the new rows in the same layout: what a dispatch of the new x returns
    const verify::Problem fresh = fresh_x_problem(p);
    for (int r = 0; r < p.ranks; ++r) {
      DispatchResult both = runs[r].dispatched;
      both.recv_x = runs[r].cached.recv_x;
      both.recv_scales = runs[r].cached.recv_scales;
      both.recv_global_scale = runs[r].cached.recv_global_scale;
      ASSERT_EQ(verify::check_dispatch(fresh, kept, r, layout, o.dispatch.nvfp4_global_scale, both), "")
          << "cached dispatch, rank " << r;
    }
  }
  if (!o.combine) return;
  const bool weighted = layout == Layout::expert_major && p.inputs[0].has_weights;
  const int64_t h = p.cfg.hidden;
  std::vector<std::vector<uint16_t>> ys, grad_x_in, grad_out;
  std::vector<std::vector<float>> grad_w_in;
  for (const auto& run : runs) {
    ys.push_back(run.y);
    grad_x_in.push_back(run.grad_recv_x);
    grad_w_in.push_back(run.grad_recv_weights);
    grad_out.push_back(run.grad_out);
  }
  for (int s = 0; s < p.ranks; ++s) {
    const RankRun& run = runs[s];
    const int64_t tokens = p.inputs[s].tokens;
    const auto want = verify::expected_combine(p, kept, layouts, ys, s, layout, weighted, o.shared_expert ? &run.shared : nullptr);
    ASSERT_EQ(run.combined.out.numel(), tokens * h);
    ASSERT_EQ(verify::compare_bits(run.combined.out.data<uint16_t>(), want.data(), tokens * h, 2, "combine out"), "")
        << "rank " << s;
    if (!o.backward) continue;
    const auto want_gx = verify::expected_grad_x(p, kept, layouts, grad_x_in, s, layout);
    ASSERT_EQ(verify::compare_bits(run.dispatch_grad.grad_x.data<uint16_t>(), want_gx.data(), tokens * h, 2, "grad_x"), "")
        << "rank " << s;
    const auto want_gtw = verify::expected_gathered_weights(p, kept, layouts, grad_w_in, s, layout);
    ASSERT_EQ(verify::compare_bits(run.dispatch_grad.grad_topk_weights.data<float>(), want_gtw.data(),
                                   static_cast<int64_t>(want_gtw.size()), 4, "dispatch_backward grad_topk_weights"), "")
        << "rank " << s;
    const auto want_gy = verify::expected_grad_y(p, layouts[s], grad_out, weighted);
    ASSERT_EQ(verify::compare_bits(run.combine_grad.grad_y.data<uint16_t>(), want_gy.data(),
                                   static_cast<int64_t>(want_gy.size()), 2, "grad_y"), "")
        << "rank " << s;
    if (weighted) {
      const auto want_gw = verify::expected_grad_w(p, kept, layouts, grad_out, ys, s);
      ASSERT_EQ(verify::compare_bits(run.combine_grad.grad_topk_weights.data<float>(), want_gw.data(),
                                     static_cast<int64_t>(want_gw.size()), 4, "combine_backward grad_topk_weights"), "")
          << "rank " << s;
    }
    if (p.cfg.shared_expert) expect_shared_gate_grads(p, layouts[s], run, s, weighted);
  }
}

inline BufferConfig small_config(int64_t hidden, int64_t tokens, int64_t experts, int64_t topk,
                                 WireFormat wire = WireFormat::bf16, int64_t alignment = 1) {
  BufferConfig c;
  c.hidden = hidden;
  c.max_tokens_per_rank = tokens;
  c.num_experts = experts;
  c.topk = topk;
  c.wire = wire;
  c.expert_alignment = alignment;
  c.timeout_ms = 20000;
  return c;
}

inline LowLatencyConfig small_ll_config(int64_t hidden, int64_t tokens, int64_t experts, int64_t topk,
                                        WireFormat wire = WireFormat::bf16) {
  LowLatencyConfig l;
  l.hidden = hidden;
  l.max_tokens_per_rank = tokens;
  l.num_experts = experts;
  l.topk = topk;
  l.wire = wire;
  l.timeout_ms = 20000;
  return l;
}

// Every round's low-latency dispatch and combine on every rank against the reference. Only the
// counted rows travel: the reference sees each problem cut to its num_tokens (counts[round][rank]).
inline void expect_ll_rounds_match(const std::vector<verify::Problem>& problems,
                                   const std::vector<std::vector<int64_t>>& counts,
                                   const std::vector<std::vector<std::vector<uint16_t>>>& ys,
                                   const std::vector<std::vector<LowLatencyDispatchResult>>& got,
                                   const std::vector<std::vector<Tensor>>& outs) {
  for (size_t i = 0; i < problems.size(); ++i)
    for (int r = 0; r < problems[i].ranks; ++r) {
      ASSERT_EQ(verify::check_ll_dispatch(problems[i], counts[i], r, 0.0f, got[i][r]), "") << "round " << i;
      ASSERT_EQ(verify::check_ll_combine(problems[i], counts[i], ys[i], r, true, outs[i][r], "ll_combine out"), "")
          << "round " << i << " rank " << r;
    }
}

}  // namespace epx::test
