// The CUDA backend against the reference, bit for bit: EP1 and EP2 on real GPUs over NCCL,
// EP2..EP8 on the shared-GPU transport; plus device-side errors and timeouts.
#include <cuda_runtime.h>

#include <barrier>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>

#include "cuda_harness.hpp"

namespace epx::test {
namespace {

// Outputs start as 0xa5 bytes, so a row the kernels never write shows up in the comparison;
// EPX_POISON_OUTPUTS=0 in the environment keeps them unpoisoned (device-check's SM-engine pass:
// no memset then stands between a call's kernels, so their programmatic launch is exercised).
const bool kPoisonOutputs = [] { return setenv("EPX_POISON_OUTPUTS", "1", 0) == 0; }();

struct GpuCase {
  Transport transport;
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
  Layout layout;
  int64_t alignment;
  verify::Routing routing;
  double unused;
  CapacityMode mode = CapacityMode::blocking;
  double capacity_factor = 0.0;
  bool prequantized = false;  // x given as fp8 codes + scales
  int64_t sms = 0;            // num_sms; 0: 16 over NCCL, 4 on the shared GPU (every rank's blocks fit at once)
  WireFormat combine_wire = WireFormat::bf16;  // what combine's partials cross back as
};

std::string gpu_case_name(const testing::TestParamInfo<GpuCase>& info) {
  const GpuCase& c = info.param;
  return std::string(c.transport == Transport::nccl ? "nccl" : "shared") + "_R" + std::to_string(c.ranks) + "_H" +
         std::to_string(c.hidden) + "_T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_K" +
         std::to_string(c.topk) + "_" + std::string(wire_name(c.wire)) + "_" + std::string(layout_name(c.layout)) +
         "_A" + std::to_string(c.alignment) + (c.routing == verify::Routing::skewed ? "_skewed" : "") +
         (c.unused > 0 ? "_holes" : "") + (c.mode == CapacityMode::capacity ? "_capacity" : "") +
         (c.capacity_factor > 0 ? "_drop" : "") + (c.prequantized ? "_prequantized" : "") +
         (c.sms > 0 ? "_sms" + std::to_string(c.sms) : "") +
         (c.combine_wire == WireFormat::bf16 ? "" : "_combine_" + std::string(wire_name(c.combine_wire)));
}

void PrintTo(const GpuCase& c, std::ostream* os) { *os << gpu_case_name(testing::TestParamInfo<GpuCase>(c, 0)); }

class CudaVsReference : public testing::TestWithParam<GpuCase> {};

TEST_P(CudaVsReference, BitForBit) {
  const GpuCase& c = GetParam();
  if (c.transport == Transport::nccl && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  verify::ProblemSpec spec;
  spec.cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire, c.alignment);
  spec.cfg.mode = c.mode;
  spec.cfg.capacity_factor = c.capacity_factor;
  if (c.mode == CapacityMode::capacity) spec.cfg.capacity_rows = c.tokens * c.topk / 2 + 8;  // overflows sometimes
  spec.cfg.num_sms = c.sms > 0 ? c.sms : c.transport == Transport::nccl ? 16 : 4;
  spec.cfg.combine_wire = c.combine_wire;
  spec.prequantized = c.prequantized;
  spec.ranks = c.ranks;
  for (int r = 0; r < c.ranks; ++r) spec.tokens.push_back(r == 1 ? 0 : c.tokens - (5 * r) % (c.tokens + 1));
  spec.routing = c.routing;
  spec.unused_slot_fraction = c.unused;
  spec.seed = static_cast<uint64_t>(c.ranks * 977 + c.hidden + c.tokens);
  const verify::Problem p = verify::make_problem(spec);
  RunOptions o;
  o.dispatch.layout = c.layout;
  const auto runs = run_problem_cuda(world_of(c.transport, c.ranks), p, o);
  expect_matches_reference(p, o, runs);
}

using namespace case_names;

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaVsReference,
    testing::Values(
        // EP1 and EP2 on real GPUs (NCCL), the V3-like ratios
        GpuCase{N, 1, 2048, 256, 32, 8, W::bf16, L::expert_major, 16, U, 0.0},
        GpuCase{N, 1, 1024, 128, 32, 8, W::fp8, L::rank_major, 1, U, 0.0},
        GpuCase{N, 2, 7168, 512, 256, 8, W::bf16, L::expert_major, 128, U, 0.0},
        GpuCase{N, 2, 7168, 512, 256, 8, W::bf16, L::rank_major, 1, U, 0.0},
        GpuCase{N, 2, 7168, 256, 256, 8, W::fp8, L::expert_major, 1, K, 0.0},
        GpuCase{N, 2, 4096, 256, 64, 6, W::fp8_ue8m0, L::rank_major, 1, U, 0.1},
        GpuCase{N, 2, 4096, 256, 64, 4, W::nvfp4, L::expert_major, 16, U, 0.0},
        GpuCase{N, 2, 2048, 1024, 8, 1, W::bf16, L::expert_major, 1, K, 0.0},
        GpuCase{N, 2, 2048, 300, 288, 8, W::bf16, L::expert_major, 128, U, 0.2},
        GpuCase{N, 2, 2048, 256, 16, 4, W::bf16, L::expert_major, 1, U, 0.0, CapacityMode::capacity},
        GpuCase{N, 2, 2048, 256, 16, 4, W::bf16, L::expert_major, 1, K, 0.0, CapacityMode::blocking, 0.6},
        GpuCase{N, 2, 100, 64, 4, 2, W::bf16, L::expert_major, 1, U, 0.0},
        GpuCase{N, 2, 2048, 8192, 64, 8, W::bf16, L::expert_major, 128, U, 0.0},
        GpuCase{N, 2, 2048, 8192, 64, 8, W::fp8, L::rank_major, 1, K, 0.0},
        GpuCase{N, 2, 4096, 0, 16, 4, W::bf16, L::expert_major, 16, U, 0.0},
        GpuCase{N, 2, 2048, 256, 16, 4, W::bf16, L::rank_major, 1, U, 0.0, CapacityMode::capacity},
        GpuCase{N, 2, 100, 64, 4, 2, W::bf16, L::rank_major, 1, U, 0.0},
        GpuCase{N, 2, 384, 100, 16, 4, W::fp8, L::rank_major, 1, U, 0.0},
        GpuCase{N, 2, 1024, 256, 32, 8, W::fp8, L::expert_major, 1, U, 0.0, CapacityMode::blocking, 0.0, true},
        GpuCase{N, 2, 2048, 1000, 64, 8, W::bf16, L::expert_major, 1, K, 0.1, CapacityMode::blocking, 0.0, false, 2},
        // EP2..EP8 on one GPU
        GpuCase{S, 2, 2048, 128, 32, 8, W::bf16, L::expert_major, 16, U, 0.0},
        GpuCase{S, 4, 2048, 128, 64, 8, W::bf16, L::expert_major, 128, U, 0.1},
        GpuCase{S, 4, 2048, 128, 64, 8, W::fp8, L::rank_major, 1, K, 0.0},
        GpuCase{S, 8, 1024, 64, 64, 8, W::bf16, L::expert_major, 1, K, 0.2},
        GpuCase{S, 8, 1024, 64, 64, 8, W::nvfp4, L::rank_major, 1, U, 0.0},
        GpuCase{S, 8, 2048, 96, 288, 8, W::fp8_ue8m0, L::expert_major, 16, U, 0.0},
        GpuCase{S, 3, 512, 40, 9, 3, W::bf16, L::expert_major, 4, U, 0.0, CapacityMode::blocking, 0.7},
        // fp8 by copy engines at two ranks: rows of 640 channels (the encode's last 512-channel
        // step partly past the row), 200 tokens (the last broadcast piece short)
        GpuCase{S, 2, 640, 200, 32, 8, W::fp8_ue8m0, L::rank_major, 1, K, 0.0},
        // Rank-major bf16: four broadcast pieces, the last one short; rows of 2008 bytes, not 16-byte
        // multiples (the receiver's register loop)
        GpuCase{S, 2, 2048, 300, 32, 8, W::bf16, L::rank_major, 1, U, 0.0},
        GpuCase{S, 4, 1004, 130, 64, 4, W::bf16, L::rank_major, 1, K, 0.0, CapacityMode::blocking, 0.3},
        // The fp8 combine wire (the SM engine returns it, whatever EPX_COMBINE_ENGINE says)
        GpuCase{N, 1, 1024, 128, 32, 8, W::bf16, L::expert_major, 16, U, 0.1, CapacityMode::blocking, 0.0, false, 0, W::fp8},
        GpuCase{N, 1, 2048, 200, 16, 4, W::fp8, L::rank_major, 1, K, 0.0, CapacityMode::blocking, 0.0, false, 0,
                W::fp8_ue8m0},
        // hidden 2176: the staged fp8 sums' short last 1024-channel slice (its last scale group part-used)
        GpuCase{N, 1, 2176, 96, 16, 4, W::bf16, L::expert_major, 8, U, 0.0, CapacityMode::blocking, 0.0, false, 0, W::fp8},
        GpuCase{N, 1, 2176, 96, 16, 4, W::bf16, L::rank_major, 1, U, 0.0, CapacityMode::blocking, 0.0, false, 0, W::fp8},
        GpuCase{S, 2, 1024, 96, 32, 8, W::bf16, L::expert_major, 8, K, 0.1, CapacityMode::capacity, 0.0, false, 0, W::fp8},
        GpuCase{S, 2, 1024, 96, 16, 4, W::fp8, L::rank_major, 1, U, 0.0, CapacityMode::capacity, 0.0, false, 0, W::fp8},
        GpuCase{S, 4, 512, 64, 32, 6, W::bf16, L::rank_major, 1, U, 0.2, CapacityMode::blocking, 0.5, false, 0,
                W::fp8_ue8m0},
        GpuCase{S, 3, 768, 40, 9, 3, W::nvfp4, L::expert_major, 4, U, 0.0, CapacityMode::blocking, 0.0, false, 0, W::fp8}),
    gpu_case_name);

// The multi-process API (nccl_unique_id, cuda_group_init_rank: one rank per process in a job), here
// from one thread per GPU: each rank's group holds its own communicator only, as in a job. Every
// op against the reference, on two GPUs where there are two.
TEST(CudaGroupInitRank, RanksJoinedByIdMatchTheReference) {
  const int ranks = std::min(gpu_count(), 2);
  verify::ProblemSpec spec;
  spec.cfg = small_config(2048, 256, 32, 8, WireFormat::bf16, 1);
  spec.cfg.num_sms = 16;
  spec.ranks = ranks;
  spec.seed = 4242;
  const verify::Problem p = verify::make_problem(spec);
  const std::string id = nccl_unique_id();
  std::vector<Group> groups(ranks);
  // ncclCommInitRank returns once every rank has joined: each joins from its own thread.
  const std::vector<std::string> joined =
      verify::run_threads(ranks, [&](int r) { groups[r] = cuda_group_init_rank(id, r, ranks, r); });
  for (int r = 0; r < ranks; ++r) ASSERT_EQ(joined[r], "") << "rank " << r;
  for (Layout layout : {Layout::rank_major, Layout::expert_major}) {
    RunOptions o;
    o.dispatch.layout = layout;
    const auto runs = run_problem_cuda([&](int r) { return groups[r]; }, p, o);
    expect_matches_reference(p, o, runs);
  }
}

// Runs fn(rank, group, inputs) for 2 ranks sharing GPU 0, each on its own thread. The device
// copies of the rank's inputs exist before fn runs and are freed after it: fn's buffers are gone
// by then, and their release waits for every rank (a cudaFree while a peer is inside a call
// would hold the peer back; docs/cuda.md).
void on_shared_gpu(const verify::Problem& p,
                   const std::function<void(int, const Group&, const DeviceArray&, const DeviceArray&)>& fn) {
  const CudaWorld world = CudaWorld::shared_gpu(p.ranks, 0);
  const std::vector<std::string> errors = verify::run_threads(p.ranks, [&](int r) {
    cudaSetDevice(0);
    DeviceArray x(p.inputs[r].x), idx(p.inputs[r].idx);
    fn(r, world.group(r), x, idx);
  });
  for (int r = 0; r < p.ranks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " (an exception fn did not catch)";
}

verify::Problem two_ranks(const BufferConfig& cfg) {
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = 2;
  return verify::make_problem(spec);
}

TEST(CudaErrors, BadExpertIdIsFlaggedOnTheDeviceAndEveryRankStops) {
  const auto good = two_ranks(small_config(256, 32, 16, 4));
  auto bad = good;
  bad.inputs[1].idx[4 * 3 + 2] = 99;  // token 3, slot 2
  std::vector<std::string> errors(2), after(2);
  on_shared_gpu(bad, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    DeviceArray good_idx(good.inputs[r].idx);
    Buffer b(g, good.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    try {
      b.dispatch(in);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    in.topk_idx = device_view(good_idx, DType::i32, {32, 4}, 0);
    try {
      b.dispatch(in);  // the buffer still works
    } catch (const Error& e) {
      after[r] = e.what();
    }
  });
  EXPECT_THAT(errors[1], testing::HasSubstr("topk_idx[3, 2] = 99 is out of range"));
  EXPECT_THAT(errors[0], testing::HasSubstr("rank 1 rejected its input"));
  EXPECT_THAT(errors[0], testing::HasSubstr("topk_idx[3, 2] = 99"));
  EXPECT_EQ(after[0], "");
  EXPECT_EQ(after[1], "");
}

TEST(CudaErrors, HostRejectionReachesPeersWithItsMessage) {
  const auto p = two_ranks(small_config(256, 32, 16, 4));
  std::vector<std::string> errors(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, p.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, r == 1 ? 128 : 256}, 0);  // rank 1: wrong hidden
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    try {
      b.dispatch(in);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  EXPECT_THAT(errors[1], testing::HasSubstr("dispatch: x: expected shape"));
  EXPECT_THAT(errors[0], testing::HasSubstr("rank 1 rejected its input, so the group stops: dispatch: x: expected shape"));
}

// Creation agrees on the config first: a config one rank refuses (in the front end's checks or in
// the CUDA backend's own) fails every rank at once with the cause, not after a timeout.
TEST(CudaErrors, AConfigRefusedOnOneRankFailsEveryRankAtOnce) {
  auto cfg = small_config(256, 32, 16, 4);
  cfg.timeout_ms = 20000;
  const auto p = two_ranks(cfg);
  for (const char* spoil : {"fp8 with hidden 200", "num_sms 100000"}) {
    std::vector<std::string> errors(2);
    std::vector<ErrorCode> codes(2, ErrorCode::internal);
    const auto start = std::chrono::steady_clock::now();
    on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray&, const DeviceArray&) {
      BufferConfig c = cfg;
      if (r == 1 && spoil[0] == 'f') c.wire = WireFormat::fp8, c.hidden = 200;
      if (r == 1 && spoil[0] == 'n') c.num_sms = 100000;
      try {
        Buffer b(g, c);
      } catch (const Error& e) {
        errors[r] = e.what();
        codes[r] = e.code();
      }
    });
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << spoil;
    EXPECT_EQ(codes[1], ErrorCode::invalid_argument) << spoil << ": " << errors[1];
    EXPECT_EQ(codes[0], ErrorCode::peer_failed) << spoil << ": " << errors[0];
    EXPECT_THAT(errors[0], testing::HasSubstr("rank 1 refused its config, so the group stops: " + errors[1]));
  }
}

// dispatch_all / combine_all (epx/all_ranks.hpp) from one host thread on the shared GPU, capacity
// mode: the same rows and sums as the CPU backend's, bit for bit; blocking buffers are refused.
TEST(CudaAllRanks, CapacityModeCallsFromOneThreadMatchTheReference) {
  auto cfg = small_config(256, 32, 16, 4);
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = 2 * 32 * 4;
  cfg.timeout_ms = 20000;
  const verify::Problem p = two_ranks(cfg);
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  HostWorld host(2);
  std::vector<std::optional<Buffer>> gpu(2), cpu(2), blocking(2);
  BufferConfig blocking_cfg = cfg;
  blocking_cfg.mode = CapacityMode::blocking;
  auto made = verify::run_threads(2, [&](int r) {
    cudaSetDevice(0);
    gpu[r].emplace(world.group(r), cfg);
    blocking[r].emplace(world.group(r), blocking_cfg);
    cpu[r].emplace(host.group(r), cfg);
  });
  for (const auto& e : made) ASSERT_EQ(e, "");
  std::vector<DeviceArray> xs, idxs, ws;
  std::vector<DispatchInput> gpu_in(2), cpu_in(2);
  for (int r = 0; r < 2; ++r) {
    const verify::RankInput& in = p.inputs[r];
    xs.emplace_back(in.x);
    idxs.emplace_back(in.idx);
    ws.emplace_back(in.weights);
    gpu_in[r].x = device_view(xs[r], DType::bf16, {in.tokens, 256}, 0);
    gpu_in[r].topk_idx = device_view(idxs[r], DType::i32, {in.tokens, 4}, 0);
    gpu_in[r].topk_weights = device_view(ws[r], DType::f32, {in.tokens, 4}, 0);
    cpu_in[r] = in.view(256, 4);
  }
  std::vector<Buffer*> g = {&*gpu[0], &*gpu[1]}, c = {&*cpu[0], &*cpu[1]}, b = {&*blocking[0], &*blocking[1]};
  const std::vector<DispatchResult> dg = dispatch_all(g, gpu_in), dc = dispatch_all(c, cpu_in);
  std::vector<std::vector<uint16_t>> ys(2);
  std::vector<DeviceArray> dys;
  std::vector<CombineInput> gy(2), cy(2);
  for (int r = 0; r < 2; ++r) {
    ys[r] = verify::random_bf16(cfg.capacity_rows * 256, 90 + r);
    dys.emplace_back(ys[r]);
    gy[r] = {device_view(dys[r], DType::bf16, {cfg.capacity_rows, 256}, 0), {}};
    cy[r] = {bf16_view(ys[r], cfg.capacity_rows, 256), {}};
  }
  const std::vector<CombineResult> cg = combine_all(g, gy, std::vector<Handle>{dg[0].handle, dg[1].handle});
  const std::vector<CombineResult> cc = combine_all(c, cy, std::vector<Handle>{dc[0].handle, dc[1].handle});
  for (int r = 0; r < 2; ++r) {
    g[r]->synchronize();
    const Tensor recv = epx::to_host(dg[r].recv_x), out = epx::to_host(cg[r].out);
    EXPECT_EQ(std::memcmp(recv.data<char>(), dc[r].recv_x.data<char>(), 2 * recv.numel()), 0) << "recv_x, rank " << r;
    EXPECT_EQ(std::memcmp(out.data<char>(), cc[r].out.data<char>(), 2 * out.numel()), 0) << "combine, rank " << r;
  }
  std::string what;
  EXPECT_EQ(code_of([&] { dispatch_all(b, gpu_in); }, &what), ErrorCode::invalid_argument);
  EXPECT_THAT(what, testing::HasSubstr("blocking mode"));
  auto closed = verify::run_threads(2, [&](int r) {  // a shared-GPU buffer's destruction waits for its peers'
    cudaSetDevice(0);
    gpu[r].reset();
    blocking[r].reset();
  });
  for (const auto& e : closed) EXPECT_EQ(e, "");
}

// The high-throughput buffer's load counters (Buffer::expert_load): each local expert's (token,
// slot) pairs of every dispatch, added on the device (graph-safe), in both layouts; a cached
// dispatch and a call a rank refused add nothing; reset_expert_load zeroes them, stream-ordered.
// tokens_per_expert, which every bit-for-bit test checks against the reference, is what one
// dispatch adds.
TEST(CudaExpertLoad, CountsEachDispatchsPairsPerLocalExpert) {
  const auto p = two_ranks(small_config(256, 32, 16, 4));
  std::vector<std::string> errors(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, p.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    auto load = [&] {
      b.synchronize();
      const Tensor t = to_host(b.expert_load());
      return std::vector<int64_t>(t.data<int64_t>(), t.data<int64_t>() + t.numel());
    };
    auto expect = [&](const std::vector<int64_t>& got, const Tensor& per_expert, int64_t times, const char* when) {
      const Tensor want = to_host(per_expert);
      for (int64_t l = 0; l < want.numel(); ++l)
        if (got[static_cast<size_t>(l)] != times * want.data<int64_t>()[l])
          errors[r] += std::string(when) + ": expert " + std::to_string(l) + " counted " +
                       std::to_string(got[static_cast<size_t>(l)]) + ", expected " +
                       std::to_string(times * want.data<int64_t>()[l]) + "; ";
    };
    const DispatchResult first = b.dispatch(in);  // expert-major
    expect(load(), first.tokens_per_expert, 1, "one dispatch");
    DispatchInput rows;
    rows.x = in.x;
    b.dispatch(rows, first.handle);  // a cached dispatch counts nothing
    expect(load(), first.tokens_per_expert, 1, "after a cached dispatch");
    b.dispatch(in, {Layout::rank_major, 0.0f});
    expect(load(), first.tokens_per_expert, 2, "a rank-major dispatch more");
    try {
      if (r == 1) b.reject(Op::dispatch, "binding: refused");
      b.dispatch(in);
    } catch (const Error&) {
    }
    expect(load(), first.tokens_per_expert, 2, "after a refused dispatch");
    b.reset_expert_load();
    expect(load(), first.tokens_per_expert, 0, "after the reset");
    b.dispatch(in);
    expect(load(), first.tokens_per_expert, 1, "one dispatch after the reset");
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A rank whose experts got no rows may pass an empty y and grad_recv_x without data (torch's
// empty CUDA tensors have none). Rank-major at three ranks (the SM engine, which reads a rank's
// own rows in place in y): every token of every rank goes to ranks 0 and 1 and none to rank 2,
// whose reducers must still sum its tokens' rows from the others, not wait for its own return.
// With y = recv_x, each output row is x + x, exact in bf16.
TEST(CudaCombine, ARankWithoutRowsMayPassAnEmptyYWithoutData) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(256, 32, 12, 4);  // experts 0-3 on rank 0, 4-7 on rank 1, 8-11 on rank 2
  spec.ranks = 3;
  verify::Problem p = verify::make_problem(spec);
  for (auto& in : p.inputs)
    for (int64_t t = 0; t < in.tokens; ++t)
      for (int64_t k = 0; k < 4; ++k) in.idx[t * 4 + k] = static_cast<int32_t>((t + 2 * k) % 8);
  std::vector<std::string> errors(3);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, p.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    const DispatchResult d = b.dispatch(in, {Layout::rank_major, 0.0f});
    if ((d.num_rows == 0) != (r == 2)) errors[r] += "received " + std::to_string(d.num_rows) + " rows; ";
    const TensorView rows = r == 2 ? TensorView::of(nullptr, DType::bf16, {0, 256}, DeviceKind::cuda, 0) : d.recv_x.view();
    const CombineResult c = b.combine({rows, {}}, d.handle, {false});
    const DispatchBackwardResult back = b.dispatch_backward({rows, {}}, d.handle);
    b.synchronize();
    for (const Tensor* got : {&c.out, &back.grad_x}) {
      const Tensor h = to_host(*got);
      for (int64_t i = 0; i < 32 * 256; ++i)
        if (h.data<uint16_t>()[i] != float_to_bf16(2.0f * bf16_to_float(p.inputs[r].x[i]))) {
          errors[r] += std::string(got == &c.out ? "combine" : "dispatch_backward") + " differs at " + std::to_string(i) + "; ";
          break;
        }
    }
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Ranks combining with handles of different dispatches fail with config_mismatch (the handle's
// dispatch is part of what a call's ranks agree on) instead of reading each other's rows wrong.
TEST(CudaErrors, HandlesOfDifferentDispatchesFailEveryRank) {
  auto cfg = small_config(256, 32, 16, 4);
  const auto p = two_ranks(cfg);
  std::vector<ErrorCode> codes(2, ErrorCode::internal);
  std::vector<std::string> errors(2), after(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    DeviceArray y(std::vector<uint16_t>(rows_bound(p) * 256, 0x3f80));
    Buffer b(g, cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    const DispatchResult first = b.dispatch(in);
    in.x.shape[0] = in.topk_idx.shape[0] = 16;  // the second dispatch: the first 16 tokens
    const DispatchResult second = b.dispatch(in);
    const DispatchResult& mine = r == 0 ? second : first;
    try {
      b.combine({device_view(y, DType::bf16, {mine.num_rows, 256}, 0), {}}, mine.handle, {false});
    } catch (const Error& e) {
      errors[r] = e.what();
      codes[r] = e.code();
    }
    try {  // the buffer goes on
      b.combine({device_view(y, DType::bf16, {first.num_rows, 256}, 0), {}}, first.handle, {false});
      b.synchronize();
    } catch (const Error& e) {
      after[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], ErrorCode::config_mismatch) << "rank " << r << ": " << errors[r];
    EXPECT_EQ(after[r], "") << "rank " << r;
  }
}

// The fp8 combine wire quantizes partials from 16-byte loads of y: a y not 16-byte aligned on one
// rank fails that combine on every rank (the refusing rank with the cause, its peer with
// peer_failed), and an aligned combine of the same handle then works.
TEST(CudaErrors, AMisalignedYWithTheFp8CombineWireFailsEveryRank) {
  auto cfg = small_config(256, 32, 16, 4);
  cfg.combine_wire = WireFormat::fp8;
  const auto p = two_ranks(cfg);
  std::vector<ErrorCode> codes(2, ErrorCode::internal);
  std::vector<std::string> errors(2), after(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    DeviceArray y(std::vector<uint16_t>((rows_bound(p) + 1) * 256, 0x3f80));
    Buffer b(g, cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    const DispatchResult d = b.dispatch(in);
    TensorView ys = device_view(y, DType::bf16, {d.num_rows, 256}, 0);
    TensorView shifted = ys;
    shifted.data = static_cast<uint16_t*>(ys.data) + (r == 1 ? 1 : 0);  // rank 1: 2 bytes past 16-byte alignment
    try {
      b.combine({shifted, {}}, d.handle, {false});
    } catch (const Error& e) {
      errors[r] = e.what();
      codes[r] = e.code();
    }
    try {
      b.combine({ys, {}}, d.handle, {false});
      b.synchronize();
    } catch (const Error& e) {
      after[r] = e.what();
    }
  });
  EXPECT_EQ(codes[1], ErrorCode::invalid_argument) << errors[1];
  EXPECT_THAT(errors[1], testing::HasSubstr("y must be 16-byte aligned"));
  EXPECT_EQ(codes[0], ErrorCode::peer_failed) << errors[0];
  for (int r = 0; r < 2; ++r) EXPECT_EQ(after[r], "") << "rank " << r;
}

// A front end's own refusal (Buffer::reject) fails the peers' same call with its words.
TEST(CudaErrors, RejectJoinsThePeersCall) {
  const auto p = two_ranks(small_config(256, 32, 16, 4));
  std::vector<std::string> errors(2), after(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, p.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    try {
      if (r == 1) b.reject(Op::dispatch, "binding: x is not contiguous");
      b.dispatch(in);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    try {
      b.dispatch(in);
      b.synchronize();
    } catch (const Error& e) {
      after[r] = e.what();
    }
  });
  EXPECT_EQ(errors[1], "binding: x is not contiguous");
  EXPECT_THAT(errors[0], testing::HasSubstr("rank 1 rejected its input"));
  EXPECT_EQ(after[0], "");
  EXPECT_EQ(after[1], "");
}

// In capacity mode (no host sync) a front end's refusal is raised at once on its rank and, found on
// the device, by the peers' next call; the refusing rank's next call raises it too, so every rank
// skips that call alike and the call after it works.
TEST(CudaErrors, RejectInCapacityModeFailsTheNextCallOnEveryRank) {
  auto cfg = small_config(256, 32, 16, 4);
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = 32 * 4;
  const auto p = two_ranks(cfg);
  std::vector<std::string> raised(2), next(2), after(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, p.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    try {
      if (r == 1) b.reject(Op::dispatch, "binding: x is not contiguous");
      b.dispatch(in);
    } catch (const Error& e) {
      raised[r] = e.what();
    }
    b.synchronize();  // the device's findings are raised by the next call
    try {
      b.dispatch(in);
    } catch (const Error& e) {
      next[r] = e.what();
    }
    try {
      b.dispatch(in);
      b.synchronize();
      b.dispatch(in);  // raises what the previous one found, if anything
    } catch (const Error& e) {
      after[r] = e.what();
    }
  });
  EXPECT_EQ(raised[1], "binding: x is not contiguous");
  EXPECT_EQ(raised[0], "");
  EXPECT_THAT(next[0], testing::HasSubstr("rank 1 rejected its input"));
  EXPECT_THAT(next[1], testing::HasSubstr("rank 1 rejected its input"));
  EXPECT_EQ(after[0], "");
  EXPECT_EQ(after[1], "");
}

// Cached dispatches on handles of different dispatches fail every rank with config_mismatch,
// and the buffer goes on (the next cached dispatch returns the first dispatch's rows again).
TEST(CudaErrors, CachedDispatchesOnHandlesOfDifferentDispatchesFailEveryRank) {
  const auto p = two_ranks(small_config(256, 32, 16, 4));
  std::vector<std::string> errors(2);
  std::vector<int> same(2, 0);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, p.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    const DispatchResult first = b.dispatch(in), second = b.dispatch(in);
    DispatchInput rows;
    rows.x = in.x;
    try {
      b.dispatch(rows, r == 0 ? first.handle : second.handle);
      b.synchronize();
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    const DispatchResult again = b.dispatch(rows, first.handle);
    b.synchronize();
    const Tensor want = to_host(first.recv_x), got = to_host(again.recv_x);
    same[r] = want.numel() == got.numel() &&
              std::memcmp(want.data<uint16_t>(), got.data<uint16_t>(), static_cast<size_t>(want.numel()) * 2) == 0;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], testing::HasSubstr("cached_dispatch")) << "rank " << r;
    EXPECT_THAT(errors[r], testing::HasSubstr("handles of the same dispatch")) << "rank " << r;
    EXPECT_TRUE(same[r]) << "rank " << r;
  }
}

TEST(CudaErrors, AMissingPeerTimesOutInsteadOfHanging) {
  auto cfg = small_config(256, 32, 16, 4);
  cfg.timeout_ms = 500;
  const auto p = two_ranks(cfg);
  std::vector<std::string> errors(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    Buffer b(g, cfg);
    if (r == 1) return;  // rank 1 is "killed" after creating its buffer
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
    for (int call = 0; call < 2; ++call) {
      try {
        b.dispatch(in);
      } catch (const Error& e) {
        errors[r] += std::string(e.what()) + "\n";
      }
    }
  });
  EXPECT_THAT(errors[0], testing::HasSubstr("dispatch #0 (plan exchange): rank 0 waited 500 ms for rank(s) 1"));
  EXPECT_THAT(errors[0], testing::HasSubstr("the group already failed"));
}

// On one GPU shared by every rank, buffers whose ranks could keep more streams busy than the GPU
// has hardware queues are refused with a message, not left to hang (docs/cuda.md). The queue
// count is read from CUDA_DEVICE_MAX_CONNECTIONS, so setting it here reaches the check only.
TEST(CudaErrors, MoreBusyStreamsThanHardwareQueuesAreRefusedOnTheSharedGpu) {
  const auto p = two_ranks(small_config(256, 32, 16, 4));
  const char* was = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string before = was ? was : "";
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);  // 2 ranks x at least one stream (the call's) do not fit
  std::vector<std::string> errors(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray&, const DeviceArray&) {
    try {
      Buffer b(g, p.cfg);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  if (was) setenv("CUDA_DEVICE_MAX_CONNECTIONS", before.c_str(), 1);
  else unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], testing::HasSubstr("streams busy at once, more than the GPU's 1 hardware queues"))
        << "rank " << r;
    EXPECT_THAT(errors[r], testing::HasSubstr("Set CUDA_DEVICE_MAX_CONNECTIONS=32")) << "rank " << r;
  }
}

// routing_map + probs on the GPU give what the equivalent top-k form gives (experts ascending).
TEST(CudaInputs, DenseRoutingMapEqualsItsTopkForm) {
  const BufferConfig cfg = small_config(512, 64, 16, 4);
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = 2;
  spec.unused_slot_fraction = 0.25;
  const verify::Problem p = verify::make_problem(spec);
  const verify::DenseRouting dense = verify::dense_routing(p);
  const auto& maps = dense.maps;
  const auto& probs = dense.probs;
  const auto& sorted = dense.sorted;
  std::vector<DispatchResult> got(2);
  std::vector<std::string> errors(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray&) {
    DeviceArray map(maps[r]), prob(probs[r]);
    const int64_t tokens = p.inputs[r].tokens;
    Buffer b(g, cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {tokens, 512}, 0);
    in.routing_map = device_view(map, DType::boolean, {tokens, 16}, 0);
    in.probs = device_view(prob, DType::f32, {tokens, 16}, 0);
    try {
      DispatchResult d = b.dispatch(in);
      b.synchronize();
      got[r] = to_host(d);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  });
  const auto kept = verify::kept_routing(sorted);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "");
    EXPECT_EQ(verify::check_dispatch(sorted, kept, r, Layout::expert_major, 0.0f, got[r]), "");
  }
}

// DeepEP's previous_event / async_finish: the input is produced on the caller's stream, the
// buffer waits for it (wait_event), and the caller's stream waits for the outputs (record_event).
TEST(CudaStreams, EventsOrderWorkBetweenTheCallersStreamAndTheBuffers) {
  const BufferConfig cfg = small_config(2048, 256, 32, 8);
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = 2;
  const verify::Problem p = verify::make_problem(spec);
  std::vector<DispatchResult> got(2);
  std::vector<std::string> errors(2);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray&, const DeviceArray& idx) {
    const int64_t tokens = p.inputs[r].tokens, bytes = tokens * 2048 * 2;
    DeviceArray weights(p.inputs[r].weights);
    cudaStream_t user = nullptr;
    cudaEvent_t produced = nullptr, consumed = nullptr;
    cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&produced, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&consumed, cudaEventDisableTiming);
    void* x = nullptr;
    void* pinned = nullptr;
    cudaMalloc(&x, bytes);
    cudaMallocHost(&pinned, bytes);
    std::memcpy(pinned, p.inputs[r].x.data(), bytes);
    std::vector<uint16_t> first_row(2048);
    {
      Buffer b(g, cfg);
      cudaMemsetAsync(x, 0, bytes, user);  // the input arrives on the caller's stream, late
      cudaMemcpyAsync(x, pinned, bytes, cudaMemcpyHostToDevice, user);
      cudaEventRecord(produced, user);
      DispatchInput in;
      in.x = TensorView::of(x, DType::bf16, {tokens, 2048}, DeviceKind::cuda, 0);
      in.topk_idx = device_view(idx, DType::i32, {tokens, 8}, 0);
      if (p.inputs[r].has_weights) in.topk_weights = device_view(weights, DType::f32, {tokens, 8}, 0);
      try {
        b.wait_event(produced);
        DispatchResult d = b.dispatch(in);
        b.record_event(consumed);
        cudaStreamWaitEvent(user, consumed, 0);
        cudaMemcpyAsync(first_row.data(), d.recv_x.data<void>(), 2 * 2048, cudaMemcpyDeviceToHost, user);
        cudaStreamSynchronize(user);
        got[r] = to_host(d);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    }
    cudaFree(x);
    cudaFreeHost(pinned);
    cudaEventDestroy(produced);
    cudaEventDestroy(consumed);
    cudaStreamDestroy(user);
    if (errors[r].empty() && got[r].num_rows > 0 &&
        std::memcmp(first_row.data(), got[r].recv_x.data<uint16_t>(), 2 * 2048) != 0)
      errors[r] = "the caller's stream read recv_x before the buffer wrote it";
  });
  const auto kept = verify::kept_routing(p);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "");
    EXPECT_EQ(verify::check_dispatch(p, kept, r, Layout::expert_major, 0.0f, got[r]), "");
  }
}

// Capacity mode never synchronizes the host, so dispatch -> a stand-in expert (y = recv_x) ->
// combine can be captured in one CUDA graph and replayed with fresh inputs; every replay must
// equal the reference.
// A blocking-mode call cannot be captured (it reads the device on the host): refused before it
// counts, on every rank alike, leaving an empty capture; the buffer's next, uncaptured call works.
TEST(CudaGraphs, BlockingCallsAreRefusedInACapture) {
  const auto p = two_ranks(small_config(256, 32, 16, 4));
  std::vector<std::string> errors(2), after(2);
  std::vector<ErrorCode> codes(2, ErrorCode::internal);
  on_shared_gpu(p, [&](int r, const Group& g, const DeviceArray& x, const DeviceArray& idx) {
    cudaStream_t stream = nullptr;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    {
      Buffer b(g, p.cfg);
      b.set_stream(stream);
      DispatchInput in;
      in.x = device_view(x, DType::bf16, {32, 256}, 0);
      in.topk_idx = device_view(idx, DType::i32, {32, 4}, 0);
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      codes[r] = code_of([&] { b.dispatch(in); }, &errors[r]);
      cudaGraph_t graph = nullptr;
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      try {
        b.dispatch(in);
        b.synchronize();
      } catch (const Error& e) {
        after[r] = e.what();
      }
    }
    cudaStreamDestroy(stream);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], ErrorCode::invalid_argument) << "rank " << r << ": " << errors[r];
    EXPECT_THAT(errors[r], testing::HasSubstr("cannot be captured in a CUDA graph")) << "rank " << r;
    EXPECT_EQ(after[r], "") << "rank " << r;
  }
}

TEST(CudaGraphs, CapacityModeDispatchAndCombineReplayWithFreshInputs) {
  constexpr int kRanks = 2, kReplays = 3;
  constexpr int64_t kTokens = 64, kHidden = 1024, kExperts = 16, kTopk = 4, kLocal = kExperts / kRanks;
  BufferConfig cfg = small_config(kHidden, kTokens, kExperts, kTopk);
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = kRanks * kTokens * kTopk;  // never overflows
  const int64_t cap = cfg.capacity_rows;
  std::vector<verify::Problem> problems;
  for (int i = 0; i < kReplays; ++i) {
    verify::ProblemSpec spec;
    spec.cfg = cfg;
    spec.ranks = kRanks;
    spec.seed = 1000 + static_cast<uint64_t>(i);
    problems.push_back(verify::make_problem(spec));
  }
  // got[replay][rank]: the dispatch outputs and combine output read back after each replay.
  std::vector<std::vector<DispatchResult>> got(kReplays, std::vector<DispatchResult>(kRanks));
  std::vector<std::vector<std::vector<uint16_t>>> ys(kReplays, std::vector<std::vector<uint16_t>>(kRanks));
  std::vector<std::vector<std::vector<uint16_t>>> outs(kReplays, std::vector<std::vector<uint16_t>>(kRanks));
  std::vector<std::string> errors(kRanks);
  const CudaWorld world = CudaWorld::shared_gpu(kRanks, 0);
  std::barrier instantiated(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(0);
      // Everything the graph reads or writes outside the library, allocated before the buffer.
      DeviceArray x(problems[0].inputs[r].x), idx(problems[0].inputs[r].idx), w(problems[0].inputs[r].weights);
      const std::vector<uint16_t> y_rows(cap * kHidden), out_rows(kTokens * kHidden);
      const std::vector<int32_t> src_rows(cap * 2);
      const std::vector<float> weight_rows(cap);
      const std::vector<int64_t> sizes_init(4 + kLocal + (kLocal + 1) + (kRanks + 1));
      DeviceArray y(y_rows), out(out_rows), src(src_rows), weights(weight_rows), info(sizes_init);
      cudaStream_t stream = nullptr;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      cudaGraphExec_t exec = nullptr;
      bool arrived = false;
      try {
        Buffer b(world.group(r), cfg);
        b.set_stream(stream);
        cudaGraph_t graph = nullptr;
        cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
        {
          DispatchInput in;
          in.x = device_view(x, DType::bf16, {kTokens, kHidden}, 0);
          in.topk_idx = device_view(idx, DType::i32, {kTokens, kTopk}, 0);
          in.topk_weights = device_view(w, DType::f32, {kTokens, kTopk}, 0);
          DispatchResult d = b.dispatch(in);
          auto keep = [&](void* to, const Tensor& t, int64_t at_bytes) {
            cudaMemcpyAsync(static_cast<char*>(to) + at_bytes, t.data<void>(), t.numel() * dtype_size(t.dtype()),
                            cudaMemcpyDeviceToDevice, stream);
          };
          keep(y.get(), d.recv_x, 0);  // the expert: y = recv_x
          keep(src.get(), d.recv_src, 0);
          keep(weights.get(), d.recv_weights, 0);
          keep(info.get(), d.recv_info, 0);
          keep(info.get(), d.tokens_per_expert, 4 * 8);
          keep(info.get(), d.expert_offsets, (4 + kLocal) * 8);
          keep(info.get(), d.rank_offsets, (4 + kLocal + kLocal + 1) * 8);
          CombineResult c = b.combine({device_view(y, DType::bf16, {cap, kHidden}, 0), {}}, d.handle, {true});
          keep(out.get(), c.out, 0);
        }  // the outputs go here: their release is part of the graph
        if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
          throw std::runtime_error("capture failed: " + std::string(cudaGetErrorString(cudaGetLastError())));
        cudaGraphDestroy(graph);
        arrived = true;
        instantiated.arrive_and_wait();  // no rank's graph waits for a peer still instantiating
        for (int i = 0; i < kReplays; ++i) {
          const verify::RankInput& in = problems[i].inputs[r];
          cudaMemcpyAsync(x.get(), in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice, stream);
          cudaMemcpyAsync(idx.get(), in.idx.data(), in.idx.size() * 4, cudaMemcpyHostToDevice, stream);
          cudaMemcpyAsync(w.get(), in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice, stream);
          if (cudaGraphLaunch(exec, stream) != cudaSuccess) throw std::runtime_error("graph launch failed");
          cudaStreamSynchronize(stream);
          DispatchResult& h = got[i][r];
          h.recv_x = Tensor::zeros_host(DType::bf16, {cap, kHidden});
          h.recv_src = Tensor::zeros_host(DType::i32, {cap, 2});
          h.recv_weights = Tensor::zeros_host(DType::f32, {cap});
          std::vector<int64_t> sizes(4 + kLocal + kLocal + 1 + kRanks + 1);
          outs[i][r].resize(kTokens * kHidden);
          // Read back on the rank's own stream (no legacy-stream copy while the peer may be in a call).
          cudaMemcpyAsync(h.recv_x.data<void>(), y.get(), cap * kHidden * 2, cudaMemcpyDeviceToHost, stream);
          cudaMemcpyAsync(h.recv_src.data<void>(), src.get(), cap * 8, cudaMemcpyDeviceToHost, stream);
          cudaMemcpyAsync(h.recv_weights.data<void>(), weights.get(), cap * 4, cudaMemcpyDeviceToHost, stream);
          cudaMemcpyAsync(sizes.data(), info.get(), sizes.size() * 8, cudaMemcpyDeviceToHost, stream);
          cudaMemcpyAsync(outs[i][r].data(), out.get(), outs[i][r].size() * 2, cudaMemcpyDeviceToHost, stream);
          cudaStreamSynchronize(stream);
          auto host_i64 = [](const int64_t* from, int64_t n) {
            Tensor t = Tensor::zeros_host(DType::i64, {n});
            std::copy(from, from + n, t.data<int64_t>());
            return t;
          };
          h.num_rows = sizes[1];
          h.overflow = sizes[3] != 0;
          h.tokens_per_expert = host_i64(sizes.data() + 4, kLocal);
          h.expert_offsets = host_i64(sizes.data() + 4 + kLocal, kLocal + 1);
          h.rank_offsets = host_i64(sizes.data() + 4 + kLocal + kLocal + 1, kRanks + 1);
          ys[i][r].assign(h.recv_x.data<uint16_t>(), h.recv_x.data<uint16_t>() + cap * kHidden);
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (!arrived) instantiated.arrive_and_drop();  // the peer must not wait for us
      }
      if (exec) cudaGraphExecDestroy(exec);
      cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int i = 0; i < kReplays; ++i) {
    const auto kept = verify::kept_routing(problems[i]);
    std::vector<verify::Expected> layouts;
    for (int r = 0; r < kRanks; ++r) layouts.push_back(verify::expected_dispatch(problems[i], kept, r, Layout::expert_major));
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(verify::check_dispatch(problems[i], kept, r, Layout::expert_major, 0.0f, got[i][r]), "") << "replay " << i;
      const auto want = verify::expected_combine(problems[i], kept, layouts, ys[i], r, Layout::expert_major, true, nullptr);
      EXPECT_EQ(verify::compare_bits(outs[i][r].data(), want.data(), static_cast<int64_t>(want.size()), 2,
                                     "replay " + std::to_string(i) + " rank " + std::to_string(r) + " combine out"),
                "");
    }
  }
}

}  // namespace
}  // namespace epx::test
