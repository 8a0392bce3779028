// Redundant experts (EPLB) on the CUDA high-throughput buffer: every output of every operation
// equals the CPU reference of the plain problem of P experts in the replica rule's routing, bit
// for bit, and topk_physical is the rule's choice (verify/replicas.hpp, written apart from the
// kernels); a bad table fails every rank with the CPU backend's words, and tables that differ
// between ranks fail every rank with config_mismatch; the next call works.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_harness.hpp"
#include "verify/replicas.hpp"

namespace epx::test {
namespace {

struct EplbCase {
  Transport transport;
  int ranks;
  int64_t hidden, tokens, experts, physical, width, topk;  // width 0: P - E + 1
  WireFormat wire;
  Layout layout;
  verify::Routing routing;
  double capacity_factor = 0.0;
  CapacityMode mode = CapacityMode::blocking;
};

std::string eplb_case_name(const testing::TestParamInfo<EplbCase>& info) {
  const EplbCase& c = info.param;
  return std::string(c.transport == Transport::nccl ? "nccl" : "shared") + "_R" + std::to_string(c.ranks) + "_E" +
         std::to_string(c.experts) + "_P" + std::to_string(c.physical) + "_W" + std::to_string(c.width) + "_" +
         std::string(wire_name(c.wire)) + "_" + std::string(layout_name(c.layout)) +
         (c.routing == verify::Routing::skewed ? "_skewed" : "") + (c.capacity_factor > 0 ? "_drop" : "") +
         (c.mode == CapacityMode::capacity ? "_capacity" : "");
}

void PrintTo(const EplbCase& c, std::ostream* os) { *os << eplb_case_name(testing::TestParamInfo<EplbCase>(c, 0)); }

verify::Problem eplb_problem(const EplbCase& c) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire, c.layout == Layout::expert_major ? 8 : 1);
  spec.cfg.capacity_factor = c.capacity_factor;
  spec.cfg.mode = c.mode;
  if (c.mode == CapacityMode::capacity)  // half the rows a rank may receive: overflows
    spec.cfg.capacity_rows = (c.layout == Layout::rank_major ? c.tokens * c.ranks : c.tokens * c.topk) / 2;
  spec.cfg.num_sms = c.transport == Transport::nccl ? 16 : 4;
  spec.ranks = c.ranks;
  for (int r = 0; r < c.ranks; ++r) spec.tokens.push_back(c.tokens - (7 * r) % (c.tokens + 1));
  spec.routing = c.routing;
  spec.unused_slot_fraction = 0.1;
  spec.seed = static_cast<uint64_t>(c.ranks * 131 + c.physical);
  verify::Problem p = verify::make_problem(spec);
  const int64_t width = c.width > 0 ? c.width : c.physical - c.experts + 1;
  p.cfg.num_physical_experts = c.physical;
  p.cfg.max_replicas = c.width;
  p.replicas = verify::random_replicas(c.experts, c.physical, width, 11 + c.physical);
  return p;
}

class CudaEplb : public testing::TestWithParam<EplbCase> {};

TEST_P(CudaEplb, EqualsThePlainProblemOfThePhysicalRouting) {
  const EplbCase& c = GetParam();
  if (c.transport == Transport::nccl && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  const verify::Problem p = eplb_problem(c);
  const verify::Problem plain = verify::physical_problem(p);
  RunOptions o;
  o.dispatch.layout = c.layout;
  const auto runs = run_problem_cuda(world_of(c.transport, c.ranks), p, o);
  expect_matches_reference(plain, o, runs);
  for (int r = 0; r < c.ranks; ++r) {
    const Tensor& chosen = runs[r].dispatched.topk_physical;
    ASSERT_TRUE(chosen.defined()) << "rank " << r;
    ASSERT_EQ(chosen.numel(), static_cast<int64_t>(plain.inputs[r].idx.size())) << "rank " << r;
    EXPECT_TRUE(std::equal(plain.inputs[r].idx.begin(), plain.inputs[r].idx.end(), chosen.data<int32_t>()))
        << "topk_physical, rank " << r;
    EXPECT_EQ(runs[r].dispatched.tokens_per_expert.numel(), c.physical / c.ranks) << "rank " << r;
  }
}

using namespace case_names;

INSTANTIATE_TEST_SUITE_P(
    Tables, CudaEplb,
    testing::Values(EplbCase{N, 1, 1024, 200, 32, 48, 0, 8, W::bf16, L::expert_major, U},
                    EplbCase{N, 1, 1024, 130, 32, 40, 3, 6, W::fp8, L::rank_major, K},
                    EplbCase{S, 2, 512, 96, 30, 64, 4, 8, W::bf16, L::expert_major, K, 0.6},
                    EplbCase{S, 2, 512, 96, 16, 32, 0, 4, W::bf16, L::rank_major, U, 0.0, CapacityMode::capacity},
                    EplbCase{S, 4, 768, 64, 30, 32, 0, 8, W::nvfp4, L::expert_major, U},
                    EplbCase{S, 3, 256, 50, 10, 12, 2, 3, W::fp8_ue8m0, L::rank_major, K}),
    eplb_case_name);

// Two ranks on GPU 0: rank 1's dispatch gets `bad` as its table (rank 0 the good one), then both
// dispatch once more with the good table. Returns each rank's error of the first call and of the
// second.
struct TwoCalls {
  std::vector<std::string> first{2}, second{2};
  std::vector<ErrorCode> codes{2, ErrorCode::internal};
};

TwoCalls dispatch_with_table_on_rank_1(const std::vector<int32_t>& good, const std::vector<int32_t>& bad) {
  BufferConfig cfg = small_config(256, 32, 5, 2);
  cfg.num_physical_experts = 10;
  cfg.max_replicas = 2;
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.cfg.num_physical_experts = 0;
  spec.cfg.max_replicas = 0;
  spec.ranks = 2;
  const verify::Problem p = verify::make_problem(spec);
  TwoCalls out;
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  const std::vector<std::string> errors = verify::run_threads(2, [&](int r) {
    cudaSetDevice(0);
    DeviceArray x(p.inputs[r].x), idx(p.inputs[r].idx), good_table(good), bad_table(bad);
    Buffer b(world.group(r), cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 2}, 0);
    in.expert_replicas = device_view(r == 1 ? bad_table : good_table, DType::i32, {5, 2}, 0);
    out.codes[r] = code_of([&] { b.dispatch(in); }, &out.first[r]);
    in.expert_replicas = device_view(good_table, DType::i32, {5, 2}, 0);
    try {
      b.dispatch(in);  // the buffer still works
    } catch (const Error& e) {
      out.second[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return out;
}

// The CPU backend's table checks (tests/eplb_test.cpp), found on the device.
TEST(CudaEplbErrors, ABadTableFailsEveryRankNamingTheEntry) {
  const std::vector<int32_t> good = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1};
  const std::pair<std::vector<int32_t>, const char*> bad[] = {
      {{0, 5, 1, -1, -1, -1, 3, -1, 4, -1}, "dispatch: expert_replicas[2] has no entry (all 2 are -1)"},
      {{0, 5, 1, -1, 2, -1, 3, 10, 4, -1}, "dispatch: expert_replicas[3][1] = 10 is out of range"},
      {{0, 5, 1, -1, 2, -2, 3, -1, 4, -1}, "dispatch: expert_replicas[2][1] = -2 is out of range"},
      {{0, 5, 1, -1, 2, -1, 3, 1, 4, 1}, "dispatch: expert_replicas[3][1] = 1 repeats expert_replicas[1][0]"},
      {{0, 5, 1, -1, -1, 9, 3, 12, -1, -1}, "dispatch: expert_replicas[3][1] = 12 is out of range"},
  };
  for (const auto& [table, words] : bad) {
    const TwoCalls got = dispatch_with_table_on_rank_1(good, table);
    EXPECT_EQ(got.codes[1], ErrorCode::invalid_argument) << words << ": " << got.first[1];
    EXPECT_THAT(got.first[1], testing::HasSubstr(words));
    EXPECT_EQ(got.codes[0], ErrorCode::peer_failed) << words << ": " << got.first[0];
    EXPECT_THAT(got.first[0], testing::HasSubstr(std::string("rank 1 rejected its input, so the group stops: ") + words));
    EXPECT_EQ(got.second[0], "") << words;
    EXPECT_EQ(got.second[1], "") << words;
  }
}

// A table with rows further apart than W (a slice of a wider tensor) routes as its contiguous copy.
TEST(CudaEplb, AStridedTableRoutesAsItsContiguousCopy) {
  const std::vector<int32_t> table = {0, 5, 1, -1, 2, -1, 3, 6, 4, -1};
  std::vector<int32_t> wide(5 * 4, 99);  // the columns past W: out of range, never read
  for (int e = 0; e < 5; ++e)
    for (int j = 0; j < 2; ++j) wide[e * 4 + j] = table[e * 2 + j];
  BufferConfig cfg = small_config(256, 32, 5, 2);
  cfg.num_physical_experts = 10;
  cfg.max_replicas = 2;
  verify::ProblemSpec spec;
  spec.cfg = small_config(256, 32, 5, 2);
  spec.ranks = 2;
  const verify::Problem p = verify::make_problem(spec);
  std::vector<Tensor> contiguous(2), strided(2);
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  const std::vector<std::string> errors = verify::run_threads(2, [&](int r) {
    cudaSetDevice(0);
    DeviceArray x(p.inputs[r].x), idx(p.inputs[r].idx), packed(table), sliced(wide);
    Buffer b(world.group(r), cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {32, 256}, 0);
    in.topk_idx = device_view(idx, DType::i32, {32, 2}, 0);
    in.expert_replicas = device_view(packed, DType::i32, {5, 2}, 0);
    contiguous[r] = epx::to_host(b.dispatch(in).topk_physical);
    in.expert_replicas = device_view(sliced, DType::i32, {5, 2}, 0);
    in.expert_replicas.strides[0] = 4;
    strided[r] = epx::to_host(b.dispatch(in).topk_physical);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    ASSERT_EQ(strided[r].numel(), contiguous[r].numel()) << "rank " << r;
    EXPECT_TRUE(std::equal(contiguous[r].data<int32_t>(), contiguous[r].data<int32_t>() + contiguous[r].numel(),
                           strided[r].data<int32_t>()))
        << "rank " << r;
  }
}

TEST(CudaEplbErrors, TablesThatDifferBetweenRanksFailEveryRank) {
  const std::vector<int32_t> good = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1};
  const std::vector<int32_t> other = {5, 0, 1, -1, 2, -1, 3, -1, 4, -1};  // valid, in another order
  const TwoCalls got = dispatch_with_table_on_rank_1(good, other);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got.codes[r], ErrorCode::config_mismatch) << "rank " << r << ": " << got.first[r];
    EXPECT_THAT(got.first[r], testing::HasSubstr("passes another expert_replicas table")) << "rank " << r;
    EXPECT_EQ(got.second[r], "") << "rank " << r;
  }
}

// routing_map + probs with EPLB: the map becomes top-k slots (experts ascending), then each slot
// its replica, as on the CPU backend: the dispatch equals the plain problem of P experts in the
// sorted form's routing by the rule.
TEST(CudaEplb, ADenseRoutingMapRoutesAsItsTopkForm) {
  constexpr int64_t kHidden = 512, kTokens = 64, kExperts = 16, kPhysical = 24, kWidth = 3, kTopk = 4;
  verify::ProblemSpec spec;
  spec.cfg = small_config(kHidden, kTokens, kExperts, kTopk);
  spec.ranks = 2;
  spec.unused_slot_fraction = 0.25;
  const verify::Problem p = verify::make_problem(spec);
  const verify::DenseRouting dense = verify::dense_routing(p);
  verify::Problem sorted = dense.sorted;
  sorted.cfg.num_physical_experts = kPhysical;
  sorted.cfg.max_replicas = kWidth;
  sorted.replicas = verify::random_replicas(kExperts, kPhysical, kWidth, 5);
  const verify::Problem plain = verify::physical_problem(sorted);
  std::vector<DispatchResult> got(2);
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  const std::vector<std::string> errors = verify::run_threads(2, [&](int r) {
    cudaSetDevice(0);
    const int64_t tokens = p.inputs[r].tokens;
    DeviceArray x(p.inputs[r].x), map(dense.maps[r]), prob(dense.probs[r]), table(sorted.replicas);
    Buffer b(world.group(r), sorted.cfg);
    DispatchInput in;
    in.x = device_view(x, DType::bf16, {tokens, kHidden}, 0);
    in.routing_map = device_view(map, DType::boolean, {tokens, kExperts}, 0);
    in.probs = device_view(prob, DType::f32, {tokens, kExperts}, 0);
    in.expert_replicas = device_view(table, DType::i32, {kExperts, kWidth}, 0);
    DispatchResult d = b.dispatch(in);
    b.synchronize();
    got[r] = to_host(d);
  });
  const auto kept = verify::kept_routing(plain);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(verify::check_dispatch(plain, kept, r, Layout::expert_major, 0.0f, got[r]), "") << "rank " << r;
    const Tensor& chosen = got[r].topk_physical;
    ASSERT_EQ(chosen.numel(), static_cast<int64_t>(plain.inputs[r].idx.size())) << "rank " << r;
    EXPECT_TRUE(std::equal(plain.inputs[r].idx.begin(), plain.inputs[r].idx.end(), chosen.data<int32_t>()))
        << "topk_physical, rank " << r;
  }
}

// The table is read at every call, also in a CUDA graph: a capacity-mode dispatch captured once
// at EP1 and replayed with the table rewritten in place between replays routes each replay by
// the table it finds (topk_physical and tokens_per_expert, kept by copies inside the graph).
TEST(CudaEplbGraphs, AReplayRoutesByTheTableItFinds) {
  constexpr int64_t kTokens = 48, kHidden = 256, kExperts = 8, kPhysical = 16, kWidth = 3, kTopk = 4;
  BufferConfig cfg = small_config(kHidden, kTokens, kExperts, kTopk);
  cfg.mode = CapacityMode::capacity;
  cfg.capacity_rows = kTokens * kTopk;  // never overflows
  cfg.num_physical_experts = kPhysical;
  cfg.max_replicas = kWidth;
  verify::ProblemSpec spec;
  spec.cfg = small_config(kHidden, kTokens, kExperts, kTopk);
  spec.ranks = 1;
  const verify::Problem p = verify::make_problem(spec);
  std::vector<std::vector<int32_t>> tables;
  for (uint64_t i = 0; i < 3; ++i) tables.push_back(verify::random_replicas(kExperts, kPhysical, kWidth, 40 + i));
  DeviceArray x(p.inputs[0].x), idx(p.inputs[0].idx), table(tables[0]);
  DeviceArray chosen_copy{std::vector<int32_t>(kTokens * kTopk)}, counts_copy{std::vector<int64_t>(kPhysical)};
  cudaStream_t stream = nullptr;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  std::vector<std::vector<int32_t>> chosen(tables.size(), std::vector<int32_t>(kTokens * kTopk));
  std::vector<std::vector<int64_t>> counts(tables.size(), std::vector<int64_t>(kPhysical));
  {
    const CudaWorld world(std::vector<int>{0});
    Buffer b(world.group(0), cfg);
    b.set_stream(stream);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    {
      DispatchInput in;
      in.x = device_view(x, DType::bf16, {kTokens, kHidden}, 0);
      in.topk_idx = device_view(idx, DType::i32, {kTokens, kTopk}, 0);
      in.expert_replicas = device_view(table, DType::i32, {kExperts, kWidth}, 0);
      DispatchResult d = b.dispatch(in);
      cudaMemcpyAsync(chosen_copy.get(), d.topk_physical.data<void>(), kTokens * kTopk * 4, cudaMemcpyDeviceToDevice, stream);
      cudaMemcpyAsync(counts_copy.get(), d.tokens_per_expert.data<void>(), kPhysical * 8, cudaMemcpyDeviceToDevice, stream);
    }
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
    for (size_t i = 0; i < tables.size(); ++i) {
      cudaMemcpyAsync(table.get(), tables[i].data(), tables[i].size() * 4, cudaMemcpyHostToDevice, stream);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      cudaMemcpyAsync(chosen[i].data(), chosen_copy.get(), kTokens * kTopk * 4, cudaMemcpyDeviceToHost, stream);
      cudaMemcpyAsync(counts[i].data(), counts_copy.get(), kPhysical * 8, cudaMemcpyDeviceToHost, stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
    cudaGraphExecDestroy(exec);
    b.synchronize();
  }
  cudaStreamDestroy(stream);
  for (size_t i = 0; i < tables.size(); ++i) {
    std::vector<int64_t> want_counts(kPhysical, 0);
    for (int64_t s = 0; s < kTokens * kTopk; ++s) {
      const int32_t want = verify::chosen_replica(tables[i], kWidth, kPhysical, p.inputs[0].idx[s], 0, s / kTopk);
      ASSERT_EQ(chosen[i][s], want) << "replay " << i << " slot " << s;
      if (want >= 0) ++want_counts[want];
    }
    EXPECT_EQ(counts[i], want_counts) << "replay " << i;
  }
  EXPECT_NE(chosen[0], chosen[1]) << "the tables route alike: the test shows nothing";
}

}  // namespace
}  // namespace epx::test
