// Low-latency mode on the CUDA backend against the reference (the same checks as the CPU
// backend's tests): rounds with changing token counts read on the device, every wire format,
// EP1/EP2 over NCCL and EP4/EP8 on the shared-GPU transport, a CUDA graph replayed with fresh
// inputs, and the errors only the device sees (a bad id, a peer that never comes).
#include <cuda_runtime.h>

#include <gmock/gmock.h>

#include <barrier>
#include <cstring>
#include <functional>
#include <thread>

#include "cuda_harness.hpp"
#include "verify/replicas.hpp"

namespace epx::test {
namespace {

struct LlGpuCase {
  bool shared;  // the shared-GPU transport, else NCCL (one GPU per rank)
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
  WireFormat combine_wire = WireFormat::bf16;  // what ll_combine's partials cross back in
  int64_t physical = 0, width = 0;             // EPLB: P physical experts (0: off), W table columns (0: P - E + 1)
  bool shared_expert = false;                  // LowLatencyConfig::shared_expert (the reference's too)
};

int64_t table_width(const LlGpuCase& c) { return c.physical == 0 ? 0 : c.width > 0 ? c.width : c.physical - c.experts + 1; }

std::string ll_case_name(const testing::TestParamInfo<LlGpuCase>& info) {
  const LlGpuCase& c = info.param;
  return std::string(c.shared ? "shared" : "nccl") + "_R" + std::to_string(c.ranks) + "_H" + std::to_string(c.hidden) +
         "_T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_K" + std::to_string(c.topk) + "_" +
         std::string(wire_name(c.wire)) +
         (c.combine_wire == WireFormat::bf16 ? "" : "_combine_" + std::string(wire_name(c.combine_wire))) +
         (c.physical > 0 ? "_P" + std::to_string(c.physical) + "_W" + std::to_string(c.width) : "");
}

LowLatencyConfig ll_config(const LlGpuCase& c) {
  LowLatencyConfig cfg{c.hidden, c.tokens, c.experts, c.topk, c.wire, 20000};
  cfg.combine_wire = c.combine_wire;
  cfg.num_physical_experts = c.physical;
  cfg.max_replicas = c.width;
  cfg.shared_expert = c.shared_expert;
  return cfg;
}

// EPLB: the table of one round (each round its own: a rebalance between calls).
std::vector<int32_t> ll_table(const LlGpuCase& c, uint64_t seed) {
  const int64_t width = c.width > 0 ? c.width : c.physical - c.experts + 1;
  return c.physical > 0 ? verify::random_replicas(c.experts, c.physical, width, seed) : std::vector<int32_t>{};
}

verify::Problem ll_problem(const LlGpuCase& c, uint64_t seed) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire);
  spec.cfg.combine_wire = c.combine_wire;  // the reference's partials cross back in it
  spec.cfg.shared_expert = c.shared_expert;
  spec.ranks = c.ranks;
  spec.seed = seed;
  spec.unused_slot_fraction = 0.1;
  return verify::make_problem(spec);
}

CudaWorld ll_world(const LlGpuCase& c) { return world_of(c.shared ? Transport::shared_gpu : Transport::nccl, c.ranks); }

// A dispatch result's tensors, copied to the host (after the buffer's stream is synchronized).
LowLatencyDispatchResult host_copy(const LowLatencyDispatchResult& d) {
  LowLatencyDispatchResult h;
  for (auto [to, from] : {std::pair{&h.recv_x, &d.recv_x}, std::pair{&h.recv_scales, &d.recv_scales},
                          std::pair{&h.recv_global_scale, &d.recv_global_scale}, std::pair{&h.recv_count, &d.recv_count},
                          std::pair{&h.recv_src, &d.recv_src}, std::pair{&h.recv_layout, &d.recv_layout},
                          std::pair{&h.topk_physical, &d.topk_physical}})
    *to = epx::to_host(*from);
  return h;
}

// One round's device inputs of one rank, made before the buffer (allocations may synchronize).
struct RoundInputs {
  DeviceArray x, idx, weights, count, y, table;
};

class CudaLowLatency : public testing::TestWithParam<LlGpuCase> {};

// Four rounds on one buffer (sets alternate), each with its own token counts and data; dispatch
// and combine in split form. The combine's weights go with ll_dispatch on half the (round, rank)
// pairs, with ll_combine on the others, so the ranks of one call mix the two. EPLB: each round
// its own replica table, the results those of the plain problem of P experts in the rule's
// routing, and topk_physical the rule's choice.
TEST_P(CudaLowLatency, RoundsMatchTheReference) {
  const LlGpuCase& c = GetParam();
  if (!c.shared && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  const int rounds = 4;
  const int64_t slots = c.ranks * c.tokens, l_count = (c.physical > 0 ? c.physical : c.experts) / c.ranks;
  std::vector<verify::Problem> problems, references;
  std::vector<std::vector<int64_t>> counts(rounds, std::vector<int64_t>(c.ranks));
  std::vector<std::vector<std::vector<uint16_t>>> ys(rounds, std::vector<std::vector<uint16_t>>(c.ranks));
  for (int i = 0; i < rounds; ++i) {
    problems.push_back(ll_problem(c, 50 + i));
    if (c.physical > 0) {
      problems.back().cfg.num_physical_experts = c.physical;
      problems.back().cfg.max_replicas = c.width;
      problems.back().replicas = ll_table(c, 11 + i);
    }
    references.push_back(c.physical > 0 ? verify::physical_problem(problems.back()) : problems.back());
    for (int r = 0; r < c.ranks; ++r) {
      counts[i][r] = (c.tokens * (i + r + 1)) / (rounds + c.ranks) % (c.tokens + 1);
      ys[i][r] = verify::random_bf16(l_count * slots * c.hidden, 700 + 10 * i + r);
    }
  }
  std::vector<std::vector<LowLatencyDispatchResult>> got(rounds, std::vector<LowLatencyDispatchResult>(c.ranks));
  std::vector<std::vector<Tensor>> outs(rounds, std::vector<Tensor>(c.ranks));
  const CudaWorld world = ll_world(c);
  const std::vector<std::string> errors = verify::run_threads(c.ranks, [&](int r) {
    const Group g = world.group(r);
    const int dev = cuda_device(g);
    cudaSetDevice(dev);
    std::vector<RoundInputs> in(rounds);
    for (int i = 0; i < rounds; ++i) {
      const verify::RankInput& p = problems[i].inputs[r];
      in[i].x = DeviceArray(p.x);
      in[i].idx = DeviceArray(p.idx);
      in[i].weights = DeviceArray(p.weights);
      in[i].count = DeviceArray(std::vector<int32_t>{static_cast<int32_t>(counts[i][r])});
      in[i].y = DeviceArray(ys[i][r]);
      in[i].table = DeviceArray(problems[i].replicas);
    }
    LowLatencyBuffer b(g, ll_config(c));
    for (int i = 0; i < rounds; ++i) {
      LowLatencyDispatchInput d;
      d.x = device_view(in[i].x, DType::bf16, {c.tokens, c.hidden}, dev);
      d.topk_idx = device_view(in[i].idx, DType::i32, {c.tokens, c.topk}, dev);
      d.num_tokens = device_view(in[i].count, DType::i32, {1}, dev);
      if (c.physical > 0) d.expert_replicas = device_view(in[i].table, DType::i32, {c.experts, table_width(c)}, dev);
      const bool weights_at_dispatch = (i + r) % 2 == 1;
      const TensorView weights = device_view(in[i].weights, DType::f32, {c.tokens, c.topk}, dev);
      if (weights_at_dispatch) d.topk_weights = weights;
      b.dispatch_send(d);
      LowLatencyDispatchResult res = b.dispatch_recv();
      // On one GPU no rank queues a kernel behind its own waiting one (docs/cuda.md, hold-back).
      if (c.shared) b.synchronize();
      LowLatencyCombineInput ci;
      ci.y = device_view(in[i].y, DType::bf16, {l_count, slots, c.hidden}, dev);
      if (!weights_at_dispatch) ci.topk_weights = weights;
      b.combine_send(ci, res.handle);
      Tensor out = b.combine_recv();
      b.synchronize();
      got[i][r] = host_copy(res);  // before the set comes round again
      outs[i][r] = epx::to_host(out);
    }
  });
  std::string failed;  // every rank's error: the late rank's own message tells why it was late
  for (int r = 0; r < c.ranks; ++r)
    if (!errors[r].empty()) failed += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  ASSERT_EQ(failed, "");
  expect_ll_rounds_match(references, counts, ys, got, outs);
  if (c.physical == 0) return;
  for (int i = 0; i < rounds; ++i)
    for (int r = 0; r < c.ranks; ++r) {
      const Tensor& chosen = got[i][r].topk_physical;
      ASSERT_EQ(chosen.numel(), c.tokens * c.topk) << "round " << i << " rank " << r;
      for (int64_t s = 0; s < chosen.numel(); ++s) {  // the rule's choice; -1 at or past num_tokens
        const int32_t want = s / c.topk < counts[i][r] ? references[i].inputs[r].idx[s] : -1;
        ASSERT_EQ(chosen.data<int32_t>()[s], want) << "round " << i << " rank " << r << " slot " << s;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLowLatency,
                         testing::Values(LlGpuCase{false, 1, 256, 16, 8, 4, WireFormat::bf16},
                                         LlGpuCase{false, 2, 7168, 128, 288, 8, WireFormat::fp8},
                                         LlGpuCase{false, 2, 2048, 64, 32, 8, WireFormat::bf16},
                                         LlGpuCase{false, 2, 1024, 48, 16, 6, WireFormat::fp8_ue8m0},
                                         LlGpuCase{false, 2, 1024, 32, 16, 4, WireFormat::nvfp4},
                                         LlGpuCase{true, 4, 512, 24, 36, 8, WireFormat::fp8},
                                         LlGpuCase{true, 8, 256, 16, 72, 8, WireFormat::bf16},
                                         LlGpuCase{false, 1, 7168, 128, 288, 8, WireFormat::fp8, WireFormat::fp8},
                                         LlGpuCase{true, 2, 1024, 32, 16, 4, WireFormat::bf16, WireFormat::fp8_ue8m0},
                                         LlGpuCase{true, 4, 2176, 24, 36, 8, WireFormat::nvfp4, WireFormat::fp8},
                                         // EPLB
                                         LlGpuCase{false, 1, 1024, 32, 24, 8, WireFormat::fp8, WireFormat::bf16, 40, 0},
                                         LlGpuCase{true, 2, 512, 24, 30, 6, WireFormat::bf16, WireFormat::bf16, 36, 3},
                                         LlGpuCase{true, 4, 768, 16, 30, 8, WireFormat::nvfp4, WireFormat::fp8, 32, 0}),
                         ll_case_name);

// The fused shared expert (LowLatencyConfig::shared_expert) against the CPU backend, bit for bit:
// four rounds on one buffer with changing token counts (segment 0's rows past the count cleared
// as the routed ones), a gate on half the (round, rank) dispatches, weights at dispatch or at
// combine, and one unweighted round (without gates: a gate needs a weighted combine).
struct SharedLlCase {
  bool shared;  // the shared-GPU transport, else NCCL
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire, combine_wire;
};

std::string shared_ll_name(const testing::TestParamInfo<SharedLlCase>& info) {
  const SharedLlCase& c = info.param;
  return ll_case_name(testing::TestParamInfo<LlGpuCase>(
      LlGpuCase{c.shared, c.ranks, c.hidden, c.tokens, c.experts, c.topk, c.wire, c.combine_wire}, 0));
}

class CudaLowLatencySharedExpert : public testing::TestWithParam<SharedLlCase> {};

// One rank's results of a round, on the host.
struct SharedRound {
  LowLatencyDispatchResult d;
  Tensor out;
};

// Every output tensor of both runs, byte for byte.
void expect_same_round(const SharedRound& cpu, const SharedRound& gpu, int round, int rank) {
  const std::pair<const Tensor*, const Tensor*> pairs[] = {
      {&cpu.d.recv_x, &gpu.d.recv_x},          {&cpu.d.recv_scales, &gpu.d.recv_scales},
      {&cpu.d.recv_global_scale, &gpu.d.recv_global_scale}, {&cpu.d.recv_count, &gpu.d.recv_count},
      {&cpu.d.recv_src, &gpu.d.recv_src},      {&cpu.d.recv_layout, &gpu.d.recv_layout},
      {&cpu.out, &gpu.out}};
  const char* names[] = {"recv_x", "recv_scales", "recv_global_scale", "recv_count", "recv_src", "recv_layout", "out"};
  for (size_t i = 0; i < std::size(pairs); ++i) {
    const Tensor &a = *pairs[i].first, &b = *pairs[i].second;
    ASSERT_EQ(a.defined(), b.defined()) << names[i] << " round " << round << " rank " << rank;
    if (!a.defined()) continue;
    ASSERT_EQ(a.view().shape, b.view().shape) << names[i] << " round " << round << " rank " << rank;
    const size_t bytes = static_cast<size_t>(a.numel()) * dtype_size(a.dtype());
    EXPECT_EQ(std::memcmp(a.data<char>(), b.data<char>(), bytes), 0) << names[i] << " round " << round << " rank " << rank;
  }
}

TEST_P(CudaLowLatencySharedExpert, MatchesTheCpuBackend) {
  const SharedLlCase& c = GetParam();
  if (!c.shared && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  const LlGpuCase lc{c.shared, c.ranks, c.hidden, c.tokens, c.experts, c.topk, c.wire, c.combine_wire};
  LowLatencyConfig cfg = ll_config(lc);
  cfg.shared_expert = true;
  const int rounds = 4;
  const int64_t slots = c.ranks * c.tokens, segments = 1 + c.experts / c.ranks;
  std::vector<verify::Problem> problems;
  std::vector<std::vector<int32_t>> counts(rounds, std::vector<int32_t>(c.ranks));
  std::vector<std::vector<std::vector<uint16_t>>> ys(rounds, std::vector<std::vector<uint16_t>>(c.ranks));
  std::vector<std::vector<std::vector<float>>> gates(rounds, std::vector<std::vector<float>>(c.ranks));
  for (int i = 0; i < rounds; ++i) {
    problems.push_back(ll_problem(lc, 60 + i));
    for (int r = 0; r < c.ranks; ++r) {
      // Falling from round to round, so each set's next dispatch clears rows (segment 0's too).
      counts[i][r] = static_cast<int32_t>(c.tokens - c.tokens * (i + r) / (rounds + c.ranks));
      ys[i][r] = verify::random_bf16(segments * slots * c.hidden, 800 + 10 * i + r);
      for (int64_t t = 0; t < c.tokens; ++t) gates[i][r].push_back(0.125f * static_cast<float>((t * 7 + i + r) % 17) - 1.0f);
    }
  }
  auto weighted = [](int i) { return i != 2; };
  auto with_gate = [&](int i, int r) { return weighted(i) && (i + r) % 2 == 0; };
  auto weights_at_dispatch = [](int i, int r) { return (i * 3 + r) % 2 == 1; };
  // The same calls on either backend: views made by `view` (host or device arrays).
  auto run = [&](LowLatencyBuffer& b, int r, int i, const std::function<TensorView(int what, DType, std::initializer_list<int64_t>)>& view,
                 bool device) {
    LowLatencyDispatchInput d;
    d.x = view(0, DType::bf16, {c.tokens, c.hidden});
    d.topk_idx = view(1, DType::i32, {c.tokens, c.topk});
    d.num_tokens = view(3, DType::i32, {1});
    const TensorView weights = view(2, DType::f32, {c.tokens, c.topk});
    if (weighted(i) && weights_at_dispatch(i, r)) d.topk_weights = weights;
    if (with_gate(i, r)) d.shared_gate = view(5, DType::f32, {c.tokens});
    b.dispatch_send(d);
    LowLatencyDispatchResult res = b.dispatch_recv();
    if (device && c.shared) b.synchronize();  // docs/cuda.md, hold-back
    LowLatencyCombineInput ci;
    ci.y = view(4, DType::bf16, {segments, slots, c.hidden});
    ci.weighted = weighted(i);
    if (weighted(i) && !weights_at_dispatch(i, r)) ci.topk_weights = weights;
    b.combine_send(ci, res.handle);
    Tensor out = b.combine_recv();
    b.synchronize();
    return SharedRound{device ? host_copy(res) : res, epx::to_host(out)};
  };
  std::vector<std::vector<SharedRound>> cpu(rounds, std::vector<SharedRound>(c.ranks)), gpu = cpu;
  std::vector<std::string> errors = verify::run_ranks(c.ranks, [&](const Group& g) {
    const int r = g.rank();
    LowLatencyBuffer b(g, cfg);
    for (int i = 0; i < rounds; ++i) {
      verify::RankInput& p = problems[i].inputs[r];
      auto view = [&](int what, DType t, std::initializer_list<int64_t> shape) -> TensorView {
        void* data[] = {p.x.data(), p.idx.data(), p.weights.data(), &counts[i][r], ys[i][r].data(), gates[i][r].data()};
        return TensorView::of(data[what], t, shape);
      };
      cpu[i][r] = run(b, r, i, view, false);
    }
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  const CudaWorld world = ll_world(lc);
  errors = verify::run_threads(c.ranks, [&](int r) {
    const Group g = world.group(r);
    const int dev = cuda_device(g);
    cudaSetDevice(dev);
    std::vector<std::vector<DeviceArray>> in(rounds);
    for (int i = 0; i < rounds; ++i) {
      const verify::RankInput& p = problems[i].inputs[r];
      in[i].emplace_back(p.x);
      in[i].emplace_back(p.idx);
      in[i].emplace_back(p.weights);
      in[i].emplace_back(std::vector<int32_t>{counts[i][r]});
      in[i].emplace_back(ys[i][r]);
      in[i].emplace_back(gates[i][r]);
    }
    LowLatencyBuffer b(g, cfg);
    for (int i = 0; i < rounds; ++i) {
      auto view = [&](int what, DType t, std::initializer_list<int64_t> shape) {
        return device_view(in[i][what], t, shape, dev);
      };
      gpu[i][r] = run(b, r, i, view, true);
    }
  });
  std::string failed;
  for (int r = 0; r < c.ranks; ++r)
    if (!errors[r].empty()) failed += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  ASSERT_EQ(failed, "");
  for (int i = 0; i < rounds; ++i)
    for (int r = 0; r < c.ranks; ++r) expect_same_round(cpu[i][r], gpu[i][r], i, r);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLowLatencySharedExpert,
                         testing::Values(SharedLlCase{false, 1, 1024, 32, 8, 4, WireFormat::bf16, WireFormat::bf16},
                                         SharedLlCase{false, 1, 7168, 128, 288, 8, WireFormat::fp8, WireFormat::fp8},
                                         SharedLlCase{true, 2, 1024, 32, 16, 4, WireFormat::nvfp4, WireFormat::bf16},
                                         SharedLlCase{true, 4, 2176, 24, 36, 8, WireFormat::fp8_ue8m0,
                                                      WireFormat::fp8_ue8m0}),
                         shared_ll_name);

// Decode inside a CUDA graph: dispatch -> a stand-in expert (y = recv_x) -> combine, captured once
// per rank and replayed 100 times with fresh inputs and token counts, each replay equal to the
// reference (checked as the replays go: each rank its own results, once every rank has replayed).
TEST(CudaLowLatencyGraphs, DispatchExpertCombineReplaysWithFreshInputs) {
  const LlGpuCase c{true, 2, 1024, 32, 16, 4, WireFormat::bf16};
  const int replays = 100;
  const int64_t slots = c.ranks * c.tokens, l_count = c.experts / c.ranks;
  std::vector<verify::Problem> problems;
  std::vector<std::vector<int64_t>> counts(replays, std::vector<int64_t>(c.ranks));
  for (int i = 0; i < replays; ++i) {
    problems.push_back(ll_problem(c, 90 + i));
    for (int r = 0; r < c.ranks; ++r) counts[i][r] = (7 * i + 3 * r + 5) % (c.tokens + 1);
  }
  std::vector<std::vector<uint16_t>> ys(c.ranks);  // this replay's y (= recv_x) of each rank
  std::vector<std::string> errors(c.ranks), mismatches(c.ranks);
  const CudaWorld world = ll_world(c);
  std::barrier instantiated(c.ranks), replayed(c.ranks), checked(c.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.ranks; ++r)
    threads.emplace_back([&, r] {
      bool in_sync = false;  // arrived at instantiated; drops out of every barrier on an error
      cudaStream_t stream = nullptr;
      cudaGraphExec_t exec = nullptr;
      try {
        cudaSetDevice(0);
        const verify::RankInput& first = problems[0].inputs[r];
        DeviceArray x(first.x), idx(first.idx), weights(first.weights),
            count(std::vector<int32_t>{static_cast<int32_t>(counts[0][r])}),
            y(std::vector<uint16_t>(static_cast<size_t>(l_count * slots * c.hidden)));
        cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        LowLatencyBuffer b(world.group(r), ll_config(c));
        b.set_stream(stream);
        cudaGraph_t graph = nullptr;
        cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
        LowLatencyDispatchInput d;
        d.x = device_view(x, DType::bf16, {c.tokens, c.hidden}, 0);
        d.topk_idx = device_view(idx, DType::i32, {c.tokens, c.topk}, 0);
        d.num_tokens = device_view(count, DType::i32, {1}, 0);
        b.dispatch_send(d);
        const LowLatencyDispatchResult res = b.dispatch_recv();
        cudaMemcpyAsync(y.get(), res.recv_x.data<void>(), res.recv_x.numel() * 2, cudaMemcpyDeviceToDevice, stream);
        LowLatencyCombineInput ci;
        ci.y = device_view(y, DType::bf16, {l_count, slots, c.hidden}, 0);
        ci.topk_weights = device_view(weights, DType::f32, {c.tokens, c.topk}, 0);
        b.combine_send(ci, res.handle);
        const Tensor out = b.combine_recv();
        if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
          throw std::runtime_error(std::string("capture failed: ") + cudaGetErrorString(cudaGetLastError()));
        cudaGraphDestroy(graph);
        in_sync = true;
        instantiated.arrive_and_wait();  // no rank's graph waits for a peer still instantiating
        for (int i = 0; i < replays; ++i) {
          const verify::RankInput& p = problems[i].inputs[r];
          const int32_t n = static_cast<int32_t>(counts[i][r]);
          cudaMemcpyAsync(x.get(), p.x.data(), p.x.size() * 2, cudaMemcpyHostToDevice, stream);
          cudaMemcpyAsync(idx.get(), p.idx.data(), p.idx.size() * 4, cudaMemcpyHostToDevice, stream);
          cudaMemcpyAsync(weights.get(), p.weights.data(), p.weights.size() * 4, cudaMemcpyHostToDevice, stream);
          cudaMemcpyAsync(count.get(), &n, 4, cudaMemcpyHostToDevice, stream);
          if (cudaGraphLaunch(exec, stream) != cudaSuccess) throw std::runtime_error("graph launch failed");
          cudaStreamSynchronize(stream);
          const LowLatencyDispatchResult got = host_copy(res);
          const Tensor combined = epx::to_host(out);
          ys[r].assign(got.recv_x.data<uint16_t>(), got.recv_x.data<uint16_t>() + got.recv_x.numel());
          replayed.arrive_and_wait();  // every rank's y of this replay is in ys
          if (mismatches[r].empty()) {
            std::string m = verify::check_ll_dispatch(problems[i], counts[i], r, 0.0f, got);
            if (m.empty()) m = verify::check_ll_combine(problems[i], counts[i], ys, r, true, combined, "ll_combine out");
            if (!m.empty()) mismatches[r] = "replay " + std::to_string(i) + ": " + m;
          }
          checked.arrive_and_wait();  // ys is rewritten by the next replay
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (!in_sync) instantiated.arrive_and_drop();
        replayed.arrive_and_drop();
        checked.arrive_and_drop();
      }
      if (exec) cudaGraphExecDestroy(exec);
      if (stream) cudaStreamDestroy(stream);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(mismatches[r], "") << "rank " << r;
  }
}

// Runs body(rank, buffer, x, idx) on the case's ranks (a buffer with the given timeout); returns
// each rank's error ("" if none).
template <typename Body>
std::vector<std::string> on_ranks(const LlGpuCase& c, const verify::Problem& p, int64_t timeout_ms, Body body) {
  const CudaWorld world = ll_world(c);
  return verify::run_threads(c.ranks, [&](int r) {
    cudaSetDevice(0);
    DeviceArray x(p.inputs[r].x), idx(p.inputs[r].idx);
    LowLatencyConfig cfg = ll_config(c);
    cfg.timeout_ms = timeout_ms;
    LowLatencyBuffer b(world.group(r), cfg);
    body(r, b, x, idx);
  });
}

LowLatencyDispatchInput ll_input(const LlGpuCase& c, const DeviceArray& x, const DeviceArray& idx) {
  LowLatencyDispatchInput d;
  d.x = device_view(x, DType::bf16, {c.tokens, c.hidden}, 0);
  d.topk_idx = device_view(idx, DType::i32, {c.tokens, c.topk}, 0);
  return d;
}

// A rank without tokens may pass [0, K] weights without data to ll_dispatch (torch's empty CUDA
// tensors have none): they are weights given, so its weighted ll_combine takes none, as on the
// CPU backend, while its peer gives its own weights to ll_combine (the ranks of one call mix the
// two; every rank's combine reads who sent weights at dispatch). Both ranks' outputs as the CPU
// backend's, bit for bit.
TEST(CudaLowLatencyWeights, EmptyWeightsWithoutDataAtDispatchAreWeightsGiven) {
  const LlGpuCase c{true, 2, 256, 16, 8, 4, WireFormat::bf16};
  const verify::Problem p = ll_problem(c, 43);
  const int64_t slots = c.ranks * c.tokens, l_count = c.experts / c.ranks;
  std::vector<std::vector<uint16_t>> ys;
  for (int r = 0; r < c.ranks; ++r) ys.push_back(verify::random_bf16(l_count * slots * c.hidden, 50 + r));
  // Rank r's calls: rank 0 without tokens (its empty weights at dispatch), rank 1 with all of its
  // tokens (its weights at combine). x, idx, w, y: the inputs where `kind` reads them.
  auto calls = [&](int r, LowLatencyBuffer& b, DeviceKind kind, void* x, void* idx, void* w, void* y) {
    const int64_t t = r == 0 ? 0 : c.tokens;
    LowLatencyDispatchInput d;
    d.x = TensorView::of(t > 0 ? x : nullptr, DType::bf16, {t, c.hidden}, kind, 0);
    d.topk_idx = TensorView::of(t > 0 ? idx : nullptr, DType::i32, {t, c.topk}, kind, 0);
    if (r == 0) d.topk_weights = TensorView::of(nullptr, DType::f32, {0, c.topk}, kind, 0);
    const LowLatencyDispatchResult res = b.dispatch(d);
    b.synchronize();  // on one GPU no rank queues a kernel behind its own waiting one
    LowLatencyCombineInput ci;
    ci.y = TensorView::of(y, DType::bf16, {l_count, slots, c.hidden}, kind, 0);
    if (r == 1) ci.topk_weights = TensorView::of(w, DType::f32, {t, c.topk}, kind, 0);
    const Tensor out = b.combine(ci, res.handle);
    b.synchronize();
    return kind == DeviceKind::cuda ? epx::to_host(out) : out;
  };
  std::vector<Tensor> want(c.ranks), got(c.ranks);
  const HostWorld host(c.ranks);
  const std::vector<std::string> host_errors = verify::run_threads(c.ranks, [&](int r) {
    verify::RankInput in = p.inputs[r];
    std::vector<uint16_t> y = ys[r];
    LowLatencyBuffer b(host.group(r), ll_config(c));
    want[r] = calls(r, b, DeviceKind::host, in.x.data(), in.idx.data(), in.weights.data(), y.data());
  });
  const auto errors = on_ranks(c, p, 20000, [&](int r, LowLatencyBuffer& b, const DeviceArray& x, const DeviceArray& idx) {
    DeviceArray w(p.inputs[r].weights), y(ys[r]);
    got[r] = calls(r, b, DeviceKind::cuda, x.get(), idx.get(), w.get(), y.get());
  });
  for (int r = 0; r < c.ranks; ++r) {
    ASSERT_EQ(host_errors[r], "") << "rank " << r;
    ASSERT_EQ(errors[r], "") << "rank " << r;
    ASSERT_EQ(got[r].numel(), want[r].numel()) << "rank " << r;
    EXPECT_EQ(std::memcmp(got[r].data<uint16_t>(), want[r].data<uint16_t>(), 2 * static_cast<size_t>(want[r].numel())), 0)
        << "rank " << r;
  }
}

// The low-latency buffer's load counters (LowLatencyBuffer::expert_load): each ll_dispatch adds its
// recv_count (checked against the reference by every round test) on the device; a call with a bad
// id counts nothing on any rank; reset_expert_load zeroes them, stream-ordered.
TEST(CudaLowLatencyLoad, EachDispatchAddsItsRecvCount) {
  const LlGpuCase c{true, 2, 256, 16, 8, 4, WireFormat::bf16};
  const verify::Problem p = ll_problem(c, 41);
  std::vector<std::string> wrong(c.ranks);
  std::vector<DeviceArray> bad_idx;  // freed after the buffers (a shared GPU: see the test below)
  for (int r = 0; r < c.ranks; ++r) {
    std::vector<int32_t> bad = p.inputs[r].idx;
    if (r == 1) bad[3 * c.topk] = 99;
    bad_idx.emplace_back(bad);
  }
  const auto errors = on_ranks(c, p, 20000, [&](int r, LowLatencyBuffer& b, const DeviceArray& x, const DeviceArray& idx) {
    auto host = [&](const Tensor& t) {
      b.synchronize();
      const Tensor h = to_host(t);
      return std::vector<int64_t>(h.data<int64_t>(), h.data<int64_t>() + h.numel());
    };
    auto counts = [&](const LowLatencyDispatchResult& res) {
      b.synchronize();
      const Tensor h = to_host(res.recv_count);
      std::vector<int64_t> v(static_cast<size_t>(h.numel()));
      for (int64_t l = 0; l < h.numel(); ++l) v[static_cast<size_t>(l)] = h.data<int32_t>()[l];
      return v;
    };
    auto expect = [&](const std::vector<int64_t>& want, int64_t times, const char* when) {
      const std::vector<int64_t> got = host(b.expert_load());
      for (size_t l = 0; l < want.size(); ++l)
        if (got[l] != times * want[l])
          wrong[r] += std::string(when) + ": expert " + std::to_string(l) + " counted " + std::to_string(got[l]) +
                      ", expected " + std::to_string(times * want[l]) + "; ";
    };
    const std::vector<int64_t> once = counts(b.dispatch(ll_input(c, x, idx)));
    expect(once, 1, "one dispatch");
    b.dispatch(ll_input(c, x, idx));
    expect(once, 2, "two dispatches");
    b.dispatch(ll_input(c, x, bad_idx[r]));  // found on the device: raised by the next call
    expect(once, 2, "after a failed dispatch");
    try {
      b.dispatch(ll_input(c, x, idx));
    } catch (const Error&) {
    }
    b.reset_expert_load();
    expect(once, 0, "after the reset");
    b.dispatch(ll_input(c, x, idx));
    expect(once, 1, "one dispatch after the reset");
  });
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(wrong[r], "") << "rank " << r;
  }
}

// An id out of range is found on the device: that call's results are not to be used, the next
// call on every rank raises it (the bad rank its id, the others its rejection), and the call
// after that works again.
void expect_a_bad_id_fails_every_rank(bool shared_expert) {
  LlGpuCase c{true, 2, 256, 16, 8, 4, WireFormat::bf16};
  c.shared_expert = shared_expert;
  const verify::Problem p = ll_problem(c, 31);
  std::vector<std::string> raised(c.ranks), after(c.ranks);
  const std::vector<int64_t> all(c.ranks, c.tokens);
  // Made here and freed after the ranks' buffers: a rank's cudaFree while its peer is inside a call
  // would hold the peer back on the shared GPU (docs/cuda.md).
  std::vector<DeviceArray> bad_idx;
  for (int r = 0; r < c.ranks; ++r) {
    std::vector<int32_t> bad = p.inputs[r].idx;
    if (r == 1) bad[5 * c.topk + 2] = 99;
    bad_idx.emplace_back(bad);
  }
  const auto errors = on_ranks(c, p, 20000, [&](int r, LowLatencyBuffer& b, const DeviceArray& x, const DeviceArray& idx) {
    b.dispatch(ll_input(c, x, bad_idx[r]));
    b.synchronize();
    try {
      b.dispatch(ll_input(c, x, idx));
    } catch (const Error& e) {
      raised[r] = e.what();
    }
    const LowLatencyDispatchResult res = b.dispatch(ll_input(c, x, idx));
    b.synchronize();
    after[r] = verify::check_ll_dispatch(p, all, r, 0.0f, host_copy(res));
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_THAT(raised[1], testing::HasSubstr("topk_idx[5, 2] = 99 is out of range"));
  EXPECT_THAT(raised[0], testing::HasSubstr("rank 1 rejected its input"));
  EXPECT_EQ(after[0], "") << "shared expert " << shared_expert;
  EXPECT_EQ(after[1], "") << "shared expert " << shared_expert;
}

// With the shared expert too: its segment in the failed call, then in the good one.
TEST(CudaLowLatencyErrors, ABadIdOnTheDeviceFailsEveryRankAndTheBufferGoesOn) {
  expect_a_bad_id_fails_every_rank(false);
  expect_a_bad_id_fails_every_rank(true);
}

// EPLB: a bad replica table on rank 1 (found by its send half's block 0) and tables that differ
// between ranks (found by the receive halves) fail the call; as for a bad id, the next call raises
// it on every rank and the call after that works.
TEST(CudaLowLatencyErrors, ABadOrDifferingReplicaTableFailsEveryRankAndTheBufferGoesOn) {
  const LlGpuCase c{true, 2, 256, 16, 5, 2, WireFormat::bf16, WireFormat::bf16, 10, 2};
  const verify::Problem p = ll_problem(c, 33);
  const std::vector<int32_t> good = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1};
  const std::pair<std::vector<int32_t>, const char*> cases[] = {
      {{0, 5, 1, -1, 2, -1, 3, 10, 4, -1}, "ll_dispatch: expert_replicas[3][1] = 10 is out of range"},
      {{0, 5, 1, -1, 2, -1, 3, 1, 4, -1}, "ll_dispatch: expert_replicas[3][1] = 1 repeats expert_replicas[1][0]"},
      {{0, 5, 1, -1, -1, -1, 3, -1, 4, -1}, "ll_dispatch: expert_replicas[2] has no entry (all 2 are -1)"},
      {{5, 0, 1, -1, 2, -1, 3, -1, 4, -1}, "passes another expert_replicas table"},  // valid, another order
  };
  for (const auto& [table, words] : cases) {
    std::vector<std::string> raised(c.ranks), after(c.ranks);
    std::vector<ErrorCode> codes(c.ranks, ErrorCode::internal);
    std::vector<DeviceArray> tables;  // freed after the buffers (docs/cuda.md)
    tables.emplace_back(good);
    tables.emplace_back(table);
    const auto errors = on_ranks(c, p, 20000, [&](int r, LowLatencyBuffer& b, const DeviceArray& x, const DeviceArray& idx) {
      LowLatencyDispatchInput in = ll_input(c, x, idx);
      in.expert_replicas = device_view(tables[r], DType::i32, {c.experts, c.width}, 0);
      b.dispatch(in);
      b.synchronize();
      in.expert_replicas = device_view(tables[0], DType::i32, {c.experts, c.width}, 0);
      codes[r] = code_of([&] { b.dispatch(in); }, &raised[r]);
      try {  // the third call works, which the fourth would raise otherwise
        b.dispatch(in);
        b.synchronize();
        b.dispatch(in);
        b.synchronize();
      } catch (const Error& e) {
        after[r] = e.what();
      }
    });
    const bool mismatch = words[0] == 'p';
    for (int r = 0; r < c.ranks; ++r) {
      EXPECT_EQ(errors[r], "") << words;
      EXPECT_EQ(after[r], "") << words << ", rank " << r;
    }
    if (mismatch) {
      for (int r = 0; r < c.ranks; ++r) {
        EXPECT_EQ(codes[r], ErrorCode::config_mismatch) << "rank " << r << ": " << raised[r];
        EXPECT_THAT(raised[r], testing::HasSubstr(words)) << "rank " << r;
      }
      continue;
    }
    EXPECT_EQ(codes[1], ErrorCode::invalid_argument) << words << ": " << raised[1];
    EXPECT_THAT(raised[1], testing::HasSubstr(words));
    EXPECT_EQ(codes[0], ErrorCode::peer_failed) << words << ": " << raised[0];
    EXPECT_THAT(raised[0], testing::HasSubstr("rank 1 rejected its input"));
  }
}

// A front end's own refusal (LowLatencyBuffer::reject), for dispatch and for combine: the refusing
// rank throws its reason at once; as for any error found on the device, the next call raises the
// group's failure on every rank (the peers: the rank that refused), and the call after that works.
void expect_a_reject_to_join_the_peers_call(bool shared_expert) {
  LlGpuCase c{true, 2, 256, 16, 8, 4, WireFormat::bf16};
  c.shared_expert = shared_expert;
  const verify::Problem p = ll_problem(c, 37);
  const std::vector<int64_t> all(c.ranks, c.tokens);
  for (LowLatencyOp op : {LowLatencyOp::dispatch, LowLatencyOp::combine}) {
    std::vector<std::string> raised(c.ranks), next(c.ranks), after(c.ranks);
    const auto errors = on_ranks(c, p, 20000, [&](int r, LowLatencyBuffer& b, const DeviceArray& x, const DeviceArray& idx) {
      const LowLatencyDispatchResult first = b.dispatch(ll_input(c, x, idx));
      b.synchronize();
      LowLatencyCombineInput y;
      y.y = first.recv_x.view();
      y.weighted = false;
      try {
        if (r == 1) b.reject(op, "binding: y is not contiguous");
        if (op == LowLatencyOp::dispatch) b.dispatch(ll_input(c, x, idx));
        else b.combine(y, first.handle);
      } catch (const Error& e) {
        raised[r] = e.what();
      }
      b.synchronize();  // the device's findings are raised by the next call
      try {
        b.dispatch(ll_input(c, x, idx));
      } catch (const Error& e) {
        next[r] = e.what();
      }
      const LowLatencyDispatchResult res = b.dispatch(ll_input(c, x, idx));
      b.synchronize();
      after[r] = verify::check_ll_dispatch(p, all, r, 0.0f, host_copy(res));
    });
    const char* name = op == LowLatencyOp::dispatch ? "dispatch" : "combine";
    EXPECT_EQ(errors[0], "") << name;
    EXPECT_EQ(errors[1], "") << name;
    EXPECT_EQ(raised[1], "binding: y is not contiguous") << name;
    EXPECT_EQ(raised[0], "") << name;
    EXPECT_THAT(next[0], testing::HasSubstr("rank 1 rejected its input")) << name;
    EXPECT_THAT(next[1], testing::HasSubstr("rank 1 rejected its input")) << name;
    EXPECT_EQ(after[0], "") << name << ", shared expert " << shared_expert;
    EXPECT_EQ(after[1], "") << name << ", shared expert " << shared_expert;
  }
}

// With the shared expert too (its y has the shared segment; the call after the refusal is right).
TEST(CudaLowLatencyErrors, RejectJoinsThePeersCall) {
  expect_a_reject_to_join_the_peers_call(false);
  expect_a_reject_to_join_the_peers_call(true);
}

// A rank that never calls: its peer's receive half gives up after timeout_ms, the next call says
// so, and the buffer refuses every call after that.
TEST(CudaLowLatencyErrors, AMissingPeerTimesOutInsteadOfHanging) {
  const LlGpuCase c{true, 2, 256, 16, 8, 4, WireFormat::bf16};
  const verify::Problem p = ll_problem(c, 32);
  std::string seen;
  const auto errors = on_ranks(c, p, 500, [&](int r, LowLatencyBuffer& b, const DeviceArray& x, const DeviceArray& idx) {
    if (r == 1) return;  // rank 1 is "killed" after creating its buffer
    for (int call = 0; call < 3; ++call) {
      try {
        b.dispatch(ll_input(c, x, idx));
        b.synchronize();
      } catch (const Error& e) {
        seen += std::string(e.what()) + "\n";
      }
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_THAT(seen, testing::HasSubstr("waited 500 ms for rank 1, which never arrived"));
  EXPECT_THAT(seen, testing::HasSubstr("the low-latency buffer already failed"));
}

}  // namespace
}  // namespace epx::test
