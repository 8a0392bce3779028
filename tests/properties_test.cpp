// Properties stated without the reference: delivery exactly once, order and padding, the
// combine identity, backward against plain math, capacity, dropping, dense routing, edges.
#include <cmath>
#include <map>
#include <set>

#include "harness.hpp"

namespace epx::test {
namespace {

verify::Problem problem(int ranks, BufferConfig cfg, uint64_t seed, double holes = 0.0, bool exact = false) {
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = ranks;
  spec.seed = seed;
  spec.unused_slot_fraction = holes;
  spec.exact_values = exact;
  return verify::make_problem(spec);
}

TEST(Delivery, EveryTokenReachesEachDestinationRankExactlyOnce) {
  for (int ranks : {1, 2, 3, 4, 6, 8}) {
    const auto p = problem(ranks, small_config(64, 30, 8 * ranks, 5), 40 + ranks, 0.2);
    RunOptions o;
    o.dispatch.layout = Layout::rank_major;
    o.combine = false;
    const auto runs = run_problem(p, o);
    const int64_t l_count = p.cfg.num_experts / ranks;
    for (int d = 0; d < ranks; ++d) {
      std::multiset<std::pair<int, int>> got, want;
      const auto& res = runs[d].dispatched;
      for (int64_t i = 0; i < res.num_rows; ++i)
        got.insert({res.recv_src.data<int32_t>()[2 * i], res.recv_src.data<int32_t>()[2 * i + 1]});
      for (int s = 0; s < ranks; ++s)
        for (int64_t t = 0; t < p.inputs[s].tokens; ++t) {
          bool here = false;
          for (int64_t k = 0; k < p.cfg.topk; ++k) here |= p.inputs[s].idx[t * p.cfg.topk + k] >= 0 &&
                                                             p.inputs[s].idx[t * p.cfg.topk + k] / l_count == d;
          if (here) want.insert({s, static_cast<int>(t)});
        }
      EXPECT_EQ(got, want) << "ranks " << ranks << " receiver " << d;
      // ... and each received row carries the token's own bits.
      for (int64_t i = 0; i < res.num_rows; ++i) {
        const int s = res.recv_src.data<int32_t>()[2 * i], t = res.recv_src.data<int32_t>()[2 * i + 1];
        ASSERT_EQ(0, std::memcmp(res.recv_x.data<uint16_t>() + i * 64, &p.inputs[s].x[t * 64], 128));
      }
    }
  }
}

TEST(Layout, ExpertSegmentsAreOrderedAndZeroPadded) {
  for (int64_t align : {1, 8, 128}) {
    const auto p = problem(4, small_config(32, 50, 16, 4, WireFormat::bf16, align), 7 + align);
    RunOptions o;
    o.combine = false;
    const auto runs = run_problem(p, o);
    for (int d = 0; d < 4; ++d) {
      const auto& res = runs[d].dispatched;
      const int64_t* off = res.expert_offsets.data<int64_t>();
      const int64_t* count = res.tokens_per_expert.data<int64_t>();
      for (int l = 0; l < 4; ++l) {
        EXPECT_EQ(off[l] % align, 0);
        EXPECT_EQ(off[l + 1] - off[l], (count[l] + align - 1) / align * align);
        for (int64_t i = off[l]; i < off[l + 1]; ++i) {
          const int32_t* src = res.recv_src.data<int32_t>() + 2 * i;
          if (i < off[l] + count[l]) {
            if (i > off[l]) {
              const int32_t* prev = src - 2;
              EXPECT_TRUE(prev[0] < src[0] || (prev[0] == src[0] && prev[1] < src[1])) << "row " << i;
            }
            const int64_t e = d * 4 + l;  // the row's token really chose this expert
            bool chose = false;
            for (int64_t k = 0; k < 4; ++k) chose |= p.inputs[src[0]].idx[src[1] * 4 + k] == e;
            EXPECT_TRUE(chose) << "row " << i;
          } else {
            EXPECT_EQ(src[0], -1);
            EXPECT_EQ(res.recv_weights.data<float>()[i], 0.0f);
            for (int64_t c = 0; c < 32; ++c) EXPECT_EQ(res.recv_x.data<uint16_t>()[i * 32 + c], 0);
          }
        }
      }
    }
  }
}

TEST(Combine, UnitWeightsGiveXTimesTheNumberOfExperts) {
  // Exact inputs (4 significant bits) so x * n is exact in bf16 for n <= 8.
  for (Layout layout : {Layout::expert_major, Layout::rank_major}) {
    auto p = problem(4, small_config(96, 20, 32, 8), 5, 0.3, true);
    std::vector<std::vector<uint16_t>> outs(4);
    auto errors = verify::run_ranks(4, [&](const Group& g) {
      const int r = g.rank();
      Buffer b(g, p.cfg);
      auto d = b.dispatch(p.inputs[r].view(96, 8), {layout});
      // The expert computation is the identity; rank-major rows count their local experts.
      std::vector<uint16_t> y(d.recv_x.numel());
      const auto* x = d.recv_x.data<uint16_t>();
      for (int64_t i = 0; i < d.recv_x.size(0); ++i) {
        float n = 1.0f;
        if (layout == Layout::rank_major) {
          n = 0.0f;
          for (int k = 0; k < 8; ++k) n += d.recv_topk_idx.data<int32_t>()[i * 8 + k] >= 0;
        }
        for (int64_t c = 0; c < 96; ++c) y[i * 96 + c] = float_to_bf16(n * bf16_to_float(x[i * 96 + c]));
      }
      auto c = b.combine({bf16_view(y, d.recv_x.size(0), 96), {}}, d.handle, {false});
      outs[r].assign(c.out.data<uint16_t>(), c.out.data<uint16_t>() + c.out.numel());
    });
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(errors[r], "");
      for (int64_t t = 0; t < p.inputs[r].tokens; ++t) {
        int n = 0;
        for (int k = 0; k < 8; ++k) n += p.inputs[r].idx[t * 8 + k] >= 0;
        for (int64_t c = 0; c < 96; ++c)
          ASSERT_EQ(bf16_to_float(outs[r][t * 96 + c]), n * bf16_to_float(p.inputs[r].x[t * 96 + c]))
              << "rank " << r << " token " << t << " channel " << c << " layout " << layout_name(layout);
      }
    }
  }
}

TEST(Backward, WeightGradientIsTheDotProduct) {
  auto p = problem(2, small_config(512, 16, 8, 3), 9);
  RunOptions o;
  auto runs = run_problem(p, o);
  const auto kept = verify::kept_routing(p);
  for (int s = 0; s < 2; ++s)
    for (int64_t t = 0; t < p.inputs[s].tokens; ++t)
      for (int k = 0; k < 3; ++k) {
        const int32_t e = kept[s][t * 3 + k];
        const int d = e / 4;
        const auto& res = runs[d].dispatched;
        int64_t row = -1;
        for (int64_t i = res.expert_offsets.data<int64_t>()[e % 4]; i < res.expert_offsets.data<int64_t>()[e % 4 + 1]; ++i)
          if (res.recv_src.data<int32_t>()[2 * i] == s && res.recv_src.data<int32_t>()[2 * i + 1] == t) row = i;
        ASSERT_GE(row, 0);
        double dot = 0.0, norm = 0.0;
        for (int c = 0; c < 512; ++c) {
          const double g = bf16_to_float(runs[s].grad_out[t * 512 + c]), y = bf16_to_float(runs[d].y[row * 512 + c]);
          dot += g * y;
          norm += std::fabs(g * y);
        }
        EXPECT_NEAR(runs[s].combine_grad.grad_topk_weights.data<float>()[t * 3 + k], dot, 1e-5 * norm);
        // and grad_y of that row is w * grad_out
        const float w = p.inputs[s].weights[t * 3 + k];
        for (int c = 0; c < 512; c += 97)
          EXPECT_EQ(runs[d].combine_grad.grad_y.data<uint16_t>()[row * 512 + c],
                    float_to_bf16(w * bf16_to_float(runs[s].grad_out[t * 512 + c])));
      }
}

TEST(Capacity, OverflowIsReportedAndNothingIsWrittenOutOfBounds) {
  auto cfg = small_config(64, 32, 8, 4);
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = 40;  // far below the ~64 rows each rank needs
  auto p = problem(2, cfg, 3);
  RunOptions o;
  const auto runs = run_problem(p, o);
  bool any_overflow = false;
  for (const auto& r : runs) {
    EXPECT_EQ(r.dispatched.recv_x.size(0), 40);
    any_overflow |= r.dispatched.overflow;
    EXPECT_EQ(r.combined.overflow, r.dispatched.overflow);
  }
  EXPECT_TRUE(any_overflow);
  expect_matches_reference(p, o, runs);  // rows within capacity exact; combine skips the lost ones
}

TEST(Capacity, ExactFitHasNoOverflow) {
  auto cfg = small_config(64, 32, 8, 4, WireFormat::bf16, 4);
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = 2 * 32 * 4 + 4 * 4;  // worst case: every slot here, plus padding
  auto p = problem(2, cfg, 4);
  RunOptions o;
  const auto runs = run_problem(p, o);
  for (const auto& r : runs) EXPECT_FALSE(r.dispatched.overflow);
  expect_matches_reference(p, o, runs);
}

TEST(Dropping, CapacityFactorKeepsTheFirstPairsInRankTokenOrder) {
  auto cfg = small_config(64, 40, 8, 2);
  cfg.capacity_factor = 0.5;  // capacity per expert = ceil(0.5 * 80 * 2 / 8) = 10
  verify::ProblemSpec spec{cfg, 2, {}, verify::Routing::skewed, 0.0, false, false, 21};
  auto p = verify::make_problem(spec);
  RunOptions o;
  const auto runs = run_problem(p, o);
  int64_t dropped = 0;
  for (const auto& r : runs) dropped += r.dispatched.dropped_slots;
  EXPECT_GT(dropped, 0);
  for (const auto& r : runs)
    for (int l = 0; l < 4; ++l) EXPECT_LE(r.dispatched.tokens_per_expert.data<int64_t>()[l], 10);
  expect_matches_reference(p, o, runs);
  // Gradients of dropped slots are zero.
  const auto kept = verify::kept_routing(p);
  for (int s = 0; s < 2; ++s)
    for (size_t i = 0; i < kept[s].size(); ++i)
      if (kept[s][i] < 0) {
        EXPECT_EQ(runs[s].combine_grad.grad_topk_weights.data<float>()[i], 0.0f);
      }
}

TEST(DenseRouting, RoutingMapGivesTheSameResultAsSortedTopk) {
  auto cfg = small_config(64, 24, 16, 4);
  auto p = problem(2, cfg, 8, 0.25);
  // Dense form of each rank's routing, and the top-k form it implies (experts ascending).
  verify::DenseRouting dense = verify::dense_routing(p);
  auto& maps = dense.maps;
  auto& probs = dense.probs;
  const auto& sorted = dense.sorted;
  std::vector<DispatchResult> got(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    Buffer b(g, cfg);
    DispatchInput in = p.inputs[r].view(64, 4);
    in.topk_idx = {};
    in.topk_weights = {};
    in.routing_map = TensorView::of(maps[r].data(), DType::boolean, {p.inputs[r].tokens, 16});
    in.probs = TensorView::of(probs[r].data(), DType::f32, {p.inputs[r].tokens, 16});
    got[r] = b.dispatch(in);
  });
  const auto kept = verify::kept_routing(sorted);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "");
    EXPECT_EQ(verify::check_dispatch(sorted, kept, r, Layout::expert_major, 0.0f, got[r]), "");
  }
}

TEST(Edges, NoTokensAnywhereAndAllSlotsUnused) {
  for (double holes : {1.0}) {
    auto p = problem(3, small_config(64, 8, 6, 2), 1, holes);
    p.inputs[0].tokens = 0;
    p.inputs[0].x.clear();
    p.inputs[0].idx.clear();
    p.inputs[0].weights.clear();
    RunOptions o;
    const auto runs = run_problem(p, o);
    for (const auto& r : runs) EXPECT_EQ(r.dispatched.num_rows, 0);
    expect_matches_reference(p, o, runs);
    for (int r = 1; r < 3; ++r)  // tokens with no expert combine to zero (plus the shared expert)
      for (int64_t i = 0; i < runs[r].combined.out.numel(); ++i)
        ASSERT_EQ(runs[r].combined.out.data<uint16_t>()[i], runs[r].shared[i]);
  }
}

// An empty input without data (as torch's empty tensors may come) is given: a rank whose experts
// get no rows passes y and grad_recv_x [0, H] without data, and its tokens still combine from the
// other ranks' rows (every token goes to ranks 0 and 1 and none to rank 2; y = recv_x, so each
// output row is x + x, exact in bf16). The CUDA test of the same name runs these calls too.
TEST(Edges, ARankWithoutRowsMayPassAnEmptyYWithoutData) {
  auto p = problem(3, small_config(256, 32, 12, 4), 3);
  for (auto& in : p.inputs)
    for (int64_t t = 0; t < in.tokens; ++t)
      for (int64_t k = 0; k < 4; ++k) in.idx[t * 4 + k] = static_cast<int32_t>((t + 2 * k) % 8);
  const HostWorld world(3);
  std::vector<std::string> wrong(3);
  const std::vector<std::string> errors = verify::run_threads(3, [&](int r) {
    verify::RankInput in = p.inputs[r];
    Buffer b(world.group(r), p.cfg);
    DispatchInput d;
    d.x = TensorView::of(in.x.data(), DType::bf16, {32, 256});
    d.topk_idx = TensorView::of(in.idx.data(), DType::i32, {32, 4});
    const DispatchResult res = b.dispatch(d, {Layout::rank_major, 0.0f});
    if ((res.num_rows == 0) != (r == 2)) wrong[r] += "received " + std::to_string(res.num_rows) + " rows; ";
    const TensorView rows = r == 2 ? TensorView::of(nullptr, DType::bf16, {0, 256}) : res.recv_x.view();
    const CombineResult c = b.combine({rows, {}}, res.handle, {false});
    const DispatchBackwardResult back = b.dispatch_backward({rows, {}}, res.handle);
    for (const Tensor* got : {&c.out, &back.grad_x})
      for (int64_t i = 0; i < 32 * 256; ++i)
        if (got->data<uint16_t>()[i] != float_to_bf16(2.0f * bf16_to_float(in.x[i]))) {
          wrong[r] += std::string(got == &c.out ? "combine" : "dispatch_backward") + " differs at " + std::to_string(i) + "; ";
          break;
        }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(wrong[r], "") << "rank " << r;
  }
}

TEST(Edges, AllTokensToOneExpert) {
  auto p = problem(4, small_config(64, 16, 8, 1, WireFormat::bf16, 8), 2);
  for (auto& in : p.inputs)
    for (auto& e : in.idx) e = 5;
  RunOptions o;
  const auto runs = run_problem(p, o);
  EXPECT_EQ(runs[2].dispatched.tokens_per_expert.data<int64_t>()[1], 64);
  EXPECT_EQ(runs[0].dispatched.num_rows, 0);
  expect_matches_reference(p, o, runs);
}

TEST(Edges, PreQuantizedFp8InputTravelsAsGiven) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(256, 16, 8, 2, WireFormat::fp8);
  spec.ranks = 2;
  spec.prequantized = true;
  auto p = verify::make_problem(spec);
  RunOptions o;
  const auto runs = run_problem(p, o);
  expect_matches_reference(p, o, runs);
}

TEST(Edges, Nvfp4WithAGivenGlobalScale) {
  auto p = problem(2, small_config(64, 16, 8, 2, WireFormat::nvfp4), 12);
  RunOptions o;
  o.dispatch.nvfp4_global_scale = 300.0f;
  const auto runs = run_problem(p, o);
  expect_matches_reference(p, o, runs);
  EXPECT_EQ(runs[0].dispatched.recv_global_scale.data<float>()[0], 1.0f / 300.0f);
}

TEST(Buffers, SeveralBuffersAndManyCallsStayIndependent) {
  auto p1 = problem(3, small_config(64, 12, 6, 2), 30);
  auto p2 = problem(3, small_config(32, 20, 12, 3, WireFormat::bf16, 4), 31);
  std::vector<std::string> mismatch(3);
  auto errors = verify::run_ranks(3, [&](const Group& g) {
    const int r = g.rank();
    Buffer a(g, p1.cfg), b(g, p2.cfg);
    const auto k1 = verify::kept_routing(p1), k2 = verify::kept_routing(p2);
    for (int round = 0; round < 5; ++round) {
      auto da = a.dispatch(p1.inputs[r].view(64, 2));
      auto db = b.dispatch(p2.inputs[r].view(32, 3), {Layout::rank_major});
      mismatch[r] += verify::check_dispatch(p1, k1, r, Layout::expert_major, 0.0f, da);
      mismatch[r] += verify::check_dispatch(p2, k2, r, Layout::rank_major, 0.0f, db);
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(mismatch[r], "");
  }
}

}  // namespace
}  // namespace epx::test

namespace epx::test {
namespace {

// Values whose fp32 sum depends on the order: (2^-30 + -1) + 1 = 0, but (1 + -1) + 2^-30 = 2^-30.
// Random inputs rarely show the order after the final bf16 rounding; these always do.
const float kOrderValues[3] = {0x1p-30f, -1.0f, 1.0f};

// One token on rank 0 choosing experts `idx` (one per slot); expert e's output row is the
// constant c[e]. Returns the bf16 combine output of that token, channel 0.
uint16_t combine_one_token(int ranks, const std::vector<int32_t>& idx, const std::vector<float>& c) {
  const int64_t h = 8, k_count = static_cast<int64_t>(idx.size());
  BufferConfig cfg = small_config(h, 1, 3, k_count);
  uint16_t result = 0;
  auto errors = verify::run_ranks(ranks, [&](const Group& g) {
    Buffer b(g, cfg);
    const int64_t tokens = g.rank() == 0 ? 1 : 0;
    std::vector<uint16_t> x(h, float_to_bf16(1.0f));
    std::vector<float> w(k_count, 1.0f);
    DispatchInput in;
    in.x = TensorView::of(x.data(), DType::bf16, {tokens, h});
    in.topk_idx = TensorView::of(const_cast<int32_t*>(idx.data()), DType::i32, {tokens, k_count});
    in.topk_weights = TensorView::of(w.data(), DType::f32, {tokens, k_count});
    auto d = b.dispatch(in);
    const int64_t rows = d.recv_x.size(0), l_count = 3 / ranks;
    std::vector<uint16_t> y(rows * h, 0);
    for (int64_t l = 0; l < l_count; ++l)
      for (int64_t i = d.expert_offsets.data<int64_t>()[l]; i < d.expert_offsets.data<int64_t>()[l + 1]; ++i)
        std::fill_n(&y[i * h], h, float_to_bf16(c[g.rank() * l_count + l]));
    auto out = b.combine({bf16_view(y, rows, h), {}}, d.handle, {true});
    if (g.rank() == 0) result = out.out.data<uint16_t>()[0];
  });
  for (auto& e : errors) EXPECT_EQ(e, "");
  return result;
}

TEST(Combine, SumsSlotsInSlotOrderOnTheExpertRank) {
  // Slots hold experts 2, 0, 1; expert outputs chosen so slot order gives 0 while expert-id
  // order or reversed slot order gives 2^-30.
  std::vector<float> c(3);
  c[2] = kOrderValues[0];
  c[0] = kOrderValues[1];
  c[1] = kOrderValues[2];
  EXPECT_EQ(combine_one_token(1, {2, 0, 1}, c), float_to_bf16(0.0f));
  EXPECT_NE(float_to_bf16(0x1p-30f), float_to_bf16(0.0f));
}

TEST(Combine, SumsRanksInRankOrderOnTheSource) {
  // One expert per rank: partials 2^-30, -1, 1 from ranks 0, 1, 2; whatever the slot order.
  const std::vector<float> c(kOrderValues, kOrderValues + 3);
  EXPECT_EQ(combine_one_token(3, {2, 0, 1}, c), float_to_bf16(0.0f));
  EXPECT_EQ(combine_one_token(3, {1, 2, 0}, c), float_to_bf16(0.0f));
}

}  // namespace
}  // namespace epx::test
