// dispatch_all and the others (epx/all_ranks.hpp) on the CPU backend: one thread's call for every
// rank gives, bit for bit, what one thread per rank gets from the same calls; the checks of the
// buffers and inputs; a rank's bad input fails the call with that rank's own error and the next
// call works.
#include <optional>

#include "epx/all_ranks.hpp"
#include "harness.hpp"

namespace epx::test {
namespace {

constexpr int kRanks = 4;

// Buffers of every rank of one world, created one thread per rank (creation is collective).
template <class Buf, class Config>
std::vector<std::optional<Buf>> buffers_of(HostWorld& world, const Config& cfg) {
  std::vector<std::optional<Buf>> out(kRanks);
  auto errors = verify::run_threads(kRanks, [&](int r) { out[r].emplace(world.group(r), cfg); });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  return out;
}

template <class Buf>
std::vector<Buf*> pointers(std::vector<std::optional<Buf>>& bufs) {
  std::vector<Buf*> out;
  for (auto& b : bufs) out.push_back(&*b);
  return out;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.data<char>(), b.data<char>(), a.numel() * dtype_size(a.dtype())) == 0;
}

verify::Problem problem(int64_t hidden) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(hidden, 10, 8, 3);
  spec.ranks = kRanks;
  spec.seed = 13;
  spec.unused_slot_fraction = 0.1;
  return verify::make_problem(spec);
}

std::vector<DispatchInput> dispatch_inputs(const verify::Problem& p) {
  std::vector<DispatchInput> out;
  for (int r = 0; r < kRanks; ++r) out.push_back(p.inputs[r].view(p.cfg.hidden, p.cfg.topk));
  return out;
}

TEST(AllRanks, DispatchAndCombineFromOneThreadEqualOneThreadPerRank) {
  const verify::Problem p = problem(64);
  HostWorld one(kRanks), each(kRanks);
  auto from_one = buffers_of<Buffer>(one, p.cfg);
  auto per_rank = buffers_of<Buffer>(each, p.cfg);
  const std::vector<DispatchInput> inputs = dispatch_inputs(p);
  const std::vector<DispatchResult> d = dispatch_all(pointers(from_one), inputs);
  std::vector<DispatchResult> want(kRanks);
  std::vector<Tensor> want_out(kRanks);
  std::vector<std::vector<uint16_t>> ys(kRanks);
  for (int r = 0; r < kRanks; ++r) ys[r] = verify::random_bf16(d[r].recv_x.size(0) * 64, 40 + r);
  auto errors = verify::run_threads(kRanks, [&](int r) {
    want[r] = per_rank[r]->dispatch(inputs[r]);
    want_out[r] = per_rank[r]->combine({bf16_view(ys[r], d[r].recv_x.size(0), 64), {}}, want[r].handle).out;
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  std::vector<CombineInput> combine_inputs;
  std::vector<Handle> handles;
  for (int r = 0; r < kRanks; ++r) {
    combine_inputs.push_back({bf16_view(ys[r], d[r].recv_x.size(0), 64), {}});
    handles.push_back(d[r].handle);
  }
  const std::vector<CombineResult> c = combine_all(pointers(from_one), combine_inputs, handles);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(same_bytes(d[r].recv_x, want[r].recv_x)) << "recv_x, rank " << r;
    EXPECT_TRUE(same_bytes(d[r].recv_src, want[r].recv_src)) << "recv_src, rank " << r;
    EXPECT_TRUE(same_bytes(d[r].expert_offsets, want[r].expert_offsets)) << "expert_offsets, rank " << r;
    EXPECT_TRUE(same_bytes(c[r].out, want_out[r])) << "combine, rank " << r;
  }
}

TEST(AllRanks, LowLatencyFromOneThreadEqualsOneThreadPerRank) {
  const verify::Problem p = problem(128);
  const LowLatencyConfig cfg = small_ll_config(128, 10, 8, 3);
  HostWorld one(kRanks), each(kRanks);
  auto from_one = buffers_of<LowLatencyBuffer>(one, cfg);
  auto per_rank = buffers_of<LowLatencyBuffer>(each, cfg);
  std::vector<LowLatencyDispatchInput> inputs(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    const verify::RankInput& in = p.inputs[r];
    inputs[r].x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {in.tokens, 128});
    inputs[r].topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {in.tokens, 3});
    inputs[r].topk_weights = TensorView::of(const_cast<float*>(in.weights.data()), DType::f32, {in.tokens, 3});
  }
  const std::vector<LowLatencyDispatchResult> d = ll_dispatch_all(pointers(from_one), inputs);
  std::vector<std::vector<uint16_t>> ys(kRanks);
  std::vector<LowLatencyCombineInput> combine_inputs(kRanks);
  std::vector<LowLatencyHandle> handles;
  for (int r = 0; r < kRanks; ++r) {
    ys[r] = verify::random_bf16(d[r].recv_x.numel(), 60 + r);
    combine_inputs[r].y = TensorView::of(ys[r].data(), DType::bf16, {d[r].recv_x.size(0), d[r].recv_x.size(1), 128});
    handles.push_back(d[r].handle);
  }
  const std::vector<Tensor> out = ll_combine_all(pointers(from_one), combine_inputs, handles);
  std::vector<LowLatencyDispatchResult> want(kRanks);
  std::vector<Tensor> want_out(kRanks);
  auto errors = verify::run_threads(kRanks, [&](int r) {
    want[r] = per_rank[r]->dispatch(inputs[r]);
    want_out[r] = per_rank[r]->combine(combine_inputs[r], want[r].handle);
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(same_bytes(d[r].recv_x, want[r].recv_x)) << "recv_x, rank " << r;
    EXPECT_TRUE(same_bytes(d[r].recv_count, want[r].recv_count)) << "recv_count, rank " << r;
    EXPECT_TRUE(same_bytes(out[r], want_out[r])) << "ll_combine, rank " << r;
  }
}

TEST(AllRanks, ABadInputFailsWithItsRanksOwnErrorAndTheNextCallWorks) {
  const verify::Problem p = problem(64);
  HostWorld world(kRanks);
  auto bufs = buffers_of<Buffer>(world, p.cfg);
  const std::vector<DispatchInput> inputs = dispatch_inputs(p);
  std::vector<int32_t> bad(p.inputs[2].idx);
  bad[0] = 99;  // an expert id out of range on rank 2
  std::vector<DispatchInput> with_bad = inputs;
  with_bad[2].topk_idx = TensorView::of(bad.data(), DType::i32, {p.inputs[2].tokens, 3});
  std::string what;
  EXPECT_EQ(code_of([&] { dispatch_all(pointers(bufs), with_bad); }, &what), ErrorCode::invalid_argument);
  EXPECT_THAT(what, testing::HasSubstr("99"));
  EXPECT_EQ(dispatch_all(pointers(bufs), inputs).size(), static_cast<size_t>(kRanks));
}

TEST(AllRanks, RefusesMismatchedInputsAndBuffers) {
  const verify::Problem p = problem(64);
  HostWorld world(kRanks), other(kRanks);
  auto bufs = buffers_of<Buffer>(world, p.cfg);
  auto others = buffers_of<Buffer>(other, p.cfg);
  const std::vector<DispatchInput> inputs = dispatch_inputs(p);
  std::vector<Buffer*> b = pointers(bufs);
  std::string what;
  code_of([&] { dispatch_all(b, std::span<const DispatchInput>(inputs).first(3)); }, &what);
  EXPECT_THAT(what, testing::HasSubstr("3 inputs for 4 buffers"));
  std::vector<Buffer*> twice = {b[0], b[1], b[1], b[3]};
  code_of([&] { dispatch_all(twice, inputs); }, &what);
  EXPECT_THAT(what, testing::HasSubstr("buffers[2] is rank 1 again"));
  std::vector<Buffer*> mixed = {b[0], b[1], &*others[2], b[3]};
  code_of([&] { dispatch_all(mixed, inputs); }, &what);
  EXPECT_THAT(what, testing::HasSubstr("belongs to another group"));
  auto second = buffers_of<Buffer>(world, p.cfg);  // the world's second buffer of each rank
  std::vector<Buffer*> apart = {b[0], b[1], &*second[2], b[3]};
  code_of([&] { dispatch_all(apart, inputs); }, &what);
  EXPECT_THAT(what, testing::HasSubstr("buffers[2] was not created together with buffers[0]"));
  EXPECT_EQ(dispatch_all(b, inputs).size(), static_cast<size_t>(kRanks));  // nothing ran before: all in step
}

}  // namespace
}  // namespace epx::test
