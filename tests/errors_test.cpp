// Bad input gets a clear error on every rank, never a hang or silent corruption; the buffer
// stays usable after an input error.
#include <thread>

#include "harness.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;

BufferConfig cfg16() { return small_config(128, 16, 8, 2); }

// Dispatch on 2 ranks where `spoil` may damage rank 1's input; then one good dispatch to show
// the buffer still works. Returns each rank's error from the first call.
std::vector<std::string> dispatch_with(const BufferConfig& cfg, const std::function<void(DispatchInput&, verify::RankInput&)>& spoil) {
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = 2;
  auto p = verify::make_problem(spec);
  std::vector<std::string> first(2), second(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    Buffer b(g, cfg);
    verify::RankInput bad = p.inputs[r];
    DispatchInput in = bad.view(cfg.hidden, cfg.topk);
    if (r == 1) spoil(in, bad);
    try {
      b.dispatch(in);
    } catch (const Error& e) {
      first[r] = e.what();
    }
    auto ok = b.dispatch(p.inputs[r].view(cfg.hidden, cfg.topk));  // still usable
    second[r] = verify::check_dispatch(p, verify::kept_routing(p), r, Layout::expert_major, 0.0f, ok);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(second[r], "") << "rank " << r;
  }
  return first;
}

void expect_rejected(const std::vector<std::string>& e, const std::string& words) {
  EXPECT_THAT(e[1], HasSubstr(words));
  EXPECT_THAT(e[0], HasSubstr("rank 1 rejected its input"));
  EXPECT_THAT(e[0], HasSubstr(words));
}

TEST(Errors, ExpertIdOutOfRange) {
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput&, verify::RankInput& in) { in.idx[3] = 8; }),
                  "topk_idx[1, 1] = 8 is out of range");
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput&, verify::RankInput& in) { in.idx[0] = -2; }),
                  "topk_idx[0, 0] = -2 is out of range");
}

TEST(Errors, RepeatedExpertInOneToken) {
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput&, verify::RankInput& in) { in.idx[5] = in.idx[4]; }),
                  "selects expert");
}

TEST(Errors, ShapeAndDtypeMismatch) {
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput& in, verify::RankInput&) { in.x.shape[1] = 64; }),
                  "dispatch: x: expected shape [T, 128]");
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput& in, verify::RankInput&) { in.x.dtype = DType::f32; }),
                  "expected dtype bf16");
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput& in, verify::RankInput&) { in.topk_idx.shape[1] = 3; }),
                  "dispatch: topk_idx: expected shape [T=16, K=2]");
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput& in, verify::RankInput&) { in.topk_weights.dtype = DType::bf16; }),
                  "topk_weights: expected dtype f32");
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput& in, verify::RankInput&) { in.x.device = DeviceKind::cuda; }),
                  "expected a host tensor");
  expect_rejected(dispatch_with(cfg16(), [](DispatchInput& in, verify::RankInput&) { in.topk_idx = {}; }),
                  "give exactly one of topk_idx and routing_map");
}

TEST(Errors, MoreTokensThanTheBufferWasSizedFor) {
  auto cfg = cfg16();
  std::vector<uint16_t> big(17 * 128, 0x3f80);
  std::vector<int32_t> idx(17 * 2, 0);
  for (int t = 0; t < 17; ++t) idx[t * 2 + 1] = 1;
  expect_rejected(dispatch_with(cfg, [&](DispatchInput& in, verify::RankInput&) {
                    in.x = TensorView::of(big.data(), DType::bf16, {17, 128});
                    in.topk_idx = TensorView::of(idx.data(), DType::i32, {17, 2});
                    in.topk_weights = {};
                  }),
                  "x has 17 tokens but the buffer was sized for max_tokens_per_rank=16");
}

TEST(Errors, PreQuantizedInputNeedsAnFp8Buffer) {
  std::vector<uint8_t> q(16 * 128);
  std::vector<float> s(16);
  expect_rejected(dispatch_with(cfg16(), [&](DispatchInput& in, verify::RankInput&) {
                    in.x = TensorView::of(q.data(), DType::fp8_e4m3, {16, 128});
                    in.x_scales = TensorView::of(s.data(), DType::f32, {16, 1});
                  }),
                  "pre-quantized fp8 x needs a buffer with wire fp8");
}

TEST(Errors, BadConfigs) {
  // Creation is collective even for a config every rank refuses: each rank fails with the reason.
  auto expect_config_error = [&](BufferConfig c, const std::string& words) {
    auto errors = verify::run_ranks(2, [&](const Group& g) {
      try {
        Buffer b(g, c);
        ADD_FAILURE() << "no error for " << words;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        EXPECT_THAT(e.what(), HasSubstr(words));
      }
    });
    for (const std::string& e : errors) EXPECT_EQ(e, "");
  };
  auto c = cfg16();
  c.num_experts = 7;
  expect_config_error(c, "num_experts (7) must be a multiple of the group size (2)");
  c = cfg16();
  c.hidden = 100;
  c.wire = WireFormat::fp8;
  expect_config_error(c, "needs hidden to be a multiple of 128");
  c = cfg16();
  c.topk = 9;
  expect_config_error(c, "topk must be in [1, num_experts]");
  c = cfg16();
  c.mode = CapacityMode::capacity;
  expect_config_error(c, "capacity mode needs capacity_rows > 0");
  c = cfg16();
  c.expert_alignment = 0;
  expect_config_error(c, "expert_alignment must be in [1, 2^30]");
}

TEST(Errors, ConfigsThatDifferAcrossRanks) {
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    auto c = cfg16();
    if (g.rank() == 1) c.hidden = 256;
    Buffer b(g, c);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], HasSubstr("ranks disagree on the buffer config"));
    EXPECT_THAT(errors[r], HasSubstr("hidden=256"));
  }
}

TEST(Errors, OptionsOrCallsThatDifferAcrossRanks) {
  verify::ProblemSpec spec;
  spec.cfg = cfg16();
  spec.ranks = 2;
  auto p = verify::make_problem(spec);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer b(g, spec.cfg);
    b.dispatch(p.inputs[g.rank()].view(128, 2), {g.rank() == 0 ? Layout::expert_major : Layout::rank_major});
  });
  for (int r = 0; r < 2; ++r) EXPECT_THAT(errors[r], HasSubstr("ranks disagree on the call's options"));

  errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer b(g, spec.cfg);
    auto d = b.dispatch(p.inputs[g.rank()].view(128, 2));
    std::vector<uint16_t> y(d.recv_x.numel(), 0x3f80);
    if (g.rank() == 0) b.combine({bf16_view(y, d.recv_x.size(0), 128), {}}, d.handle);
    else b.dispatch(p.inputs[1].view(128, 2));
  });
  for (int r = 0; r < 2; ++r) EXPECT_THAT(errors[r], HasSubstr("every rank must make the same collective calls"));
}

TEST(Errors, MissingPeerTimesOutNamingTheOpAndTheRank) {
  auto cfg = small_config(128, 16, 6, 2);
  cfg.timeout_ms = 300;
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = 3;
  auto p = verify::make_problem(spec);
  auto errors = verify::run_ranks(3, [&](const Group& g) {
    Buffer b(g, cfg);
    if (g.rank() == 2) return;  // rank 2 "dies" after creating its buffer
    b.dispatch(p.inputs[g.rank()].view(128, 2));
  });
  EXPECT_EQ(errors[2], "");
  // The first rank to time out names the missing rank; the other learns the group failed.
  const std::string all = errors[0] + "\n" + errors[1];
  EXPECT_THAT(all, HasSubstr("dispatch #0 (plan exchange)"));
  EXPECT_THAT(all, HasSubstr("for rank(s) 2, which never arrived"));
  EXPECT_FALSE(errors[0].empty());
  EXPECT_FALSE(errors[1].empty());
}

TEST(Errors, TimeoutFromTheEnvironmentWhenTheConfigHasNone) {
  auto cfg = cfg16();
  cfg.timeout_ms = 0;
  setenv("EPX_TIMEOUT_MS", "200", 1);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer b(g, cfg);
    if (g.rank() == 1) return;
    verify::ProblemSpec spec;
    spec.cfg = cfg;
    spec.ranks = 2;
    b.dispatch(verify::make_problem(spec).inputs[0].view(128, 2));
  });
  EXPECT_THAT(errors[0], HasSubstr("waited 200 ms for rank(s) 1"));
  setenv("EPX_TIMEOUT_MS", "soon", 1);
  HostWorld world(1);
  EXPECT_THAT([&] { Buffer b(world.group(0), cfg); },
              testing::ThrowsMessage<Error>(HasSubstr("EPX_TIMEOUT_MS must be a positive number of milliseconds, got 'soon'")));
  const LowLatencyConfig ll{128, 8, 4, 2, WireFormat::bf16, 0};
  EXPECT_THAT([&] { LowLatencyBuffer b(world.group(0), ll); },
              testing::ThrowsMessage<Error>(HasSubstr("EPX_TIMEOUT_MS must be a positive number of milliseconds, got 'soon'")));
  unsetenv("EPX_TIMEOUT_MS");
}

TEST(Errors, HandleFromAnotherBufferAndWrongCombineInput) {
  verify::ProblemSpec spec;
  spec.cfg = cfg16();
  spec.ranks = 2;
  auto p = verify::make_problem(spec);
  std::vector<std::string> e1(2), e2(2), e3(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    Buffer a(g, spec.cfg), b(g, spec.cfg);
    auto d = a.dispatch(p.inputs[r].view(128, 2));
    std::vector<uint16_t> y(d.recv_x.numel() + 128, 0x3f80);
    try {
      b.combine({bf16_view(y, d.recv_x.size(0), 128), {}}, d.handle);
    } catch (const Error& e) {
      e1[r] = e.what();
    }
    try {  // rank 1 passes one row too many
      a.combine({bf16_view(y, d.recv_x.size(0) + (r == 1), 128), {}}, d.handle);
    } catch (const Error& e) {
      e2[r] = e.what();
    }
    try {
      a.combine({bf16_view(y, d.recv_x.size(0), 128), {}}, Handle{});
    } catch (const Error& e) {
      e3[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_THAT(e1[r], HasSubstr("the handle belongs to another buffer"));
    EXPECT_THAT(e3[r], HasSubstr("the handle is empty"));
  }
  EXPECT_THAT(e2[1], HasSubstr("combine: y: expected shape"));
  EXPECT_THAT(e2[0], HasSubstr("rank 1 rejected its input"));
}

TEST(Errors, WeightedCombineNeedsWeightsAndExpertMajor) {
  verify::ProblemSpec spec;
  spec.cfg = cfg16();
  spec.ranks = 2;
  auto p = verify::make_problem(spec);
  for (auto& in : p.inputs) in.has_weights = false;
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer b(g, spec.cfg);
    auto d = b.dispatch(p.inputs[g.rank()].view(128, 2));
    std::vector<uint16_t> y(d.recv_x.numel(), 0x3f80);
    b.combine({bf16_view(y, d.recv_x.size(0), 128), {}}, d.handle, {true});
  });
  EXPECT_THAT(errors[0], HasSubstr("weighted combine needs router weights"));
  errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer b(g, spec.cfg);
    auto d = b.dispatch(p.inputs[g.rank()].view(128, 2), {Layout::rank_major});
    std::vector<uint16_t> y(d.recv_x.numel(), 0x3f80);
    b.combine({bf16_view(y, d.recv_x.size(0), 128), {}}, d.handle, {true});
  });
  EXPECT_THAT(errors[1], HasSubstr("weighted combine needs the expert-major layout"));
}

TEST(Errors, DenseMapWithTooManyExperts) {
  auto cfg = cfg16();
  std::vector<uint8_t> map(16 * 8, 0);
  for (int e = 0; e < 3; ++e) map[5 * 8 + e] = 1;  // token 5 picks 3 > topk 2
  expect_rejected(dispatch_with(cfg, [&](DispatchInput& in, verify::RankInput&) {
                    in.topk_idx = {};
                    in.topk_weights = {};
                    in.routing_map = TensorView::of(map.data(), DType::boolean, {16, 8});
                  }),
                  "routing_map row 5 selects more than topk=2 experts");
}

}  // namespace
}  // namespace epx::test
