// Non-finite input on the CUDA backend (docs/semantics.md, "Non-finite values"): dispatch in
// every wire format and both layouts, and low-latency dispatch, against the reference bit for bit
// (NaN bits included: the encoders write fixed NaNs), combine of the received rows propagating
// them; and check_finite found on the device, failing every rank with the CPU backend's words.
// EP1 over NCCL and EP2 on the shared-GPU transport.
#include <cuda_runtime.h>

#include <gmock/gmock.h>

#include "cuda_harness.hpp"
#include "verify/nonfinite.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;

CudaWorld world_of(bool shared, int ranks) {
  if (shared) return CudaWorld::shared_gpu(ranks, 0);
  std::vector<int> devices(ranks);
  for (int r = 0; r < ranks; ++r) devices[r] = r;
  return CudaWorld(devices);
}

// Host rows to a device array made earlier (no allocation, no legacy-stream copy while a peer may
// be inside a call: docs/cuda.md).
void upload(const DeviceArray& to, const std::vector<uint16_t>& rows) {
  cudaMemcpyAsync(to.get(), rows.data(), rows.size() * 2, cudaMemcpyHostToDevice, cudaStreamPerThread);
  cudaStreamSynchronize(cudaStreamPerThread);
}

struct NfGpuCase {
  bool shared;  // the shared-GPU transport (2 ranks), else NCCL (EP1)
  int ranks;
  WireFormat wire;
  Layout layout;
  bool prequantized = false;
  float nvfp4_global_scale = 0.0f;
};

std::string nf_case_name(const testing::TestParamInfo<NfGpuCase>& info) {
  const NfGpuCase& c = info.param;
  return std::string(c.shared ? "shared" : "nccl") + "_R" + std::to_string(c.ranks) + "_" + std::string(wire_name(c.wire)) +
         "_" + std::string(layout_name(c.layout)) + (c.prequantized ? "_prequantized" : "") +
         (c.nvfp4_global_scale > 0 ? "_given_scale" : "");
}

// H = 2560: the fp8 encoder's rounds of 4 512-channel steps, then one step alone.
verify::Problem gpu_problem_with_bad_values(int ranks, WireFormat wire, bool prequantized, uint64_t seed) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(2560, 64, 16, 4, wire);
  spec.cfg.num_sms = 4;
  spec.ranks = ranks;
  spec.prequantized = prequantized;
  spec.seed = seed;
  verify::Problem p = verify::make_problem(spec);
  verify::put_bad_values(p, verify::bad_values(p));
  return p;
}

class CudaNonFinite : public testing::TestWithParam<NfGpuCase> {};

TEST_P(CudaNonFinite, DispatchMatchesTheReferenceAndCombinePropagates) {
  const NfGpuCase& c = GetParam();
  if (!c.shared && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  const verify::Problem p = gpu_problem_with_bad_values(c.ranks, c.wire, c.prequantized, 17);
  const auto bad = verify::bad_values(p);
  const int64_t h = p.cfg.hidden, k = p.cfg.topk, tokens = p.cfg.max_tokens_per_rank;
  const bool weighted = c.layout == Layout::expert_major;
  std::vector<DispatchResult> got(c.ranks);
  std::vector<std::vector<uint16_t>> ys(c.ranks);
  std::vector<Tensor> outs(c.ranks);
  const CudaWorld world = world_of(c.shared, c.ranks);
  const auto errors = verify::run_threads(c.ranks, [&](int r) {
    const Group g = world.group(r);
    const int dev = cuda_device(g);
    cudaSetDevice(dev);
    const verify::RankInput& in = p.inputs[r];
    // Device arrays before the buffer, freed after it (cuda_harness.hpp).
    DeviceArray x(in.x), x8(in.x_fp8), xs(in.x_scales), idx(in.idx), w(in.weights),
        y(std::vector<uint16_t>(static_cast<size_t>(rows_bound(p) * h)));
    Buffer b(g, p.cfg);
    DispatchInput din;
    if (p.prequantized) {
      din.x = device_view(x8, DType::fp8_e4m3, {tokens, h}, dev);
      din.x_scales = device_view(xs, DType::f32, {tokens, h / kFp8Block}, dev);
    } else {
      din.x = device_view(x, DType::bf16, {tokens, h}, dev);
    }
    din.topk_idx = device_view(idx, DType::i32, {tokens, k}, dev);
    din.topk_weights = device_view(w, DType::f32, {tokens, k}, dev);
    DispatchOptions o;
    o.layout = c.layout;
    o.nvfp4_global_scale = c.nvfp4_global_scale;
    const DispatchResult d = b.dispatch(din, o);
    b.synchronize();
    got[r] = to_host(d);
    const int64_t rows = d.recv_x.size(0);
    ys[r] = verify::dequantized_rows(c.wire, got[r].recv_x, got[r].recv_scales, got[r].recv_global_scale, rows, h);
    upload(y, ys[r]);
    const CombineResult out = b.combine({device_view(y, DType::bf16, {rows, h}, dev), {}}, d.handle, {weighted});
    b.synchronize();
    outs[r] = epx::to_host(out.out);
  });
  for (int r = 0; r < c.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  const auto kept = verify::kept_routing(p);
  std::vector<verify::Expected> layouts;
  for (int r = 0; r < c.ranks; ++r) {
    layouts.push_back(verify::expected_dispatch(p, kept, r, c.layout));
    EXPECT_EQ(verify::check_dispatch(p, kept, r, c.layout, c.nvfp4_global_scale, got[r]), "");
  }
  for (int s = 0; s < c.ranks; ++s) {
    const auto want = verify::expected_combine(p, kept, layouts, ys, s, c.layout, weighted, nullptr);
    ASSERT_EQ(outs[s].numel(), static_cast<int64_t>(want.size()));
    EXPECT_EQ(verify::compare_bf16_nan_equal(outs[s].data<uint16_t>(), want.data(), outs[s].numel(), "combine out"), "")
        << "rank " << s;
    EXPECT_EQ(verify::check_reaches_output(p, bad, s, tokens, outs[s].data<uint16_t>()), "") << "rank " << s;
  }
}

using W = WireFormat;
using L = Layout;

INSTANTIATE_TEST_SUITE_P(
    Formats, CudaNonFinite,
    testing::Values(NfGpuCase{false, 1, W::bf16, L::expert_major}, NfGpuCase{false, 1, W::fp8, L::rank_major},
                    NfGpuCase{false, 1, W::fp8_ue8m0, L::expert_major}, NfGpuCase{false, 1, W::nvfp4, L::rank_major},
                    NfGpuCase{true, 2, W::bf16, L::expert_major}, NfGpuCase{true, 2, W::bf16, L::rank_major},
                    NfGpuCase{true, 2, W::fp8, L::expert_major}, NfGpuCase{true, 2, W::fp8, L::rank_major},
                    NfGpuCase{true, 2, W::fp8_ue8m0, L::expert_major}, NfGpuCase{true, 2, W::fp8_ue8m0, L::rank_major},
                    NfGpuCase{true, 2, W::nvfp4, L::expert_major}, NfGpuCase{true, 2, W::nvfp4, L::rank_major},
                    NfGpuCase{true, 2, W::nvfp4, L::expert_major, false, 300.0f},
                    NfGpuCase{true, 2, W::fp8, L::expert_major, true}),
    nf_case_name);

// ---- low-latency ----

struct LlNfCase {
  bool shared;
  int ranks;
  WireFormat wire;
};

std::string ll_nf_case_name(const testing::TestParamInfo<LlNfCase>& info) {
  return std::string(info.param.shared ? "shared" : "nccl") + "_R" + std::to_string(info.param.ranks) + "_" +
         std::string(wire_name(info.param.wire));
}

LowLatencyConfig ll_config_of(const BufferConfig& c, bool check_finite) {
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

LowLatencyDispatchResult ll_host_copy(const LowLatencyDispatchResult& d) {
  LowLatencyDispatchResult h;
  h.recv_x = epx::to_host(d.recv_x);
  h.recv_scales = epx::to_host(d.recv_scales);
  h.recv_global_scale = epx::to_host(d.recv_global_scale);
  h.recv_count = epx::to_host(d.recv_count);
  h.recv_src = epx::to_host(d.recv_src);
  h.recv_layout = epx::to_host(d.recv_layout);
  return h;
}

class CudaNonFiniteLowLatency : public testing::TestWithParam<LlNfCase> {};

TEST_P(CudaNonFiniteLowLatency, DispatchMatchesTheReferenceAndCombinePropagates) {
  const LlNfCase& c = GetParam();
  if (!c.shared && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  verify::ProblemSpec spec;
  spec.cfg = small_config(2560, 16, 16, 4, c.wire);
  spec.ranks = c.ranks;
  spec.seed = 19;
  verify::Problem p = verify::make_problem(spec);
  verify::put_bad_values(p, verify::bad_values(p));
  const auto bad = verify::bad_values(p);
  const int64_t h = p.cfg.hidden, k = p.cfg.topk, tokens = p.cfg.max_tokens_per_rank;
  const int64_t l_count = p.cfg.num_experts / c.ranks, slots = c.ranks * tokens;
  std::vector<int64_t> counts(c.ranks, tokens);
  if (c.ranks > 1) counts[1] = 3;  // rank 1's bad value at token 3 does not count
  std::vector<LowLatencyDispatchResult> got(c.ranks);
  std::vector<std::vector<uint16_t>> ys(c.ranks);
  std::vector<Tensor> outs(c.ranks);
  const CudaWorld world = world_of(c.shared, c.ranks);
  const auto errors = verify::run_threads(c.ranks, [&](int r) {
    const Group g = world.group(r);
    const int dev = cuda_device(g);
    cudaSetDevice(dev);
    const verify::RankInput& in = p.inputs[r];
    DeviceArray x(in.x), idx(in.idx), w(in.weights), n(std::vector<int32_t>{static_cast<int32_t>(counts[r])}),
        y(std::vector<uint16_t>(static_cast<size_t>(l_count * slots * h)));
    LowLatencyBuffer b(g, ll_config_of(p.cfg, false));
    LowLatencyDispatchInput d;
    d.x = device_view(x, DType::bf16, {tokens, h}, dev);
    d.topk_idx = device_view(idx, DType::i32, {tokens, k}, dev);
    d.num_tokens = device_view(n, DType::i32, {1}, dev);
    const LowLatencyDispatchResult res = b.dispatch(d);
    b.synchronize();
    got[r] = ll_host_copy(res);
    ys[r] = verify::dequantized_rows(c.wire, got[r].recv_x, got[r].recv_scales, got[r].recv_global_scale, l_count * slots, h);
    upload(y, ys[r]);
    LowLatencyCombineInput ci;
    ci.y = device_view(y, DType::bf16, {l_count, slots, h}, dev);
    ci.topk_weights = device_view(w, DType::f32, {tokens, k}, dev);
    const Tensor out = b.combine(ci, res.handle);
    b.synchronize();
    outs[r] = epx::to_host(out);
  });
  for (int r = 0; r < c.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_EQ(verify::check_ll_dispatch(p, counts, r, 0.0f, got[r]), "");
    const auto want = verify::expected_ll_combine(p, counts, ys, r, true);
    ASSERT_EQ(outs[r].numel(), static_cast<int64_t>(want.size()));
    EXPECT_EQ(verify::compare_bf16_nan_equal(outs[r].data<uint16_t>(), want.data(), outs[r].numel(), "ll_combine out"), "")
        << "rank " << r;
    EXPECT_EQ(verify::check_reaches_output(p, bad, r, counts[r], outs[r].data<uint16_t>()), "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaNonFiniteLowLatency,
                         testing::Values(LlNfCase{false, 1, W::bf16}, LlNfCase{false, 1, W::nvfp4},
                                         LlNfCase{true, 2, W::bf16}, LlNfCase{true, 2, W::fp8},
                                         LlNfCase{true, 2, W::fp8_ue8m0}, LlNfCase{true, 2, W::nvfp4}),
                         ll_nf_case_name);

// ---- check_finite on the device ----

struct Refusal {
  std::string what;
  ErrorCode code = ErrorCode::internal;
};

// Two ranks on GPU 0 with check_finite: a dispatch where rank 1's input is spoiled, then a clean
// one (against the reference). Returns each rank's error from the first.
std::vector<Refusal> device_check(const verify::Problem& clean, const std::function<void(verify::RankInput&)>& spoil,
                                  Layout layout = Layout::expert_major) {
  verify::Problem bad = clean;
  spoil(bad.inputs[1]);
  const int64_t h = clean.cfg.hidden, k = clean.cfg.topk, tokens = clean.cfg.max_tokens_per_rank;
  std::vector<Refusal> first(2);
  std::vector<std::string> second(2);
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  const auto errors = verify::run_threads(2, [&](int r) {
    cudaSetDevice(0);
    const verify::RankInput& in = bad.inputs[r];
    const verify::RankInput& good = clean.inputs[r];
    DeviceArray x(in.x), x8(in.x_fp8), xs(in.x_scales), gx(good.x), gx8(good.x_fp8), gxs(good.x_scales), idx(in.idx),
        w(in.weights);
    Buffer b(world.group(r), clean.cfg);
    auto input = [&](const DeviceArray& bf16, const DeviceArray& fp8, const DeviceArray& scales) {
      DispatchInput d;
      if (clean.prequantized) {
        d.x = device_view(fp8, DType::fp8_e4m3, {tokens, h}, 0);
        d.x_scales = device_view(scales, DType::f32, {tokens, h / kFp8Block}, 0);
      } else {
        d.x = device_view(bf16, DType::bf16, {tokens, h}, 0);
      }
      d.topk_idx = device_view(idx, DType::i32, {tokens, k}, 0);
      d.topk_weights = device_view(w, DType::f32, {tokens, k}, 0);
      return d;
    };
    DispatchOptions o;
    o.layout = layout;
    try {
      b.dispatch(input(x, x8, xs), o);
      b.synchronize();
    } catch (const Error& e) {
      first[r] = {e.what(), e.code()};
    }
    try {
      const DispatchResult ok = b.dispatch(input(gx, gx8, gxs), o);  // the buffer still works
      b.synchronize();
      second[r] = verify::check_dispatch(clean, verify::kept_routing(clean), r, layout, 0.0f, to_host(ok));
    } catch (const Error& e) {
      second[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(second[r], "") << "rank " << r;
  }
  return first;
}

void expect_refused(const std::vector<Refusal>& e, const std::string& words) {
  EXPECT_THAT(e[1].what, HasSubstr(words));
  EXPECT_EQ(e[1].code, ErrorCode::invalid_argument);
  EXPECT_THAT(e[0].what, HasSubstr("rank 1 rejected its input"));
  EXPECT_THAT(e[0].what, HasSubstr(words));
  EXPECT_EQ(e[0].code, ErrorCode::peer_failed);
}

verify::Problem checked(int64_t hidden, WireFormat wire, bool prequantized = false, double capacity_factor = 0.0) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(hidden, 32, 16, 4, wire);
  spec.cfg.check_finite = true;
  spec.cfg.capacity_factor = capacity_factor;
  spec.cfg.num_sms = 4;
  spec.ranks = 2;
  spec.prequantized = prequantized;
  return verify::make_problem(spec);
}

TEST(CudaCheckFinite, ANonFiniteValueIsFoundOnTheDeviceAndEveryRankStops) {
  for (WireFormat wire : {WireFormat::bf16, WireFormat::fp8, WireFormat::nvfp4}) {
    SCOPED_TRACE(std::string(wire_name(wire)));
    const auto p = checked(2048, wire);
    expect_refused(device_check(p, [](verify::RankInput& in) { in.x[3 * 2048 + 70] = 0x7fc0; }),
                   "dispatch: x[3][70] is not finite (nan)");
    expect_refused(device_check(p, [](verify::RankInput& in) { in.x[31 * 2048 + 2047] = 0xff80; }, Layout::rank_major),
                   "dispatch: x[31][2047] is not finite (-inf)");
  }
}

TEST(CudaCheckFinite, RowsThatAre16ByteUnalignedAndTwoPlanExchanges) {
  // H = 100: 200-byte rows, scanned an element at a time.
  expect_refused(device_check(checked(100, WireFormat::bf16), [](verify::RankInput& in) { in.x[9 * 100 + 99] = 0x7f80; }),
                 "dispatch: x[9][99] is not finite (inf)");
  // capacity_factor: the error goes with the first of the call's two plan exchanges.
  expect_refused(device_check(checked(256, WireFormat::bf16, false, 0.5),
                              [](verify::RankInput& in) { in.x[1 * 256 + 2] = 0xffc1; }),
                 "dispatch: x[1][2] is not finite (nan)");
}

TEST(CudaCheckFinite, PreQuantizedCodesAndScales) {
  const auto p = checked(256, WireFormat::fp8, true);
  expect_refused(device_check(p, [](verify::RankInput& in) { in.x_fp8[4 * 256 + 9] = 0xff; }),
                 "dispatch: x[4][9] is not finite (nan)");
  expect_refused(device_check(p, [](verify::RankInput& in) { in.x_scales[6 * 2 + 1] = INFINITY; }),
                 "dispatch: x_scales[6][1] is not finite (inf)");
}

TEST(CudaCheckFinite, OneRankOverNcclAndFiniteInputPasses) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(1024, 32, 8, 2);
  spec.cfg.check_finite = true;
  const verify::Problem p = verify::make_problem(spec);
  std::string error, clean;
  const CudaWorld world(std::vector<int>{0});
  const auto errors = verify::run_threads(1, [&](int) {
    cudaSetDevice(0);
    std::vector<uint16_t> bad = p.inputs[0].x;
    bad[17 * 1024 + 500] = 0x7f80;
    DeviceArray x(bad), gx(p.inputs[0].x), idx(p.inputs[0].idx), w(p.inputs[0].weights);
    Buffer b(world.group(0), p.cfg);
    DispatchInput d;
    d.topk_idx = device_view(idx, DType::i32, {32, 2}, 0);
    d.topk_weights = device_view(w, DType::f32, {32, 2}, 0);
    d.x = device_view(x, DType::bf16, {32, 1024}, 0);
    try {
      b.dispatch(d);
      b.synchronize();
    } catch (const Error& e) {
      error = e.what();
    }
    d.x = device_view(gx, DType::bf16, {32, 1024}, 0);
    const DispatchResult ok = b.dispatch(d);
    b.synchronize();
    clean = verify::check_dispatch(p, verify::kept_routing(p), 0, Layout::expert_major, 0.0f, to_host(ok));
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_THAT(error, HasSubstr("dispatch: x[17][500] is not finite (inf)"));
  EXPECT_EQ(clean, "");
}

// Low-latency: found by the send half on the device; like a bad id, the next call raises it on
// every rank, and the call after that works. Rows past num_tokens are not checked.
TEST(CudaCheckFinite, LowLatencyNextCallRaisesItOnEveryRank) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(1024, 16, 8, 4, WireFormat::fp8);
  spec.ranks = 2;
  const verify::Problem p = verify::make_problem(spec);
  const int64_t h = 1024, k = 4, tokens = 16;
  std::vector<std::string> during(2), raised(2), after(2), past_count(2);
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  const auto errors = verify::run_threads(2, [&](int r) {
    cudaSetDevice(0);
    std::vector<uint16_t> bad = p.inputs[r].x;
    if (r == 1) bad[5 * h + 77] = 0xff80;
    DeviceArray x(bad), gx(p.inputs[r].x), idx(p.inputs[r].idx), n(std::vector<int32_t>{5});
    LowLatencyBuffer b(world.group(r), ll_config_of(p.cfg, true));
    LowLatencyDispatchInput d;
    d.x = device_view(x, DType::bf16, {tokens, h}, 0);
    d.topk_idx = device_view(idx, DType::i32, {tokens, k}, 0);
    try {
      b.dispatch(d);
      b.synchronize();
    } catch (const Error& e) {
      during[r] = e.what();
    }
    LowLatencyDispatchInput good = d;
    good.x = device_view(gx, DType::bf16, {tokens, h}, 0);
    try {
      b.dispatch(good);
      b.synchronize();
    } catch (const Error& e) {
      raised[r] = e.what();
    }
    try {
      const LowLatencyDispatchResult res = b.dispatch(good);
      b.synchronize();
      after[r] = verify::check_ll_dispatch(p, {tokens, tokens}, r, 0.0f, ll_host_copy(res));
      LowLatencyDispatchInput counted = d;  // the bad row is token 5: past a count of 5
      counted.num_tokens = device_view(n, DType::i32, {1}, 0);
      b.dispatch(counted);
      b.synchronize();
      b.dispatch(good);  // would raise what the call before found
      b.synchronize();
    } catch (const Error& e) {
      past_count[r] = e.what();
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(during[0], "");
  EXPECT_EQ(during[1], "");
  EXPECT_THAT(raised[1], HasSubstr("ll_dispatch: x[5][77] is not finite (-inf)"));
  EXPECT_THAT(raised[0], HasSubstr("rank 1 rejected its input"));
  EXPECT_EQ(after[0], "");
  EXPECT_EQ(after[1], "");
  EXPECT_EQ(past_count[0], "");
  EXPECT_EQ(past_count[1], "");
}

}  // namespace
}  // namespace epx::test
