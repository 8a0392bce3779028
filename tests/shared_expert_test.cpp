// The fused shared expert (BufferConfig::shared_expert, docs/semantics.md): every operation
// against the reference bit for bit, the layout and the summation order stated directly, and
// the refusals.
#include "harness.hpp"

namespace epx::test {
namespace {

struct Case {
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
  int64_t alignment;
  bool gate;     // a shared_gate given to dispatch
  bool weights;  // router weights (weighted combine)
  SharedMode mode;
  WireFormat combine_wire = WireFormat::bf16;  // the partials' form on the way back (the shared row never crosses)
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "R" + std::to_string(c.ranks) + "_H" + std::to_string(c.hidden) + "_T" + std::to_string(c.tokens) + "_E" +
         std::to_string(c.experts) + "_K" + std::to_string(c.topk) + "_" + std::string(wire_name(c.wire)) + "_A" +
         std::to_string(c.alignment) + (c.gate ? "_gate" : "_nogate") + (c.weights ? "" : "_noweights") + "_" +
         shared_mode_name(c.mode) +
         (c.combine_wire == WireFormat::bf16 ? "" : "_combine_" + std::string(wire_name(c.combine_wire)));
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(testing::TestParamInfo<Case>(c, 0)); }

BufferConfig case_config(const Case& c) {
  BufferConfig cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire, c.alignment);
  apply_shared_mode(cfg, c.mode, c.ranks);
  cfg.combine_wire = c.combine_wire;
  return cfg;
}

class SharedExpert : public testing::TestWithParam<Case> {};

TEST_P(SharedExpert, MatchesTheReference) {
  const Case& c = GetParam();
  const verify::Problem p = shared_problem(case_config(c), c.ranks, c.mode, c.gate, c.weights,
                                           static_cast<uint64_t>(c.ranks * 37 + c.hidden + c.alignment));
  RunOptions o;
  o.shared_expert = c.ranks % 2 == 0;  // shared_out as well on even rank counts: both terms, in order
  const auto runs = run_problem(p, o);
  expect_matches_reference(p, o, runs);
  expect_shared_mode_effect(runs, c.mode);
}

using W = WireFormat;
using M = SharedMode;

INSTANTIATE_TEST_SUITE_P(
    Shapes, SharedExpert,
    testing::Values(Case{1, 256, 24, 8, 2, W::bf16, 1, false, true, M::blocking},
                    Case{2, 256, 32, 16, 4, W::bf16, 1, true, true, M::blocking},
                    Case{2, 256, 32, 16, 4, W::bf16, 1, false, false, M::blocking},
                    Case{3, 128, 20, 12, 3, W::bf16, 8, true, true, M::blocking},
                    Case{4, 256, 40, 32, 8, W::bf16, 16, false, true, M::blocking},
                    Case{8, 128, 24, 64, 8, W::bf16, 128, true, true, M::blocking},
                    Case{2, 256, 32, 16, 4, W::fp8, 4, true, true, M::blocking},
                    Case{2, 256, 32, 16, 4, W::fp8_ue8m0, 1, false, true, M::blocking},
                    Case{3, 64, 20, 12, 2, W::nvfp4, 8, true, true, M::blocking},
                    Case{2, 128, 32, 8, 4, W::bf16, 4, true, true, M::capacity},
                    Case{3, 128, 32, 12, 4, W::bf16, 8, true, true, M::overflow},
                    Case{2, 128, 40, 8, 2, W::bf16, 1, true, true, M::dropping},
                    Case{4, 64, 40, 8, 2, W::bf16, 4, false, true, M::dropping},
                    // with the low-precision combine wire: the partials cross as fp8, the shared row not at all
                    Case{2, 256, 32, 16, 4, W::bf16, 1, true, true, M::blocking, W::fp8},
                    Case{3, 256, 32, 12, 4, W::fp8, 8, false, true, M::overflow, W::fp8_ue8m0},
                    Case{2, 128, 40, 8, 2, W::bf16, 1, true, true, M::dropping, W::fp8}),
    case_name);

// Stated without the reference: segment 0 is this rank's own tokens, padded; the offsets and
// counts have the shared segment first.
TEST(SharedExpertLayout, SegmentZeroIsTheRanksOwnTokens) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(64, 10, 8, 2, WireFormat::bf16, 4);
  spec.ranks = 2;
  spec.seed = 5;
  const auto p = with_shared_expert(verify::make_problem(spec), true);
  RunOptions o;
  o.combine = false;
  const auto runs = run_problem(p, o);
  for (int r = 0; r < 2; ++r) {
    const DispatchResult& d = runs[r].dispatched;
    ASSERT_EQ(d.expert_offsets.numel(), 4 + 2);  // L = 4: the shared segment and 4 experts
    ASSERT_EQ(d.tokens_per_expert.numel(), 4 + 1);
    EXPECT_EQ(d.tokens_per_expert.data<int64_t>()[0], 10);
    EXPECT_EQ(d.expert_offsets.data<int64_t>()[0], 0);
    EXPECT_EQ(d.expert_offsets.data<int64_t>()[1], 12);  // 10 rows padded to 4
    for (int64_t t = 0; t < 12; ++t) {
      const int32_t* src = d.recv_src.data<int32_t>() + 2 * t;
      const bool real = t < 10;
      EXPECT_EQ(src[0], real ? r : -1);
      EXPECT_EQ(src[1], real ? t : -1);
      EXPECT_EQ(d.recv_weights.data<float>()[t], real ? p.inputs[r].shared_gate[t] : 0.0f);
      for (int64_t c = 0; c < 64; ++c)
        ASSERT_EQ(d.recv_x.data<uint16_t>()[t * 64 + c], real ? p.inputs[r].x[t * 64 + c] : 0) << "row " << t;
    }
  }
}

// The shared term enters after the rank-ordered partials: partials -1 (rank 0) and 1 (rank 1),
// shared row 2^-30 give (-1 + 1) + 2^-30 = 2^-30; the shared term first would give 0.
TEST(SharedExpertCombine, TheSharedTermComesAfterTheRanks) {
  const int64_t h = 8;
  BufferConfig cfg = small_config(h, 1, 2, 2);
  cfg.shared_expert = true;
  uint16_t result = 0;
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer b(g, cfg);
    const int64_t tokens = g.rank() == 0 ? 1 : 0;
    std::vector<uint16_t> x(h, float_to_bf16(1.0f));
    std::vector<int32_t> idx = {0, 1};
    std::vector<float> w(2, 1.0f);
    DispatchInput in;
    in.x = TensorView::of(x.data(), DType::bf16, {tokens, h});
    in.topk_idx = TensorView::of(idx.data(), DType::i32, {tokens, 2});
    in.topk_weights = TensorView::of(w.data(), DType::f32, {tokens, 2});
    auto d = b.dispatch(in);
    const int64_t rows = d.recv_x.size(0), shared_end = d.expert_offsets.data<int64_t>()[1];
    std::vector<uint16_t> y(rows * h);
    for (int64_t i = 0; i < rows; ++i)  // the shared rows 2^-30; the routed rows -1 on rank 0, 1 on rank 1
      std::fill_n(&y[i * h], h, float_to_bf16(i < shared_end ? 0x1p-30f : g.rank() == 0 ? -1.0f : 1.0f));
    auto out = b.combine({bf16_view(y, rows, h), {}}, d.handle, {true});
    if (g.rank() == 0) result = out.out.data<uint16_t>()[0];
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(result, float_to_bf16(0x1p-30f));
}

// Every rank's error code and message from fn(group) (invalid_argument: 1, ..., none: 0).
std::vector<std::pair<ErrorCode, std::string>> errors_of(int ranks, const std::function<void(const Group&)>& fn) {
  std::vector<std::pair<ErrorCode, std::string>> out(ranks, {ErrorCode{}, ""});
  verify::run_ranks(ranks, [&](const Group& g) {
    try {
      fn(g);
    } catch (const Error& e) {
      out[g.rank()] = {e.code(), e.what()};
    }
  });
  return out;
}

TEST(SharedExpertRefusals, RankMajorAGateWithoutASharedExpertAndAGateWithoutWeights) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(64, 8, 4, 2);
  spec.ranks = 2;
  const auto plain = verify::make_problem(spec);
  const auto shared = with_shared_expert(plain, true);
  const auto rank_major = errors_of(2, [&](const Group& g) {
    Buffer b(g, shared.cfg);
    b.dispatch(shared.inputs[g.rank()].view(64, 2), {Layout::rank_major});
  });
  for (const auto& [code, what] : rank_major) {
    EXPECT_EQ(code, ErrorCode::invalid_argument);
    EXPECT_THAT(what, testing::HasSubstr("shared_expert needs the expert-major layout"));
  }
  const auto gate_alone = errors_of(2, [&](const Group& g) {
    Buffer b(g, plain.cfg);
    DispatchInput in = shared.inputs[g.rank()].view(64, 2);  // has a shared_gate
    b.dispatch(in);
  });
  for (const auto& [code, what] : gate_alone) {
    EXPECT_EQ(code, ErrorCode::invalid_argument);
    EXPECT_THAT(what, testing::HasSubstr("shared_gate given but the buffer has no shared expert"));
  }
  const auto gate_unweighted = errors_of(2, [&](const Group& g) {  // no combine could apply the gate
    Buffer b(g, shared.cfg);
    DispatchInput in = shared.inputs[g.rank()].view(64, 2);
    if (g.rank() == 1) in.topk_weights = TensorView{};
    b.dispatch(in);
  });
  EXPECT_EQ(gate_unweighted[1].first, ErrorCode::invalid_argument);
  EXPECT_THAT(gate_unweighted[1].second, testing::HasSubstr("shared_gate needs router weights"));
  EXPECT_EQ(gate_unweighted[0].first, ErrorCode::peer_failed);
}

TEST(SharedExpertRefusals, CapacityBelowTheSharedSegmentAndLowLatency) {
  BufferConfig cfg = small_config(64, 10, 4, 2, WireFormat::bf16, 4);
  cfg.shared_expert = true;
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = 11;  // the shared segment needs 12
  for (const auto& [code, what] : errors_of(2, [&](const Group& g) { Buffer b(g, cfg); })) {
    EXPECT_EQ(code, ErrorCode::invalid_argument);
    EXPECT_THAT(what, testing::HasSubstr("shared_expert in capacity mode needs capacity_rows >= 12"));
  }
}

// --- low-latency mode -------------------------------------------------------------------------

// One rank's low-latency dispatch and combine, with or without the shared expert: the outputs
// and the combined rows (y: the shared expert's rows times `shared_y`, the routed rows random).
struct LlRun {
  LowLatencyDispatchResult d;
  Tensor out;
};

LlRun ll_run(const Group& g, const verify::Problem& p, bool shared, float shared_y, const float* gate,
             bool split = false) {
  const int r = g.rank();
  const verify::RankInput& in = p.inputs[r];
  const int64_t h = p.cfg.hidden, k = p.cfg.topk;
  LowLatencyConfig cfg = small_ll_config(h, p.cfg.max_tokens_per_rank, p.cfg.num_experts, k, p.cfg.wire);
  cfg.shared_expert = shared;
  LowLatencyBuffer b(g, cfg);
  int32_t n = static_cast<int32_t>(in.tokens - (r % 2));  // an odd rank's last row does not count
  LowLatencyDispatchInput d;
  d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {in.tokens, h});
  d.topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {in.tokens, k});
  d.num_tokens = TensorView::of(&n, DType::i32, {1});
  d.topk_weights = TensorView::of(const_cast<float*>(in.weights.data()), DType::f32, {in.tokens, k});
  if (gate) d.shared_gate = TensorView::of(const_cast<float*>(gate), DType::f32, {in.tokens});
  LlRun run;
  if (split) {  // the send and receive halves
    b.dispatch_send(d);
    run.d = b.dispatch_recv();
  } else {
    run.d = b.dispatch(d);
  }
  const int64_t experts = run.d.recv_x.size(0), slots = run.d.recv_x.size(1), first = shared ? 1 : 0;
  std::vector<uint16_t> y(experts * slots * h, 0);
  const auto routed = verify::random_bf16((experts - first) * slots * h, 700 + r);
  std::copy(routed.begin(), routed.end(), y.begin() + first * slots * h);
  for (int64_t i = 0; shared && i < slots * h; ++i) y[i] = float_to_bf16(shared_y * bf16_to_float(routed[i]));
  const LowLatencyCombineInput ci{TensorView::of(y.data(), DType::bf16, {experts, slots, h}), {}, true};
  if (split) {
    b.combine_send(ci, run.d.handle);
    run.out = b.combine_recv();
  } else {
    run.out = b.combine(ci, run.d.handle);
  }
  return run;
}

// The split halves give what the fused calls give, with the shared expert and its gate (NVFP4 too).
TEST(SharedExpertLowLatency, TheSplitHalvesEqualTheFusedCalls) {
  for (WireFormat wire : {WireFormat::bf16, WireFormat::nvfp4}) {
    verify::ProblemSpec spec;
    spec.cfg = small_config(256, 6, 9, 3, wire);  // 9 experts: 3 per rank
    spec.ranks = 3;
    spec.seed = 37;
    const verify::Problem p = verify::make_problem(spec);
    std::vector<std::vector<float>> gates(3);
    for (int r = 0; r < 3; ++r)
      for (int64_t t = 0; t < p.inputs[r].tokens; ++t) gates[r].push_back(0.25f * static_cast<float>(t + r + 1));
    std::vector<LlRun> fused(3), split(3);
    auto errors = verify::run_ranks(3, [&](const Group& g) {
      fused[g.rank()] = ll_run(g, p, true, 1.0f, gates[g.rank()].data());
      split[g.rank()] = ll_run(g, p, true, 1.0f, gates[g.rank()].data(), true);
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    for (int r = 0; r < 3; ++r) {
      const Tensor &a = fused[r].d.recv_x, &b = split[r].d.recv_x;
      EXPECT_EQ(std::memcmp(a.data<char>(), b.data<char>(), a.numel() * dtype_size(a.dtype())), 0) << "rank " << r;
      EXPECT_EQ(std::memcmp(fused[r].out.data<char>(), split[r].out.data<char>(), 2 * fused[r].out.numel()), 0)
          << wire_name(wire) << " combine, rank " << r;
    }
  }
}

// The routed experts are the plain buffer's, one place later; the shared one holds this rank's
// own rows that count, in token order, encoded as every row; with zero shared rows the combine is
// the plain one bit for bit.
TEST(SharedExpertLowLatency, RoutedExpertsFollowTheSharedOneOfOwnTokens) {
  for (WireFormat wire : {WireFormat::bf16, WireFormat::fp8}) {
    verify::ProblemSpec spec;
    spec.cfg = small_config(256, 6, 8, 3, wire);
    spec.ranks = 2;
    spec.seed = 31;
    spec.unused_slot_fraction = 0.1;
    const verify::Problem p = verify::make_problem(spec);
    std::vector<LlRun> shared(2), plain(2);
    auto errors = verify::run_ranks(2, [&](const Group& g) {
      shared[g.rank()] = ll_run(g, p, true, 0.0f, nullptr);
      plain[g.rank()] = ll_run(g, p, false, 0.0f, nullptr);
    });
    for (const auto& e : errors) ASSERT_EQ(e, "");
    for (int r = 0; r < 2; ++r) {
      const LowLatencyDispatchResult &a = shared[r].d, &b = plain[r].d;
      const int64_t n = p.inputs[r].tokens - (r % 2), slots = b.recv_x.size(1), h = 256;
      ASSERT_EQ(a.recv_x.size(0), b.recv_x.size(0) + 1);
      const int64_t x_bytes = a.recv_x.numel() / a.recv_x.size(0) * dtype_size(a.recv_x.dtype());
      EXPECT_EQ(std::memcmp(a.recv_x.data<char>() + x_bytes, b.recv_x.data<char>(), b.recv_x.numel() *
                            dtype_size(b.recv_x.dtype())), 0) << "routed rows, rank " << r;
      EXPECT_EQ(a.recv_count.data<int32_t>()[0], n);
      EXPECT_TRUE(std::equal(b.recv_count.data<int32_t>(), b.recv_count.data<int32_t>() + b.recv_count.numel(),
                             a.recv_count.data<int32_t>() + 1));
      EXPECT_TRUE(std::equal(b.recv_layout.data<int32_t>(), b.recv_layout.data<int32_t>() + b.recv_layout.numel(),
                             a.recv_layout.data<int32_t>() + 2 * 2)) << "rank " << r;
      for (int s = 0; s < 2; ++s) {  // the shared expert's rows all come from this rank
        EXPECT_EQ(a.recv_layout.data<int32_t>()[2 * s], s <= r ? 0 : n);
        EXPECT_EQ(a.recv_layout.data<int32_t>()[2 * s + 1], s == r ? n : 0);
      }
      const uint16_t* x = p.inputs[r].x.data();
      for (int64_t t = 0; t < slots; ++t) {
        EXPECT_EQ(a.recv_src.data<int32_t>()[2 * t], t < n ? r : -1);
        EXPECT_EQ(a.recv_src.data<int32_t>()[2 * t + 1], t < n ? t : -1);
        if (t >= n) continue;
        if (wire == WireFormat::bf16) {
          EXPECT_EQ(std::memcmp(a.recv_x.data<uint16_t>() + t * h, x + t * h, 2 * h), 0) << "shared row " << t;
        } else {
          std::vector<uint8_t> q(h);
          std::vector<float> sc(h / 128);
          quantize_fp8_row(x + t * h, h, false, q.data(), sc.data());
          EXPECT_EQ(std::memcmp(a.recv_x.data<uint8_t>() + t * h, q.data(), h), 0) << "shared row " << t;
          EXPECT_EQ(std::memcmp(a.recv_scales.data<float>() + t * (h / 128), sc.data(), 4 * (h / 128)), 0);
        }
      }
      ASSERT_EQ(shared[r].out.numel(), plain[r].out.numel());
      EXPECT_EQ(std::memcmp(shared[r].out.data<uint16_t>(), plain[r].out.data<uint16_t>(), 2 * plain[r].out.numel()), 0)
          << "combine with zero shared rows, rank " << r;
    }
  }
}

// As TheSharedTermComesAfterTheRanks: the routed partials cancel (-1 from rank 0, +1 from rank 1),
// then the shared row adds 2^-30 times its gate; before the ranks it would round away.
TEST(SharedExpertLowLatency, TheSharedTermComesAfterTheRanksWeightedByTheGate) {
  const int64_t h = 8;
  LowLatencyConfig cfg = small_ll_config(h, 1, 2, 2);
  cfg.shared_expert = true;
  uint16_t result = 0;
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    LowLatencyBuffer b(g, cfg);
    const int64_t tokens = g.rank() == 0 ? 1 : 0;
    std::vector<uint16_t> x(h, float_to_bf16(1.0f));
    std::vector<int32_t> idx = {0, 1};
    std::vector<float> w(2, 1.0f), gate = {0.5f};
    LowLatencyDispatchInput in;
    in.x = TensorView::of(x.data(), DType::bf16, {tokens, h});
    in.topk_idx = TensorView::of(idx.data(), DType::i32, {tokens, 2});
    in.topk_weights = TensorView::of(w.data(), DType::f32, {tokens, 2});
    in.shared_gate = TensorView::of(gate.data(), DType::f32, {tokens});
    auto d = b.dispatch(in);
    const int64_t experts = d.recv_x.size(0), slots = d.recv_x.size(1);
    std::vector<uint16_t> y(experts * slots * h);
    for (int64_t e = 0; e < experts; ++e)  // expert 0 (shared) 2^-30; the routed -1 on rank 0, 1 on rank 1
      std::fill_n(&y[e * slots * h], slots * h, float_to_bf16(e == 0 ? 0x1p-30f : g.rank() == 0 ? -1.0f : 1.0f));
    auto out = b.combine({TensorView::of(y.data(), DType::bf16, {experts, slots, h}), {}, true}, d.handle);
    if (g.rank() == 0) result = out.data<uint16_t>()[0];
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(result, float_to_bf16(0x1p-31f));
}

// Only rank 1 gives a gate and combines unweighted: that combine fails on every rank (its peers
// with peer_failed); a weighted combine of the same handles then works.
TEST(SharedExpertLowLatency, AGateRefusedOnOneRankFailsEveryRank) {
  const int64_t h = 64;
  LowLatencyConfig cfg = small_ll_config(h, 4, 4, 2);
  cfg.shared_expert = true;
  std::vector<std::pair<ErrorCode, bool>> got(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    LowLatencyBuffer b(g, cfg);
    const auto x = verify::random_bf16(4 * h, 5);
    std::vector<int32_t> idx = {0, 1, 2, 3, 1, 2, 0, 3};
    std::vector<float> gate(4, 0.5f), w(8, 1.0f);
    LowLatencyDispatchInput in;
    in.x = bf16_view(x, 4, h);
    in.topk_idx = TensorView::of(idx.data(), DType::i32, {4, 2});
    in.topk_weights = TensorView::of(w.data(), DType::f32, {4, 2});
    if (g.rank() == 1) in.shared_gate = TensorView::of(gate.data(), DType::f32, {4});
    auto d = b.dispatch(in);
    std::vector<uint16_t> y(d.recv_x.numel(), float_to_bf16(1.0f));
    const TensorView yv = TensorView::of(y.data(), DType::bf16, {d.recv_x.size(0), d.recv_x.size(1), h});
    got[g.rank()].first = code_of([&] { b.combine({yv, {}, g.rank() == 0}, d.handle); });
    const Tensor out = b.combine({yv, {}, true}, d.handle);  // the next combine works
    got[g.rank()].second = out.numel() == 4 * h;
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  EXPECT_EQ(got[0].first, ErrorCode::peer_failed);
  EXPECT_EQ(got[1].first, ErrorCode::invalid_argument);
  EXPECT_TRUE(got[0].second && got[1].second);
}

TEST(SharedExpertLowLatency, AGateNeedsTheSharedExpertAndAWeightedCombine) {
  const int64_t h = 64;
  for (bool shared : {false, true}) {
    LowLatencyConfig cfg = small_ll_config(h, 4, 4, 2);
    cfg.shared_expert = shared;
    const auto errors = errors_of(2, [&](const Group& g) {
      LowLatencyBuffer b(g, cfg);
      const auto x = verify::random_bf16(4 * h, 5);
      std::vector<int32_t> idx = {0, 1, 2, 3, 1, 2, 0, 3};
      std::vector<float> gate(4, 1.0f);
      LowLatencyDispatchInput in;
      in.x = bf16_view(x, 4, h);
      in.topk_idx = TensorView::of(idx.data(), DType::i32, {4, 2});
      in.shared_gate = TensorView::of(gate.data(), DType::f32, {4});
      auto d = b.dispatch(in);
      std::vector<uint16_t> y(d.recv_x.numel(), 0);
      b.combine({TensorView::of(y.data(), DType::bf16, {d.recv_x.size(0), d.recv_x.size(1), h}), {}, false},
                d.handle);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r].first, ErrorCode::invalid_argument) << "rank " << r;
      EXPECT_THAT(errors[r].second, testing::HasSubstr(shared ? "only a weighted combine applies"
                                                              : "shared_gate given but the buffer has no shared expert"));
    }
  }
}

}  // namespace
}  // namespace epx::test
