// The fused shared expert (BufferConfig::shared_expert) on the CUDA high-throughput buffer: every
// output of every operation equals the CPU reference bit for bit (the shared segment first, the
// gate in recv_weights, the shared term after the ranks' partials and before shared_out, both
// backward passes' grad_shared_gate), at EP1 over NCCL and on the shared-GPU transport (where the
// copy engines move dispatch and combine), with every wire and both combine wires; and the one
// shape it refuses.
#include <cuda_runtime.h>

#include "cuda_harness.hpp"

namespace epx::test {
namespace {

struct SharedCase {
  Transport transport;
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
  int64_t alignment;
  bool gate;     // a shared_gate given to dispatch
  bool weights;  // router weights (weighted combine)
  SharedMode mode = SharedMode::blocking;
  WireFormat combine_wire = WireFormat::bf16;
  bool prequantized = false;  // x given as fp8 codes + scales (its wire row copied, not encoded)
};

std::string shared_case_name(const testing::TestParamInfo<SharedCase>& info) {
  const SharedCase& c = info.param;
  return std::string(c.transport == Transport::nccl ? "nccl" : "shared") + "_R" + std::to_string(c.ranks) + "_H" +
         std::to_string(c.hidden) + "_T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_K" +
         std::to_string(c.topk) + "_" + std::string(wire_name(c.wire)) + "_A" + std::to_string(c.alignment) +
         (c.gate ? "_gate" : "_nogate") + (c.weights ? "" : "_noweights") + "_" + shared_mode_name(c.mode) +
         (c.combine_wire == WireFormat::bf16 ? "" : "_combine_" + std::string(wire_name(c.combine_wire))) +
         (c.prequantized ? "_prequantized" : "");
}

void PrintTo(const SharedCase& c, std::ostream* os) { *os << shared_case_name(testing::TestParamInfo<SharedCase>(c, 0)); }

BufferConfig shared_case_config(const SharedCase& c) {
  BufferConfig cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire, c.alignment);
  apply_shared_mode(cfg, c.mode, c.ranks);
  cfg.shared_expert = true;
  cfg.num_sms = c.transport == Transport::nccl ? 16 : 4;
  cfg.combine_wire = c.combine_wire;
  return cfg;
}

class CudaSharedExpert : public testing::TestWithParam<SharedCase> {};

TEST_P(CudaSharedExpert, MatchesTheReference) {
  const SharedCase& c = GetParam();
  if (c.transport == Transport::nccl && gpu_count() < c.ranks) GTEST_SKIP() << "needs " << c.ranks << " GPUs";
  const verify::Problem p = shared_problem(shared_case_config(c), c.ranks, c.mode, c.gate, c.weights,
                                           static_cast<uint64_t>(c.ranks * 53 + c.hidden + c.alignment), c.prequantized);
  RunOptions o;
  o.shared_expert = c.tokens % 2 == 0;  // shared_out too on even token counts: both terms, in order
  const auto runs = run_problem_cuda(world_of(c.transport, c.ranks), p, o);
  expect_matches_reference(p, o, runs);
  expect_shared_mode_effect(runs, c.mode);
}

using namespace case_names;
using M = SharedMode;

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaSharedExpert,
    testing::Values(
        // EP1 over NCCL: every row from x by the receivers (bf16 copied, quantized rows encoded)
        SharedCase{N, 1, 2048, 256, 32, 8, W::bf16, 16, true, true},
        SharedCase{N, 1, 7168, 128, 32, 8, W::fp8, 128, true, true, M::blocking, W::fp8},
        SharedCase{N, 1, 1024, 96, 32, 8, W::bf16, 8, false, true, M::blocking, W::fp8_ue8m0},
        SharedCase{N, 1, 1024, 100, 16, 4, W::nvfp4, 16, true, true},
        SharedCase{N, 1, 1024, 128, 32, 8, W::fp8, 4, true, true, M::blocking, W::bf16, true},
        SharedCase{N, 1, 100, 33, 8, 2, W::bf16, 1, false, true},  // rows of 200 bytes: the register sums
        SharedCase{N, 1, 512, 64, 16, 4, W::bf16, 8, true, true, M::capacity},
        // Several ranks on one GPU: copy-engine dispatch and combine at two ranks, SM beyond
        SharedCase{S, 2, 2048, 128, 32, 8, W::bf16, 16, true, true},
        SharedCase{S, 2, 1024, 96, 16, 4, W::fp8, 8, true, true, M::capacity},
        SharedCase{S, 2, 1024, 96, 16, 4, W::bf16, 1, true, true, M::blocking, W::fp8},
        SharedCase{S, 3, 512, 40, 12, 4, W::bf16, 8, true, true, M::overflow},
        SharedCase{S, 4, 512, 64, 32, 4, W::bf16, 4, false, false, M::dropping},
        SharedCase{S, 8, 1024, 48, 64, 8, W::fp8_ue8m0, 128, true, true}),
    shared_case_name);

// The receivers encode a shared row in their warp's 14 KiB stage: a longer quantized wire row
// (fp8 of hidden 16384: 16896 bytes) is refused at creation with unsupported on every rank, and
// the same config with the bf16 wire (its rows copied from x) is served.
TEST(CudaSharedExpertErrors, AWireRowLongerThanAStageIsRefusedOnEveryRank) {
  BufferConfig cfg = small_config(16384, 8, 4, 2, WireFormat::fp8, 1);
  cfg.shared_expert = true;
  cfg.num_sms = 4;
  cfg.timeout_ms = 20000;
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  std::vector<std::string> errors(2);
  std::vector<ErrorCode> codes(2, ErrorCode::internal);
  std::vector<std::string> bf16_errors = verify::run_threads(2, [&](int r) {
    codes[r] = code_of([&] { Buffer b(world.group(r), cfg); }, &errors[r]);
    BufferConfig bf16 = cfg;
    bf16.wire = WireFormat::bf16;
    Buffer b(world.group(r), bf16);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], ErrorCode::unsupported) << errors[r];
    EXPECT_THAT(errors[r], testing::HasSubstr("fused shared expert needs a wire row of at most 14336 bytes"));
    EXPECT_EQ(bf16_errors[r], "") << "rank " << r;
  }
}

// A rank without tokens may pass a [0] gate with no data (torch's empty CUDA tensors have none):
// it is a gate given, so weighted combine_backward returns grad_shared_gate [0], as the CPU
// backend does.
TEST(CudaSharedExpertGate, AnEmptyGateWithoutDataIsAGate) {
  BufferConfig cfg = small_config(256, 8, 4, 2, WireFormat::bf16, 1);
  cfg.shared_expert = true;
  cfg.num_sms = 4;
  const CudaWorld world = world_of(Transport::nccl, 1);
  Buffer b(world.group(0), cfg);
  auto empty = [](DType t, std::initializer_list<int64_t> shape) {
    return TensorView::of(nullptr, t, shape, DeviceKind::cuda, 0);
  };
  DispatchInput in;
  in.x = empty(DType::bf16, {0, 256});
  in.topk_idx = empty(DType::i32, {0, 2});
  in.topk_weights = empty(DType::f32, {0, 2});
  in.shared_gate = empty(DType::f32, {0});
  const DispatchResult d = b.dispatch(in, DispatchOptions{});
  ASSERT_EQ(d.num_rows, 0);
  const CombineBackwardResult g = b.combine_backward({empty(DType::bf16, {0, 256}), empty(DType::bf16, {0, 256})},
                                                     d.handle, {true});
  b.synchronize();
  ASSERT_TRUE(g.grad_shared_gate.defined());
  EXPECT_EQ(g.grad_shared_gate.numel(), 0);
}

}  // namespace
}  // namespace epx::test
