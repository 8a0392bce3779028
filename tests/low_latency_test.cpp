// Low-latency mode on the CPU backend against the independent reference: layouts, formats,
// device-read token counts, split send/receive with work in between, alternating buffer sets.
#include <cstring>

#include "harness.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;

LowLatencyConfig ll_config(const BufferConfig& c) {
  LowLatencyConfig l = small_ll_config(c.hidden, c.max_tokens_per_rank, c.num_experts, c.topk, c.wire);
  l.combine_wire = c.combine_wire;
  return l;
}

verify::Problem ll_problem(int ranks, int64_t hidden, int64_t tokens, int64_t experts, int64_t topk, WireFormat wire,
                           uint64_t seed) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(hidden, tokens, experts, topk, wire);
  spec.ranks = ranks;
  spec.seed = seed;
  spec.unused_slot_fraction = 0.1;
  return verify::make_problem(spec);
}

struct LlCase {
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
  WireFormat combine_wire = WireFormat::bf16;
};

void PrintTo(const LlCase& c, std::ostream* os) {
  *os << "R" << c.ranks << "_H" << c.hidden << "_T" << c.tokens << "_E" << c.experts << "_K" << c.topk << "_"
      << wire_name(c.wire) << "_combine_" << wire_name(c.combine_wire);
}

class LowLatency : public testing::TestWithParam<LlCase> {};

// Several rounds on one buffer (sets alternate), each with its own token counts and data;
// dispatch and combine in split form with the "expert computation" between the halves. The
// combine's weights go with ll_dispatch on half the (round, rank) pairs, with ll_combine on the
// others, so ranks of one call mix the two.
TEST_P(LowLatency, RoundsMatchTheReference) {
  const LlCase& c = GetParam();
  const int rounds = 4;
  std::vector<verify::Problem> problems;
  std::vector<std::vector<int64_t>> counts(rounds, std::vector<int64_t>(c.ranks));
  for (int i = 0; i < rounds; ++i) {
    problems.push_back(ll_problem(c.ranks, c.hidden, c.tokens, c.experts, c.topk, c.wire, 50 + i));
    problems.back().cfg.combine_wire = c.combine_wire;
    for (int r = 0; r < c.ranks; ++r) counts[i][r] = (c.tokens * (i + r + 1)) / (rounds + c.ranks) % (c.tokens + 1);
  }
  std::vector<std::vector<LowLatencyDispatchResult>> got(rounds, std::vector<LowLatencyDispatchResult>(c.ranks));
  std::vector<std::vector<std::vector<uint16_t>>> ys(rounds, std::vector<std::vector<uint16_t>>(c.ranks));
  std::vector<std::vector<Tensor>> outs(rounds, std::vector<Tensor>(c.ranks));
  auto errors = verify::run_ranks(c.ranks, [&](const Group& g) {
    const int r = g.rank();
    LowLatencyBuffer b(g, ll_config(problems[0].cfg));
    for (int i = 0; i < rounds; ++i) {
      const verify::RankInput& in = problems[i].inputs[r];
      int32_t n = static_cast<int32_t>(counts[i][r]);
      LowLatencyDispatchInput d;
      d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {in.tokens, c.hidden});
      d.topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {in.tokens, c.topk});
      d.num_tokens = TensorView::of(&n, DType::i32, {1});
      const bool weights_at_dispatch = (i + r) % 2 == 1;
      const TensorView weights =
          TensorView::of(const_cast<float*>(in.weights.data()), DType::f32, {in.tokens, c.topk});
      if (weights_at_dispatch) d.topk_weights = weights;
      b.dispatch_send(d);
      const int64_t rows = (c.experts / c.ranks) * c.ranks * c.tokens;
      ys[i][r] = verify::random_bf16(rows * c.hidden, 700 + 10 * i + r);  // computed between the halves
      got[i][r] = b.dispatch_recv();
      LowLatencyCombineInput ci;
      ci.y = TensorView::of(ys[i][r].data(), DType::bf16, {c.experts / c.ranks, c.ranks * c.tokens, c.hidden});
      if (!weights_at_dispatch) ci.topk_weights = weights;
      b.combine_send(ci, got[i][r].handle);
      outs[i][r] = b.combine_recv();
    }
  });
  for (int r = 0; r < c.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  expect_ll_rounds_match(problems, counts, ys, got, outs);
}

INSTANTIATE_TEST_SUITE_P(Shapes, LowLatency,
                         testing::Values(LlCase{1, 256, 16, 8, 4, WireFormat::bf16},
                                         LlCase{2, 256, 24, 16, 8, WireFormat::bf16},
                                         LlCase{2, 256, 24, 16, 8, WireFormat::fp8},
                                         LlCase{3, 384, 16, 9, 3, WireFormat::fp8_ue8m0},
                                         LlCase{4, 256, 12, 36, 8, WireFormat::nvfp4},
                                         LlCase{8, 128, 8, 72, 8, WireFormat::bf16},
                                         // low-precision combine wire
                                         LlCase{1, 256, 16, 8, 4, WireFormat::bf16, WireFormat::fp8},
                                         LlCase{2, 256, 24, 16, 8, WireFormat::bf16, WireFormat::fp8},
                                         LlCase{3, 384, 16, 9, 3, WireFormat::fp8, WireFormat::fp8_ue8m0},
                                         LlCase{4, 256, 12, 36, 8, WireFormat::nvfp4, WireFormat::fp8},
                                         LlCase{8, 128, 8, 72, 8, WireFormat::fp8_ue8m0, WireFormat::fp8_ue8m0}));

TEST(LowLatency, TwoLayersInFlightUseAlternateSets) {
  // Layer B's dispatch is sent before layer A's combine is received: the sets must not mix.
  auto pa = ll_problem(2, 128, 16, 8, 2, WireFormat::bf16, 3), pb = ll_problem(2, 128, 16, 8, 2, WireFormat::bf16, 4);
  const std::vector<int64_t> full(2, 16);
  std::vector<LowLatencyDispatchResult> da(2), db(2);
  std::vector<std::vector<uint16_t>> ya(2);
  std::vector<Tensor> oa(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    LowLatencyBuffer b(g, ll_config(pa.cfg));
    auto in = [&](const verify::Problem& p) {
      LowLatencyDispatchInput d;
      d.x = TensorView::of(const_cast<uint16_t*>(p.inputs[r].x.data()), DType::bf16, {16, 128});
      d.topk_idx = TensorView::of(const_cast<int32_t*>(p.inputs[r].idx.data()), DType::i32, {16, 2});
      return d;
    };
    b.dispatch_send(in(pa));
    da[r] = b.dispatch_recv();
    ya[r] = verify::random_bf16(4 * 32 * 128, 90 + r);
    LowLatencyCombineInput c;
    c.y = TensorView::of(ya[r].data(), DType::bf16, {4, 32, 128});
    c.topk_weights = TensorView::of(pa.inputs[r].weights.data(), DType::f32, {16, 2});
    b.combine_send(c, da[r].handle);
    b.dispatch_send(in(pb));
    oa[r] = b.combine_recv();
    db[r] = b.dispatch_recv();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "");
    EXPECT_EQ(verify::check_ll_dispatch(pa, full, r, 0.0f, da[r]), "");
    EXPECT_EQ(verify::check_ll_dispatch(pb, full, r, 0.0f, db[r]), "");
    EXPECT_EQ(verify::check_ll_combine(pa, full, ya, r, true, oa[r], "out"), "");
  }
}

TEST(LowLatency, BadInputFailsEveryRankAndTheBufferGoesOn) {
  auto p = ll_problem(2, 128, 8, 4, 2, WireFormat::bf16, 5);
  std::vector<std::string> first(2), second(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    LowLatencyBuffer b(g, ll_config(p.cfg));
    std::vector<int32_t> idx = p.inputs[r].idx;
    if (r == 1) idx[3] = 7;
    LowLatencyDispatchInput d;
    d.x = TensorView::of(p.inputs[r].x.data(), DType::bf16, {8, 128});
    d.topk_idx = TensorView::of(idx.data(), DType::i32, {8, 2});
    try {
      b.dispatch(d);
    } catch (const Error& e) {
      first[r] = e.what();
    }
    d.topk_idx = TensorView::of(p.inputs[r].idx.data(), DType::i32, {8, 2});
    second[r] = verify::check_ll_dispatch(p, {8, 8}, r, 0.0f, b.dispatch(d));
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_THAT(first[1], HasSubstr("ll_dispatch: topk_idx[1, 1] = 7 is out of range"));
  EXPECT_THAT(first[0], HasSubstr("rank 1 rejected its input"));
  EXPECT_EQ(second[0], "");
  EXPECT_EQ(second[1], "");
}

TEST(LowLatency, CombineSumsSlotsInSlotOrder) {
  // Slots hold experts 2, 0, 1 with outputs 2^-30, -1, 1: slot order gives 0, expert-id order or
  // reversed slot order give 2^-30 (random data rarely shows the order after bf16 rounding).
  LowLatencyConfig cfg{8, 1, 3, 3, WireFormat::bf16, 20000};
  HostWorld world(1);
  LowLatencyBuffer b(world.group(0), cfg);
  std::vector<uint16_t> x(8, float_to_bf16(1.0f));
  std::vector<int32_t> idx = {2, 0, 1};
  std::vector<float> w = {1.0f, 1.0f, 1.0f};
  LowLatencyDispatchInput d;
  d.x = TensorView::of(x.data(), DType::bf16, {1, 8});
  d.topk_idx = TensorView::of(idx.data(), DType::i32, {1, 3});
  auto res = b.dispatch(d);
  const float value_of_expert[3] = {-1.0f, 1.0f, 0x1p-30f};
  std::vector<uint16_t> y(3 * 1 * 8);
  for (int e = 0; e < 3; ++e) std::fill_n(&y[e * 8], 8, float_to_bf16(value_of_expert[e]));
  LowLatencyCombineInput c;
  c.y = TensorView::of(y.data(), DType::bf16, {3, 1, 8});
  c.topk_weights = TensorView::of(w.data(), DType::f32, {1, 3});
  EXPECT_EQ(b.combine(c, res.handle).data<uint16_t>()[0], float_to_bf16(0.0f));
}

// An empty input without data is given: a rank without tokens may pass [0, K] weights without
// data to ll_dispatch (as torch's empty tensors may come), and its weighted ll_combine then takes
// none, while its peer gives its weights to ll_combine. The peer's output is the same as when the
// rank without tokens gives its empty weights to ll_combine instead. The CUDA test
// CudaLowLatencyWeights.EmptyWeightsWithoutDataAtDispatchAreWeightsGiven runs these calls too.
TEST(LowLatency, EmptyWeightsWithoutDataAtDispatchAreWeightsGiven) {
  const auto p = ll_problem(2, 256, 16, 8, 4, WireFormat::bf16, 43);
  const int64_t slots = 2 * 16, l_count = 4;
  auto run = [&](bool empty_weights_at_dispatch) {
    const HostWorld world(2);
    std::vector<Tensor> out(2);
    const std::vector<std::string> errors = verify::run_threads(2, [&](int r) {
      verify::RankInput in = p.inputs[r];
      std::vector<uint16_t> y = verify::random_bf16(l_count * slots * 256, 50 + r);
      LowLatencyBuffer b(world.group(r), ll_config(p.cfg));
      const int64_t t = r == 0 ? 0 : 16;
      const TensorView weights = TensorView::of(t > 0 ? in.weights.data() : nullptr, DType::f32, {t, 4});
      LowLatencyDispatchInput d;
      d.x = TensorView::of(t > 0 ? in.x.data() : nullptr, DType::bf16, {t, 256});
      d.topk_idx = TensorView::of(t > 0 ? in.idx.data() : nullptr, DType::i32, {t, 4});
      if (r == 0 && empty_weights_at_dispatch) d.topk_weights = weights;
      const LowLatencyDispatchResult res = b.dispatch(d);
      LowLatencyCombineInput c;
      c.y = TensorView::of(y.data(), DType::bf16, {l_count, slots, 256});
      if (r == 1 || !empty_weights_at_dispatch) c.topk_weights = weights;
      out[r] = b.combine(c, res.handle);
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
    return out;
  };
  const std::vector<Tensor> at_dispatch = run(true), at_combine = run(false);
  ASSERT_EQ(at_dispatch[0].numel(), 0);
  ASSERT_EQ(at_dispatch[1].numel(), 16 * 256);
  ASSERT_EQ(at_combine[1].numel(), 16 * 256);
  EXPECT_EQ(std::memcmp(at_dispatch[1].data<uint16_t>(), at_combine[1].data<uint16_t>(), 2 * 16 * 256), 0);
}

TEST(LowLatency, ClearErrorsForMisuse) {
  auto p = ll_problem(1, 128, 8, 4, 2, WireFormat::bf16, 6);
  HostWorld world(1);
  LowLatencyBuffer b(world.group(0), ll_config(p.cfg));
  std::vector<uint16_t> big(9 * 128, 0x3f80);
  std::vector<int32_t> idx(9 * 2, 0);
  for (int t = 0; t < 9; ++t) idx[t * 2 + 1] = 1;
  LowLatencyDispatchInput d;
  d.x = TensorView::of(big.data(), DType::bf16, {9, 128});
  d.topk_idx = TensorView::of(idx.data(), DType::i32, {9, 2});
  EXPECT_THAT([&] { b.dispatch(d); }, testing::ThrowsMessage<Error>(HasSubstr("sized for max_tokens_per_rank=8")));
  d.x = TensorView::of(big.data(), DType::bf16, {8, 128});
  d.topk_idx = TensorView::of(idx.data(), DType::i32, {8, 2});
  int32_t n = 12;
  d.num_tokens = TensorView::of(&n, DType::i32, {1});
  EXPECT_THAT([&] { b.dispatch(d); }, testing::ThrowsMessage<Error>(HasSubstr("num_tokens = 12 must be in [0, T=8]")));
  EXPECT_THAT([&] { b.dispatch_recv(); }, testing::ThrowsMessage<Error>(HasSubstr("no dispatch_send before it")));
  d.num_tokens = {};
  auto res = b.dispatch(d);
  std::vector<uint16_t> y(4 * 8 * 128);
  LowLatencyCombineInput c;
  c.y = TensorView::of(y.data(), DType::bf16, {4, 8, 64});
  c.weighted = false;
  EXPECT_THAT([&] { b.combine(c, res.handle); }, testing::ThrowsMessage<Error>(HasSubstr("ll_combine: y: expected shape")));
  LowLatencyBuffer other(world.group(0), ll_config(p.cfg));
  c.y = TensorView::of(y.data(), DType::bf16, {4, 8, 128});
  EXPECT_THAT([&] { other.combine(c, res.handle); }, testing::ThrowsMessage<Error>(HasSubstr("belongs to another buffer")));
  EXPECT_THAT([&] { b.combine(c, res.handle); }, testing::Not(testing::Throws<Error>()));
  // The combine's weights in one place: at ll_dispatch, or at a weighted ll_combine.
  std::vector<float> w(8 * 2, 0.5f);
  d.topk_weights = TensorView::of(w.data(), DType::f32, {8, 3});
  EXPECT_THAT([&] { b.dispatch(d); }, testing::ThrowsMessage<Error>(HasSubstr("ll_dispatch: topk_weights: expected shape")));
  d.topk_weights = TensorView::of(w.data(), DType::f32, {8, 2});
  auto weighted = b.dispatch(d);
  c.weighted = true;
  c.topk_weights = TensorView::of(w.data(), DType::f32, {8, 2});
  EXPECT_THAT([&] { b.combine(c, weighted.handle); },
              testing::ThrowsMessage<Error>(HasSubstr("topk_weights were given to this handle's ll_dispatch")));
  c.topk_weights = {};
  EXPECT_THAT([&] { b.combine(c, weighted.handle); }, testing::Not(testing::Throws<Error>()));
  EXPECT_THAT([&] { b.combine(c, res.handle); },
              testing::ThrowsMessage<Error>(HasSubstr("ll_combine: topk_weights: missing; expected [T=8, K=2] (or given to ll_dispatch)")));
}

}  // namespace
}  // namespace epx::test
