// Non-finite input on the CPU backend (docs/semantics.md, "Non-finite values"): dispatch carries
// NaNs and infinities by the rules of each wire format, bit for bit as the reference encodes
// them, and combine propagates them; with check_finite, dispatch refuses them on every rank and
// the buffer goes on.
#include "harness.hpp"
#include "verify/nonfinite.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;

struct NfCase {
  WireFormat wire;
  Layout layout;
  bool prequantized = false;
  float nvfp4_global_scale = 0.0f;
};

void PrintTo(const NfCase& c, std::ostream* os) {
  *os << wire_name(c.wire) << "_" << layout_name(c.layout) << (c.prequantized ? "_prequantized" : "")
      << (c.nvfp4_global_scale > 0 ? "_given_scale" : "");
}

verify::Problem problem_with_bad_values(WireFormat wire, bool prequantized, uint64_t seed) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(256, 8, 8, 2, wire);
  spec.ranks = 2;
  spec.prequantized = prequantized;
  spec.seed = seed;
  verify::Problem p = verify::make_problem(spec);
  verify::put_bad_values(p, verify::bad_values(p));
  return p;
}

class NonFiniteDispatch : public testing::TestWithParam<NfCase> {};

// Dispatch against the reference (every byte, NaN bits included), then combine of the received
// rows dequantized (a stand-in expert): the reference's sums, and the bad values reach the outputs.
TEST_P(NonFiniteDispatch, MatchesTheReferenceAndCombinePropagates) {
  const NfCase& c = GetParam();
  const verify::Problem p = problem_with_bad_values(c.wire, c.prequantized, 7);
  const auto bad = verify::bad_values(p);
  const int64_t h = p.cfg.hidden;
  const bool weighted = c.layout == Layout::expert_major;
  std::vector<DispatchResult> got(2);
  std::vector<std::vector<uint16_t>> ys(2);
  std::vector<Tensor> outs(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    Buffer b(g, p.cfg);
    DispatchOptions o;
    o.layout = c.layout;
    o.nvfp4_global_scale = c.nvfp4_global_scale;
    got[r] = b.dispatch(p.inputs[r].view(h, p.cfg.topk), o);
    const int64_t rows = got[r].recv_x.size(0);
    ys[r] = verify::dequantized_rows(c.wire, got[r].recv_x, got[r].recv_scales, got[r].recv_global_scale, rows, h);
    outs[r] = b.combine({bf16_view(ys[r], rows, h), {}}, got[r].handle, {weighted}).out;
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  const auto kept = verify::kept_routing(p);
  std::vector<verify::Expected> layouts;
  for (int r = 0; r < 2; ++r) {
    layouts.push_back(verify::expected_dispatch(p, kept, r, c.layout));
    EXPECT_EQ(verify::check_dispatch(p, kept, r, c.layout, c.nvfp4_global_scale, got[r]), "");
  }
  for (int s = 0; s < 2; ++s) {
    const auto want = verify::expected_combine(p, kept, layouts, ys, s, c.layout, weighted, nullptr);
    ASSERT_EQ(outs[s].numel(), static_cast<int64_t>(want.size()));
    EXPECT_EQ(verify::compare_bits(outs[s].data<uint16_t>(), want.data(), outs[s].numel(), 2, "combine out"), "")
        << "rank " << s;
    EXPECT_EQ(verify::check_reaches_output(p, bad, s, p.inputs[s].tokens, outs[s].data<uint16_t>()), "");
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, NonFiniteDispatch,
                         testing::Values(NfCase{WireFormat::bf16, Layout::expert_major},
                                         NfCase{WireFormat::bf16, Layout::rank_major},
                                         NfCase{WireFormat::fp8, Layout::expert_major},
                                         NfCase{WireFormat::fp8, Layout::rank_major},
                                         NfCase{WireFormat::fp8_ue8m0, Layout::expert_major},
                                         NfCase{WireFormat::fp8_ue8m0, Layout::rank_major},
                                         NfCase{WireFormat::nvfp4, Layout::expert_major},
                                         NfCase{WireFormat::nvfp4, Layout::rank_major},
                                         NfCase{WireFormat::nvfp4, Layout::expert_major, false, 300.0f},
                                         NfCase{WireFormat::fp8, Layout::expert_major, true}));

// The rows' bytes themselves, for one row by hand: what each format must carry.
TEST(NonFiniteDispatch, ARowByHandInEveryFormat) {
  for (WireFormat wire : {WireFormat::bf16, WireFormat::fp8, WireFormat::fp8_ue8m0, WireFormat::nvfp4}) {
    SCOPED_TRACE(std::string(wire_name(wire)));
    verify::ProblemSpec spec;
    spec.cfg = small_config(256, 1, 1, 1, wire);
    verify::Problem p = verify::make_problem(spec);
    p.inputs[0].x[130] = 0x7fc0;  // a NaN in fp8 block 1, nvfp4 block 8
    DispatchResult d;
    auto errors = verify::run_ranks(1, [&](const Group& g) { d = Buffer(g, p.cfg).dispatch(p.inputs[0].view(256, 1)); });
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(d.num_rows, 1);
    const uint8_t* x = d.recv_x.data<uint8_t>();
    if (wire == WireFormat::bf16) {
      EXPECT_EQ(d.recv_x.data<uint16_t>()[130], 0x7fc0);
    } else if (wire == WireFormat::nvfp4) {
      EXPECT_EQ(d.recv_scales.data<uint8_t>()[8], 0x7f);
      for (int i = 64; i < 72; ++i) EXPECT_EQ(x[i], 0) << i;
      EXPECT_NE(d.recv_scales.data<uint8_t>()[7], 0x7f);
      EXPECT_TRUE(std::isfinite(d.recv_global_scale.data<float>()[0]));
    } else {
      EXPECT_EQ(float_bits(d.recv_scales.data<float>()[1]), 0x7fc00000u);
      EXPECT_TRUE(std::isfinite(d.recv_scales.data<float>()[0]));
      for (int i = 128; i < 256; ++i) EXPECT_EQ(x[i], 0x7f) << i;
      EXPECT_NE(x[0], 0x7f);
    }
  }
}

// Dispatch with check_finite on 2 ranks where rank 1's input may be spoiled; then a clean
// dispatch, which must match the reference. Returns each rank's first error (code and words).
struct Refusal {
  std::string what;
  ErrorCode code = ErrorCode::internal;
};

std::vector<Refusal> check_finite_dispatch(const verify::Problem& clean,
                                           const std::function<void(verify::RankInput&)>& spoil) {
  verify::Problem bad = clean;
  spoil(bad.inputs[1]);
  std::vector<Refusal> first(2);
  std::vector<std::string> second(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    Buffer b(g, clean.cfg);
    try {
      b.dispatch(bad.inputs[r].view(clean.cfg.hidden, clean.cfg.topk));
    } catch (const Error& e) {
      first[r] = {e.what(), e.code()};
    }
    const DispatchResult ok = b.dispatch(clean.inputs[r].view(clean.cfg.hidden, clean.cfg.topk));
    second[r] = verify::check_dispatch(clean, verify::kept_routing(clean), r, Layout::expert_major, 0.0f, ok);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(second[r], "") << "rank " << r;
  }
  return first;
}

void expect_refused(const std::vector<Refusal>& e, const std::string& words) {
  EXPECT_EQ(e[1].what, words);
  EXPECT_EQ(e[1].code, ErrorCode::invalid_argument);
  EXPECT_THAT(e[0].what, HasSubstr("rank 1 rejected its input, so the group stops: " + words));
  EXPECT_EQ(e[0].code, ErrorCode::peer_failed);
}

verify::Problem checked_problem(WireFormat wire, bool prequantized = false) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(256, 8, 8, 2, wire);
  spec.cfg.check_finite = true;
  spec.ranks = 2;
  spec.prequantized = prequantized;
  return verify::make_problem(spec);
}

TEST(CheckFinite, ANonFiniteValueFailsEveryRankNamingIt) {
  for (WireFormat wire : {WireFormat::bf16, WireFormat::fp8, WireFormat::nvfp4}) {
    SCOPED_TRACE(std::string(wire_name(wire)));
    const auto p = checked_problem(wire);
    expect_refused(check_finite_dispatch(p, [](verify::RankInput& in) { in.x[3 * 256 + 70] = 0x7fc0; }),
                   "dispatch: x[3][70] is not finite (nan)");
    expect_refused(check_finite_dispatch(p, [](verify::RankInput& in) { in.x[0] = 0x7f80; }),
                   "dispatch: x[0][0] is not finite (inf)");
    expect_refused(check_finite_dispatch(p, [](verify::RankInput& in) { in.x[7 * 256 + 255] = 0xff80; }),
                   "dispatch: x[7][255] is not finite (-inf)");
  }
}

TEST(CheckFinite, TheFirstInRowMajorOrderIsNamed) {
  const auto p = checked_problem(WireFormat::bf16);
  expect_refused(check_finite_dispatch(p,
                                       [](verify::RankInput& in) {
                                         in.x[5 * 256 + 1] = 0x7f80;
                                         in.x[2 * 256 + 200] = 0xffc0;
                                         in.x[2 * 256 + 201] = 0x7f80;
                                       }),
                 "dispatch: x[2][200] is not finite (nan)");
}

TEST(CheckFinite, PreQuantizedCodesAndScales) {
  const auto p = checked_problem(WireFormat::fp8, true);
  expect_refused(check_finite_dispatch(p, [](verify::RankInput& in) { in.x_fp8[4 * 256 + 9] = 0xff; }),
                 "dispatch: x[4][9] is not finite (nan)");
  expect_refused(check_finite_dispatch(p, [](verify::RankInput& in) { in.x_scales[6 * 2 + 1] = -INFINITY; }),
                 "dispatch: x_scales[6][1] is not finite (-inf)");
}

TEST(CheckFinite, OffByDefaultAndFiniteInputPasses) {
  verify::Problem p = checked_problem(WireFormat::fp8);
  // On, with finite input: the dispatch goes through (a rank's NaN would have failed both).
  for (const auto& e : check_finite_dispatch(p, [](verify::RankInput&) {})) EXPECT_EQ(e.what, "");
  // Off: the NaN travels.
  p.cfg.check_finite = false;
  for (const auto& e : check_finite_dispatch(p, [](verify::RankInput& in) { in.x[0] = 0x7fc0; })) EXPECT_EQ(e.what, "");
}

// ---- low-latency mode ----

LowLatencyConfig ll_config(const BufferConfig& c, bool check_finite) {
  LowLatencyConfig l;
  l.hidden = c.hidden;
  l.max_tokens_per_rank = c.max_tokens_per_rank;
  l.num_experts = c.num_experts;
  l.topk = c.topk;
  l.wire = c.wire;
  l.timeout_ms = 20000;
  l.check_finite = check_finite;
  return l;
}

LowLatencyDispatchInput ll_input(const verify::RankInput& in, int64_t h, int64_t k, int32_t* num_tokens) {
  LowLatencyDispatchInput d;
  d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {in.tokens, h});
  d.topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {in.tokens, k});
  if (num_tokens) d.num_tokens = TensorView::of(num_tokens, DType::i32, {1});
  return d;
}

TEST(NonFiniteLowLatency, MatchesTheReferenceAndCombinePropagates) {
  for (WireFormat wire : {WireFormat::bf16, WireFormat::fp8, WireFormat::fp8_ue8m0, WireFormat::nvfp4}) {
    SCOPED_TRACE(std::string(wire_name(wire)));
    const verify::Problem p = problem_with_bad_values(wire, false, 11);
    const auto bad = verify::bad_values(p);
    const int64_t h = p.cfg.hidden, k = p.cfg.topk, l_count = p.cfg.num_experts / 2, slots = 2 * p.cfg.max_tokens_per_rank;
    const std::vector<int64_t> counts = {8, 3};  // rank 1's bad value at token 3 does not count
    std::vector<LowLatencyDispatchResult> got(2);
    std::vector<std::vector<uint16_t>> ys(2);
    std::vector<Tensor> outs(2);
    auto errors = verify::run_ranks(2, [&](const Group& g) {
      const int r = g.rank();
      LowLatencyBuffer b(g, ll_config(p.cfg, false));
      int32_t n = static_cast<int32_t>(counts[r]);
      got[r] = b.dispatch(ll_input(p.inputs[r], h, k, &n));
      ys[r] = verify::dequantized_rows(wire, got[r].recv_x, got[r].recv_scales, got[r].recv_global_scale, l_count * slots, h);
      LowLatencyCombineInput ci;
      ci.y = TensorView::of(ys[r].data(), DType::bf16, {l_count, slots, h});
      ci.topk_weights = TensorView::of(const_cast<float*>(p.inputs[r].weights.data()), DType::f32, {p.inputs[r].tokens, k});
      outs[r] = b.combine(ci, got[r].handle);
    });
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(verify::check_ll_dispatch(p, counts, r, 0.0f, got[r]), "");
      EXPECT_EQ(verify::check_ll_combine(p, counts, ys, r, true, outs[r], "ll_combine out"), "");
      EXPECT_EQ(verify::check_reaches_output(p, bad, r, counts[r], outs[r].data<uint16_t>()), "");
    }
  }
}

TEST(CheckFiniteLowLatency, ANonFiniteValueFailsEveryRankAndTheBufferGoesOn) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(128, 8, 4, 2, WireFormat::fp8);
  spec.ranks = 2;
  const verify::Problem p = verify::make_problem(spec);
  std::vector<Refusal> first(2);
  std::vector<std::string> second(2), past_count(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    LowLatencyBuffer b(g, ll_config(p.cfg, true));
    verify::RankInput in = p.inputs[r];
    if (r == 1) in.x[5 * 128 + 77] = 0xff80;
    try {
      b.dispatch(ll_input(in, 128, 2, nullptr));
    } catch (const Error& e) {
      first[r] = {e.what(), e.code()};
    }
    second[r] = verify::check_ll_dispatch(p, {8, 8}, r, 0.0f, b.dispatch(ll_input(p.inputs[r], 128, 2, nullptr)));
    // Rows past num_tokens do not count: not checked.
    int32_t n = 5;
    try {
      b.dispatch(ll_input(in, 128, 2, &n));
    } catch (const Error& e) {
      past_count[r] = e.what();
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(first[1].what, "ll_dispatch: x[5][77] is not finite (-inf)");
  EXPECT_EQ(first[1].code, ErrorCode::invalid_argument);
  EXPECT_THAT(first[0].what, HasSubstr("rank 1 rejected its input, so the group stops: ll_dispatch: x[5][77] is not finite (-inf)"));
  EXPECT_EQ(first[0].code, ErrorCode::peer_failed);
  EXPECT_EQ(second[0], "");
  EXPECT_EQ(second[1], "");
  EXPECT_EQ(past_count[0], "");
  EXPECT_EQ(past_count[1], "");
}

}  // namespace
}  // namespace epx::test
