// The low-precision combine wire (BufferConfig::combine_wire, LowLatencyConfig::combine_wire) on
// the CPU backend: its config checks, the error of the fp8 combine against the bf16 combine with
// the bound docs/semantics.md derives (asserted element by element), high-throughput and
// low-latency giving the same sums, and a non-finite partial poisoning only its own block.
// Bit-exactness against the reference is in pipeline_test.cpp and low_latency_test.cpp.
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>

#include "harness.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;

// ---- config ----

TEST(CombineWire, ConfigChecksOnEveryBufferKind) {
  HostWorld world(1);
  struct Refused {
    WireFormat wire;
    int64_t hidden;
    const char* words;
  };
  for (const Refused& r : {Refused{WireFormat::nvfp4, 256, "combine_wire nvfp4 is not supported"},
                           Refused{WireFormat::fp8, 200, "combine_wire fp8 needs hidden to be a multiple of 128"},
                           Refused{WireFormat::fp8_ue8m0, 64, "combine_wire fp8_ue8m0 needs hidden to be a multiple of 128"},
                           Refused{static_cast<WireFormat>(7), 256, "combine_wire: unknown wire format code 7"}}) {
    BufferConfig c = small_config(r.hidden, 8, 4, 2);
    c.combine_wire = r.wire;
    std::string words;
    EXPECT_EQ(code_of([&] { Buffer b(world.group(0), c); }, &words), ErrorCode::invalid_argument);
    EXPECT_THAT(words, HasSubstr(std::string("buffer: ") + r.words));
    LowLatencyConfig l{r.hidden, 8, 4, 2, WireFormat::bf16, 20000};
    l.combine_wire = r.wire;
    EXPECT_EQ(code_of([&] { LowLatencyBuffer b(world.group(0), l); }, &words), ErrorCode::invalid_argument);
    EXPECT_THAT(words, HasSubstr(std::string("low-latency buffer: ") + r.words));
  }
  BufferConfig ok = small_config(256, 8, 4, 2);
  ok.combine_wire = WireFormat::fp8_ue8m0;
  EXPECT_THAT(describe(ok), HasSubstr("combine_wire=fp8_ue8m0"));
  LowLatencyConfig ll{256, 8, 4, 2, WireFormat::bf16, 20000};
  EXPECT_THAT(describe(ll), HasSubstr("combine_wire=bf16"));
}

// Ranks that disagree on combine_wire fail the creation together (it is part of describe()).
TEST(CombineWire, RanksMustAgree) {
  std::vector<ErrorCode> codes(2), ll_codes(2);
  std::vector<std::string> words(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    BufferConfig c = small_config(256, 8, 4, 2);
    if (g.rank() == 1) c.combine_wire = WireFormat::fp8;
    codes[g.rank()] = code_of([&] { Buffer b(g, c); }, &words[g.rank()]);
    LowLatencyConfig l{256, 8, 4, 2, WireFormat::bf16, 20000};
    if (g.rank() == 0) l.combine_wire = WireFormat::fp8_ue8m0;
    ll_codes[g.rank()] = code_of([&] { LowLatencyBuffer b(g, l); }, &words[g.rank()]);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(codes[r], ErrorCode::config_mismatch) << "rank " << r;
    EXPECT_EQ(ll_codes[r], ErrorCode::config_mismatch) << "rank " << r;
  }
}

// ---- the error against the bf16 combine ----

constexpr int kRanks = 4;
constexpr int64_t kHidden = 512, kTokens = 48, kExperts = 32, kTopk = 8;

// The expert output of (source rank, token, expert): H bf16 values, a pure function of the
// three, so the test knows every term of every sum without reading the layout back.
using Values = std::function<void(int s, int64_t t, int64_t e, uint16_t* row)>;

std::mt19937_64 rng_of(int s, int64_t t, int64_t e) {
  return std::mt19937_64(static_cast<uint64_t>(s) * 1000003u + static_cast<uint64_t>(t) * 1009u + static_cast<uint64_t>(e));
}

Values normal_values() {
  return [](int s, int64_t t, int64_t e, uint16_t* row) {
    auto rng = rng_of(s, t, e);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (int64_t c = 0; c < kHidden; ++c) row[c] = float_to_bf16(n(rng));
  };
}

// The tests' generator: magnitudes 2^u, u uniform in [-16, 2): a wide range inside every block.
Values log_uniform_values() {
  return [](int s, int64_t t, int64_t e, uint16_t* row) {
    const auto v = verify::random_bf16(kHidden, static_cast<uint64_t>(s) * 1000003u + static_cast<uint64_t>(t) * 1009u + e);
    std::copy(v.begin(), v.end(), row);
  };
}

// Student-t with 3 degrees of freedom: heavy tails in every block.
Values student_t_values() {
  return [](int s, int64_t t, int64_t e, uint16_t* row) {
    auto rng = rng_of(s, t, e);
    std::student_t_distribution<float> st(3.0f);
    for (int64_t c = 0; c < kHidden; ++c) row[c] = float_to_bf16(st(rng));
  };
}

// Normal values, with channel 5 of every block and every 8th token `factor` times larger: an
// outlier sets its block's scale. At 1000x the small values beside it stay in e4m3's normal
// range (down to amax / (448 * 2^6) = amax / 28672); at 10^5x they fall into its subnormals and
// keep only the absolute precision 2^-10 * scale.
Values outlier_values(float factor) {
  return [factor](int s, int64_t t, int64_t e, uint16_t* row) {
    auto rng = rng_of(s, t, e);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (int64_t c = 0; c < kHidden; ++c) {
      const bool big = c % kFp8Block == 5 || t % 8 == 3;
      row[c] = float_to_bf16(n(rng) * (big ? factor : 1.0f));
    }
  };
}

verify::Problem error_problem(WireFormat combine_wire) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(kHidden, kTokens, kExperts, kTopk);
  spec.cfg.combine_wire = combine_wire;
  spec.ranks = kRanks;
  spec.unused_slot_fraction = 0.1;
  spec.seed = 29;
  return verify::make_problem(spec);
}

using Outputs = std::vector<std::vector<uint16_t>>;  // per source rank [T, H] bf16

// Weighted combine (expert-major) of the Values' rows on every rank.
Outputs run_ht(const verify::Problem& p, const Values& values) {
  Outputs outs(p.ranks);
  const int64_t h = p.cfg.hidden, local = p.cfg.num_experts / p.ranks;
  auto errors = verify::run_ranks(p.ranks, [&](const Group& g) {
    const int r = g.rank();
    Buffer b(g, p.cfg);
    const DispatchResult d = b.dispatch(p.inputs[r].view(h, p.cfg.topk), DispatchOptions{});
    const int64_t rows = d.recv_x.size(0);
    std::vector<uint16_t> y(rows * h, 0);
    const int64_t* offsets = d.expert_offsets.data<int64_t>();
    const int32_t* src = d.recv_src.data<int32_t>();
    for (int64_t l = 0; l < local; ++l)
      for (int64_t i = offsets[l]; i < offsets[l + 1]; ++i)
        if (src[2 * i] >= 0) values(src[2 * i], src[2 * i + 1], r * local + l, &y[i * h]);
    const Tensor out = b.combine({bf16_view(y, rows, h), {}}, d.handle, {true}).out;
    outs[r].assign(out.data<uint16_t>(), out.data<uint16_t>() + out.numel());
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return outs;
}

// The same on a LowLatencyBuffer (weights given to ll_dispatch).
Outputs run_ll(const verify::Problem& p, const Values& values) {
  Outputs outs(p.ranks);
  const int64_t h = p.cfg.hidden, k = p.cfg.topk, local = p.cfg.num_experts / p.ranks,
                slots = p.ranks * p.cfg.max_tokens_per_rank;
  LowLatencyConfig c{h, p.cfg.max_tokens_per_rank, p.cfg.num_experts, k, WireFormat::bf16, 20000};
  c.combine_wire = p.cfg.combine_wire;
  auto errors = verify::run_ranks(p.ranks, [&](const Group& g) {
    const int r = g.rank();
    const verify::RankInput& in = p.inputs[r];
    LowLatencyBuffer b(g, c);
    LowLatencyDispatchInput d;
    d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {in.tokens, h});
    d.topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {in.tokens, k});
    d.topk_weights = TensorView::of(const_cast<float*>(in.weights.data()), DType::f32, {in.tokens, k});
    const LowLatencyDispatchResult got = b.dispatch(d);
    std::vector<uint16_t> y(local * slots * h, 0);
    const int32_t* src = got.recv_src.data<int32_t>();
    for (int64_t l = 0; l < local; ++l)
      for (int64_t j = 0; j < got.recv_count.data<int32_t>()[l]; ++j) {
        const int64_t row = l * slots + j;
        values(src[2 * row], src[2 * row + 1], r * local + l, &y[row * h]);
      }
    LowLatencyCombineInput ci;
    ci.y = TensorView::of(y.data(), DType::bf16, {local, slots, h});
    const Tensor out = b.combine(ci, got.handle);
    outs[r].assign(out.data<uint16_t>(), out.data<uint16_t>() + out.numel());
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return outs;
}

// docs/semantics.md's bound on |fp8 combine - bf16 combine| at one output element, from the
// terms' magnitudes. Per (token, rank) partial p_d (bf16) with block scale s_d: an e4m3 code
// keeps 3 mantissa bits, so a value in e4m3's normal range moves by at most 2^-4 |p_d|, one in
// its subnormal range (|p_d / s_d| < 2^-6, steps of 2^-9) by at most 2^-10 s_d. Both results are
// then rounded to bf16 (2^-9 relative each). |p_d| and the block amax are bounded by A_d = sum
// of |w * y| over rank d's slots (times 1 + 2^-7 for the partial's own bf16 rounding);
// s_d <= max(amax, 1e-4) / 448, twice that with UE8M0's rounding up. 2^-20 covers the fp32
// products and sums.
struct Bound {
  std::vector<std::vector<float>> at;       // per source rank [T * H]
  std::vector<std::vector<double>> terms;   // per source rank [T * H]: sum of |w * y| over every term
};

Bound error_bound(const verify::Problem& p, const Values& values, const Outputs& bf16_out, bool ue8m0) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk, local = p.cfg.num_experts / p.ranks;
  Bound b;
  std::vector<uint16_t> row(h);
  for (int s = 0; s < p.ranks; ++s) {
    const verify::RankInput& in = p.inputs[s];
    std::vector<float> bound(in.tokens * h, 0.0f);
    std::vector<double> terms(in.tokens * h, 0.0);
    for (int64_t t = 0; t < in.tokens; ++t)
      for (int d = 0; d < p.ranks; ++d) {
        std::vector<double> a(h, 0.0);
        bool any = false;
        for (int64_t k = 0; k < k_count; ++k) {
          const int32_t e = in.idx[t * k_count + k];
          if (e < 0 || e / local != d) continue;
          any = true;
          values(s, t, e, row.data());
          for (int64_t c = 0; c < h; ++c) a[c] += std::fabs(in.weights[t * k_count + k] * bf16_to_float(row[c]));
        }
        if (!any) continue;
        for (int64_t c = 0; c < h; ++c) terms[t * h + c] += a[c];
        for (int64_t blk = 0; blk < h / kFp8Block; ++blk) {
          double amax = 0.0;
          for (int64_t c = blk * kFp8Block; c < (blk + 1) * kFp8Block; ++c) amax = std::max(amax, a[c] * (1.0 + 0x1p-7));
          const double scale = std::max(amax, 1e-4) / 448.0 * (ue8m0 ? 2.0 : 1.0);
          for (int64_t c = blk * kFp8Block; c < (blk + 1) * kFp8Block; ++c)
            bound[t * h + c] += static_cast<float>(0x1p-4 * a[c] * (1.0 + 0x1p-7) + 0x1p-10 * scale + 0x1p-20 * a[c]);
        }
      }
    for (int64_t i = 0; i < in.tokens * h; ++i) {
      // Both roundings to bf16; the fp8 result is within the bound above of the bf16 one.
      const float ref = std::fabs(bf16_to_float(bf16_out[s][i]));
      bound[i] += 0x1p-9f * (2.0f * ref + bound[i]) + 1e-30f;
    }
    b.at.push_back(std::move(bound));
    b.terms.push_back(std::move(terms));
  }
  return b;
}

struct Measured {
  double rel_l2 = 0.0;       // ||fp8 - bf16|| / ||bf16|| over every output element
  double max_rel = 0.0;      // max |fp8 - bf16| / max |bf16|
  double of_terms = 0.0;     // max |fp8 - bf16| / (sum of |w * y|) per element: e4m3's 2^-4 shows
  double worst_of_bound = 0.0;  // max |fp8 - bf16| / bound (must stay <= 1)
};

Measured measure(const Outputs& low, const Outputs& ref, const Bound& bound) {
  Measured m;
  double err2 = 0.0, ref2 = 0.0, max_err = 0.0, max_ref = 0.0;
  for (size_t s = 0; s < ref.size(); ++s)
    for (size_t i = 0; i < ref[s].size(); ++i) {
      const double r = bf16_to_float(ref[s][i]), e = std::fabs(bf16_to_float(low[s][i]) - r);
      if (bound.terms[s][i] > 0.0) m.of_terms = std::max(m.of_terms, e / bound.terms[s][i]);
      err2 += e * e;
      ref2 += r * r;
      max_err = std::max(max_err, e);
      max_ref = std::max(max_ref, std::fabs(r));
      m.worst_of_bound = std::max(m.worst_of_bound, e / bound.at[s][i]);
    }
  m.rel_l2 = std::sqrt(err2 / ref2);
  m.max_rel = max_err / max_ref;
  return m;
}

struct ErrorCase {
  const char* name;
  Values values;
  // Documented ceilings of the relative L2 error (docs/semantics.md's table, with a margin).
  double fp8_rel_l2, ue8m0_rel_l2;
};

// The table of docs/semantics.md ("Combine", low-precision wire): printed, and held to its
// ceilings; every element within the derived bound; high-throughput and low-latency equal.
TEST(CombineWire, ErrorAgainstTheBf16CombineStaysWithinTheBound) {
  const std::vector<ErrorCase> cases = {
      {"normal", normal_values(), 0.03, 0.035},
      {"log-uniform 2^[-16,2)", log_uniform_values(), 0.03, 0.035},
      {"student-t (3 dof)", student_t_values(), 0.03, 0.035},
      {"outliers 1000x", outlier_values(1e3f), 0.03, 0.035},
      {"outliers 100000x", outlier_values(1e5f), 0.03, 0.035},
  };
  const verify::Problem bf16_problem = error_problem(WireFormat::bf16);
  std::printf("%-24s %-10s %10s %10s %10s %14s\n", "values", "wire", "rel L2", "max rel", "err/terms", "max err/bound");
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.name);
    const Outputs ref = run_ht(bf16_problem, c.values);
    for (WireFormat w : {WireFormat::fp8, WireFormat::fp8_ue8m0}) {
      const verify::Problem p = error_problem(w);
      const Outputs low = run_ht(p, c.values);
      EXPECT_EQ(run_ll(p, c.values), low) << "low-latency and high-throughput sum alike";
      const Measured m = measure(low, ref, error_bound(p, c.values, ref, w == WireFormat::fp8_ue8m0));
      std::printf("%-24s %-10s %10.2e %10.2e %10.2e %14.3f\n", c.name, std::string(wire_name(w)).c_str(), m.rel_l2,
                  m.max_rel, m.of_terms, m.worst_of_bound);
      EXPECT_LE(m.worst_of_bound, 1.0) << wire_name(w);
      EXPECT_LE(m.rel_l2, w == WireFormat::fp8 ? c.fp8_rel_l2 : c.ue8m0_rel_l2) << wire_name(w);
      EXPECT_GT(m.rel_l2, 0.0) << wire_name(w) << ": the fp8 wire must change something";
    }
  }
}

// ---- non-finite partials ----

// An infinity in one expert row makes its (token, rank) partial's block NaN, and only that
// block: the token's other channels and every other token are as without it.
TEST(CombineWire, ANonFinitePartialPoisonsOnlyItsBlock) {
  const verify::Problem p = error_problem(WireFormat::fp8);
  const Values clean = normal_values();
  int32_t expert = -1;
  for (int64_t k = 0; k < kTopk && expert < 0; ++k) expert = p.inputs[1].idx[2 * kTopk + k];  // token 2 of rank 1
  ASSERT_GE(expert, 0);
  const int64_t channel = kFp8Block + 17;
  const Values spoiled = [&](int s, int64_t t, int64_t e, uint16_t* row) {
    clean(s, t, e, row);
    if (s == 1 && t == 2 && e == expert) row[channel] = 0x7f80;  // +inf
  };
  const Outputs want = run_ht(p, clean), got = run_ht(p, spoiled);
  for (int s = 0; s < kRanks; ++s)
    for (int64_t t = 0; t < p.inputs[s].tokens; ++t)
      for (int64_t c = 0; c < kHidden; ++c) {
        const bool poisoned = s == 1 && t == 2 && c / kFp8Block == channel / kFp8Block;
        const uint16_t g = got[s][t * kHidden + c];
        if (poisoned) EXPECT_TRUE(std::isnan(bf16_to_float(g))) << "channel " << c;
        else ASSERT_EQ(g, want[s][t * kHidden + c]) << "rank " << s << " token " << t << " channel " << c;
      }
}

}  // namespace
}  // namespace epx::test
