// Reliability on the GPU:
// - repeated calls with the same inputs give bit-identical outputs: 100 repetitions of dispatch ->
//   combine (and, every 20th, both backward passes) in the high-throughput mode, 100 of ll_dispatch
//   -> ll_combine in the low-latency mode (both buffer sets, split and fused forms), EP1 over NCCL
//   and 2 (high-throughput also 4) ranks on the shared GPU; each repetition's outputs compared byte
//   for byte with the first's, the first with the reference;
// - a rank that stops mid-call (its thread ends after some good calls, or it never launches its
//   receive half) makes its peer time out with the call, the step and the missing rank named, and
//   the buffer then refuses every later call (peer_failed).
#include <cuda_runtime.h>

#include <gmock/gmock.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_harness.hpp"

namespace epx::test {
namespace {

// Outputs start as 0xa5 bytes (as in cuda_test.cpp; set before any buffer reads it).
const bool kPoisonOutputs = [] { return setenv("EPX_POISON_OUTPUTS", "1", 0) == 0; }();

constexpr int kRepetitions = 100;
constexpr int kBackwardEvery = 20;  // the backward passes at repetitions 0, 20, 40, 60 and 80

std::string hex_byte(uint8_t b) {
  static const char digits[] = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

// One repetition's outputs, each copied once to the host, by name: the first repetition's are
// kept and every later one's are compared with them byte for byte (two copies at most at a time).
class Outputs {
 public:
  void add(const std::string& name, const Tensor& host) {
    parts_.push_back({name, host.defined() ? host.view().describe() : std::string("(none)"), host});
  }
  void add(const std::string& name, int64_t value) { parts_.push_back({name, std::to_string(value), Tensor()}); }

  // "" when each of got's parts equals this one's part of the same name, else the first difference.
  std::string first_difference(const Outputs& got) const {
    for (const Part& g : got.parts_) {
      const Part* w = nullptr;
      for (const Part& p : parts_)
        if (p.name == g.name) w = &p;
      if (!w) return g.name + ": not among the first repetition's outputs";
      if (w->shape != g.shape) return g.name + ": " + g.shape + ", the first repetition's was " + w->shape;
      if (!g.host.defined()) continue;
      const auto* a = g.host.data<const uint8_t>();
      const auto* b = w->host.data<const uint8_t>();
      const size_t n = static_cast<size_t>(g.host.numel() * dtype_size(g.host.dtype()));
      if (std::memcmp(a, b, n) == 0) continue;
      size_t i = 0;
      while (a[i] == b[i]) ++i;
      return g.name + " (" + g.shape + "): byte " + std::to_string(i) + " of " + std::to_string(n) + " is " +
             hex_byte(a[i]) + ", the first repetition's was " + hex_byte(b[i]);
    }
    return "";
  }

 private:
  struct Part {
    std::string name;
    std::string shape;  // dtype and shape (same shape: same byte count), or a scalar's value
    Tensor host;        // a host tensor (epx::to_host), contiguous
  };
  std::vector<Part> parts_;
};

void add_dispatch(Outputs& o, const DispatchResult& h) {
  o.add("recv_x", h.recv_x);
  o.add("recv_scales", h.recv_scales);
  o.add("recv_global_scale", h.recv_global_scale);
  o.add("recv_src", h.recv_src);
  o.add("recv_weights", h.recv_weights);
  o.add("recv_topk_idx", h.recv_topk_idx);
  o.add("recv_topk_weights", h.recv_topk_weights);
  o.add("expert_offsets", h.expert_offsets);
  o.add("tokens_per_expert", h.tokens_per_expert);
  o.add("rank_offsets", h.rank_offsets);
  o.add("recv_info", h.recv_info);
  o.add("num_rows", h.num_rows);
  o.add("overflow", h.overflow ? 1 : 0);
  o.add("dropped_slots", h.dropped_slots);
}

// ---- Determinism, high-throughput ----

struct RepeatCase {
  bool shared;  // the shared-GPU transport, else NCCL (one GPU per rank)
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
  Layout layout;
  int64_t alignment;
  CapacityMode mode = CapacityMode::blocking;
};

// Not "nccl_R1_...": scripts/device-check.sh runs '*nccl_R1_*' under compute-sanitizer, where 100
// repetitions would take minutes.
std::string repeat_case_name(const testing::TestParamInfo<RepeatCase>& info) {
  const RepeatCase& c = info.param;
  return std::string(c.shared ? "shared" : "nccl") + "_EP" + std::to_string(c.ranks) + "_H" +
         std::to_string(c.hidden) + "_T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_K" +
         std::to_string(c.topk) + "_" + std::string(wire_name(c.wire)) + "_" + std::string(layout_name(c.layout)) +
         "_A" + std::to_string(c.alignment) + (c.mode == CapacityMode::capacity ? "_capacity" : "");
}

void PrintTo(const RepeatCase& c, std::ostream* os) { *os << repeat_case_name(testing::TestParamInfo<RepeatCase>(c, 0)); }

// Rank g.rank()'s part: the inputs of run_problem_cuda (cuda_harness.hpp), then kRepetitions times
// dispatch -> combine (and every kBackwardEvery-th time dispatch_backward -> combine_backward) on one
// buffer with those same inputs. `run` gets the first repetition's outputs (for the reference),
// `mismatch` the first difference of a later repetition from the first.
void repeat_on_rank(const Group& g, const verify::Problem& p, const RunOptions& o, RankRun& run, std::string& mismatch) {
  const int r = g.rank();
  const int dev = cuda_device(g);
  cudaSetDevice(dev);
  const verify::RankInput& in = p.inputs[r];
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk, tokens = in.tokens;
  const bool expert_major = o.dispatch.layout == Layout::expert_major;
  const bool weighted = expert_major && p.inputs[0].has_weights;
  const int64_t bound = rows_bound(p);
  const std::vector<uint16_t> y_rows = verify::random_bf16(bound * h, 100 + r);
  run.shared = verify::random_bf16(tokens * h, 200 + r);
  const std::vector<uint16_t> gx_rows = verify::random_bf16(bound * h, 300 + r);
  run.grad_out = verify::random_bf16(tokens * h, 400 + r);
  std::vector<float> gw_rows(static_cast<size_t>(bound * k_count));
  for (size_t i = 0; i < gw_rows.size(); ++i) gw_rows[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
  // Device arrays before the buffer, so they are freed after it (cuda_harness.hpp says why).
  DeviceArray x(in.x), idx(in.idx), w(in.weights);
  DeviceArray y(y_rows), shared(run.shared), gx(gx_rows), gwr(gw_rows), go(run.grad_out);
  Buffer buffer(g, p.cfg);
  DispatchInput din;
  din.x = device_view(x, DType::bf16, {tokens, h}, dev);
  din.topk_idx = device_view(idx, DType::i32, {tokens, k_count}, dev);
  if (in.has_weights) din.topk_weights = device_view(w, DType::f32, {tokens, k_count}, dev);
  Outputs first;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    Outputs now;
    const bool backward = rep % kBackwardEvery == 0;
    DispatchResult hd;
    Tensor out, grad_x, grad_gather_w, grad_y, grad_dot_w;
    int64_t rows = 0;
    try {
      DispatchResult d = buffer.dispatch(din, o.dispatch);
      buffer.synchronize();
      hd = to_host(d);
      add_dispatch(now, hd);
      rows = d.recv_x.size(0);
      CombineResult c = buffer.combine(
          {device_view(y, DType::bf16, {rows, h}, dev), device_view(shared, DType::bf16, {tokens, h}, dev)}, d.handle,
          {weighted});
      buffer.synchronize();
      out = epx::to_host(c.out);
      now.add("combine out", out);
      now.add("combine overflow", c.overflow ? 1 : 0);
      if (backward) {
        const TensorView gw = expert_major ? device_view(gwr, DType::f32, {rows}, dev)
                                           : device_view(gwr, DType::f32, {rows, k_count}, dev);
        DispatchBackwardResult db = buffer.dispatch_backward({device_view(gx, DType::bf16, {rows, h}, dev), gw}, d.handle);
        buffer.synchronize();
        grad_x = epx::to_host(db.grad_x);
        grad_gather_w = epx::to_host(db.grad_topk_weights);
        CombineBackwardResult cb = buffer.combine_backward(
            {device_view(go, DType::bf16, {tokens, h}, dev), device_view(y, DType::bf16, {rows, h}, dev)}, d.handle,
            {weighted});
        buffer.synchronize();
        grad_y = epx::to_host(cb.grad_y);
        grad_dot_w = epx::to_host(cb.grad_topk_weights);
        now.add("dispatch_backward grad_x", grad_x);
        now.add("dispatch_backward grad_topk_weights", grad_gather_w);
        now.add("combine_backward grad_y", grad_y);
        now.add("combine_backward grad_topk_weights", grad_dot_w);
      }
    } catch (const Error& e) {
      throw Error(e.code(), "repetition " + std::to_string(rep) + ": " + e.what());
    }
    if (rep == 0) {  // what the reference checks (as run_problem_cuda leaves it)
      run.dispatched = hd;
      run.y.assign(y_rows.begin(), y_rows.begin() + rows * h);
      run.combined.out = out;
      run.combined.overflow = hd.overflow;
      run.grad_recv_x.assign(gx_rows.begin(), gx_rows.begin() + rows * h);
      run.grad_recv_weights.assign(gw_rows.begin(), gw_rows.begin() + rows * (expert_major ? 1 : k_count));
      run.dispatch_grad.grad_x = grad_x;
      run.dispatch_grad.grad_topk_weights = grad_gather_w;
      run.combine_grad.grad_y = grad_y;
      run.combine_grad.grad_topk_weights = grad_dot_w;
      first = std::move(now);
    } else if (mismatch.empty()) {
      const std::string diff = first.first_difference(now);
      if (!diff.empty()) mismatch = "repetition " + std::to_string(rep) + ": " + diff;
    }
  }
}

class CudaDeterminism : public testing::TestWithParam<RepeatCase> {};

TEST_P(CudaDeterminism, HundredRepetitionsAreBitIdentical) {
  const RepeatCase& c = GetParam();
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  verify::ProblemSpec spec;
  spec.cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire, c.alignment);
  spec.cfg.mode = c.mode;
  if (c.mode == CapacityMode::capacity) spec.cfg.capacity_rows = c.tokens * c.topk / 2 + 8;  // overflows sometimes
  spec.cfg.num_sms = c.shared ? 4 : 16;  // shared: every rank's blocks on the GPU at once
  spec.cfg.timeout_ms = 10000;           // a lost signal fails the test in 10 s, not 20
  spec.ranks = c.ranks;
  for (int r = 0; r < c.ranks; ++r) spec.tokens.push_back(c.tokens - 9 * r);  // unequal counts
  spec.unused_slot_fraction = 0.1;
  spec.seed = static_cast<uint64_t>(7000 + c.ranks * 31 + c.hidden + static_cast<int>(c.wire));
  const verify::Problem p = verify::make_problem(spec);
  RunOptions o;
  o.dispatch.layout = c.layout;
  o.cached = false;  // repeat_on_rank makes the calls itself (the cached dispatch has its own tests)
  const CudaWorld world = c.shared ? CudaWorld::shared_gpu(c.ranks, 0) : CudaWorld(std::vector<int>{0});
  std::vector<RankRun> runs(c.ranks);
  std::vector<std::string> mismatches(c.ranks);
  const std::vector<std::string> errors =
      verify::run_threads(c.ranks, [&](int r) { repeat_on_rank(world.group(r), p, o, runs[r], mismatches[r]); });
  for (int r = 0; r < c.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  expect_matches_reference(p, o, runs);  // the first repetition
  for (int r = 0; r < c.ranks; ++r) EXPECT_EQ(mismatches[r], "") << "rank " << r;
}

using W = WireFormat;
using L = Layout;

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaDeterminism,
    testing::Values(
        // EP1 over NCCL: both layouts, bf16 and fp8 wires, and nvfp4
        RepeatCase{false, 1, 1024, 256, 32, 8, W::bf16, L::expert_major, 16},
        RepeatCase{false, 1, 1024, 256, 32, 8, W::bf16, L::rank_major, 1},
        RepeatCase{false, 1, 1024, 256, 32, 8, W::fp8, L::expert_major, 1},
        RepeatCase{false, 1, 1024, 256, 32, 8, W::fp8, L::rank_major, 1},
        RepeatCase{false, 1, 1024, 128, 32, 4, W::nvfp4, L::expert_major, 16},
        // 2 ranks on the shared GPU (copy engines for bf16 and fp8, SM stores for nvfp4), capacity mode
        RepeatCase{true, 2, 1024, 128, 32, 8, W::bf16, L::expert_major, 16},
        RepeatCase{true, 2, 1024, 128, 32, 8, W::bf16, L::rank_major, 1},
        RepeatCase{true, 2, 1024, 128, 32, 8, W::fp8, L::expert_major, 1},
        RepeatCase{true, 2, 1024, 128, 32, 8, W::fp8, L::rank_major, 1},
        RepeatCase{true, 2, 512, 128, 16, 4, W::nvfp4, L::rank_major, 1},
        RepeatCase{true, 2, 512, 128, 16, 4, W::bf16, L::expert_major, 1, CapacityMode::capacity},
        // 4 ranks on the shared GPU (SM stores)
        RepeatCase{true, 4, 512, 128, 64, 8, W::fp8, L::expert_major, 16},
        RepeatCase{true, 4, 512, 128, 64, 8, W::bf16, L::rank_major, 1}),
    repeat_case_name);

// ---- Determinism, low-latency ----

struct LlRepeatCase {
  bool shared;
  int ranks;
  int64_t hidden, tokens, experts, topk;
  WireFormat wire;
};

std::string ll_repeat_case_name(const testing::TestParamInfo<LlRepeatCase>& info) {
  const LlRepeatCase& c = info.param;
  return std::string(c.shared ? "shared" : "nccl") + "_EP" + std::to_string(c.ranks) + "_H" +
         std::to_string(c.hidden) + "_T" + std::to_string(c.tokens) + "_E" + std::to_string(c.experts) + "_K" +
         std::to_string(c.topk) + "_" + std::string(wire_name(c.wire));
}

void PrintTo(const LlRepeatCase& c, std::ostream* os) {
  *os << ll_repeat_case_name(testing::TestParamInfo<LlRepeatCase>(c, 0));
}

LowLatencyDispatchResult ll_to_host(const LowLatencyDispatchResult& d) {
  LowLatencyDispatchResult h;
  h.recv_x = epx::to_host(d.recv_x);
  h.recv_scales = epx::to_host(d.recv_scales);
  h.recv_global_scale = epx::to_host(d.recv_global_scale);
  h.recv_count = epx::to_host(d.recv_count);
  h.recv_src = epx::to_host(d.recv_src);
  h.recv_layout = epx::to_host(d.recv_layout);
  return h;
}

void add_ll_dispatch(Outputs& o, const LowLatencyDispatchResult& h) {
  o.add("recv_x", h.recv_x);
  o.add("recv_scales", h.recv_scales);
  o.add("recv_global_scale", h.recv_global_scale);
  o.add("recv_count", h.recv_count);
  o.add("recv_src", h.recv_src);
  o.add("recv_layout", h.recv_layout);
}

class CudaLowLatencyDeterminism : public testing::TestWithParam<LlRepeatCase> {};

// kRepetitions calls of each kind on one buffer, so each of its two buffer sets serves 50 of them;
// in blocks of 25 repetitions: split halves, fused calls, each with the combine's weights given to
// ll_combine (repetitions 0-49) and to ll_dispatch (50-99). Every rank counts fewer rows than it
// passes (num_tokens on the device). Whatever the set and the form, the outputs must be those of
// the first repetition, byte for byte, and those the reference's.
TEST_P(CudaLowLatencyDeterminism, HundredRepetitionsAreBitIdentical) {
  const LlRepeatCase& c = GetParam();
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  const int64_t slots = c.ranks * c.tokens, l_count = c.experts / c.ranks;
  verify::ProblemSpec spec;
  spec.cfg = small_config(c.hidden, c.tokens, c.experts, c.topk, c.wire);
  spec.ranks = c.ranks;
  spec.seed = static_cast<uint64_t>(8100 + c.ranks * 13 + c.hidden + static_cast<int>(c.wire));
  spec.unused_slot_fraction = 0.1;
  const verify::Problem p = verify::make_problem(spec);
  std::vector<int64_t> counts(c.ranks);
  std::vector<std::vector<uint16_t>> ys(c.ranks);
  for (int r = 0; r < c.ranks; ++r) {
    counts[r] = c.tokens - 3 - 2 * r;
    ys[r] = verify::random_bf16(l_count * slots * c.hidden, 900 + r);
  }
  std::vector<LowLatencyDispatchResult> got(c.ranks);
  std::vector<Tensor> outs(c.ranks);
  std::vector<std::string> mismatches(c.ranks);
  const CudaWorld world = c.shared ? CudaWorld::shared_gpu(c.ranks, 0) : CudaWorld(std::vector<int>{0});
  const std::vector<std::string> errors = verify::run_threads(c.ranks, [&](int r) {
    const Group g = world.group(r);
    const int dev = cuda_device(g);
    cudaSetDevice(dev);
    const verify::RankInput& in = p.inputs[r];
    DeviceArray x(in.x), idx(in.idx), w(in.weights), y(ys[r]),
        count(std::vector<int32_t>{static_cast<int32_t>(counts[r])});  // before the buffer, freed after it
    LowLatencyBuffer b(g, LowLatencyConfig{c.hidden, c.tokens, c.experts, c.topk, c.wire, 10000});
    const TensorView weights = device_view(w, DType::f32, {c.tokens, c.topk}, dev);
    Outputs first;
    for (int rep = 0; rep < kRepetitions; ++rep) {
      const bool fused = rep / 25 % 2 == 1, weights_at_dispatch = rep >= 50;
      Outputs now;
      LowLatencyDispatchResult host;
      Tensor out;
      try {
        LowLatencyDispatchInput d;
        d.x = device_view(x, DType::bf16, {c.tokens, c.hidden}, dev);
        d.topk_idx = device_view(idx, DType::i32, {c.tokens, c.topk}, dev);
        d.num_tokens = device_view(count, DType::i32, {1}, dev);
        if (weights_at_dispatch) d.topk_weights = weights;
        LowLatencyDispatchResult res;
        if (fused) {
          res = b.dispatch(d);
        } else {
          b.dispatch_send(d);
          res = b.dispatch_recv();
        }
        // On one GPU no rank queues a kernel behind its own waiting one (docs/cuda.md, hold-back).
        if (c.shared) b.synchronize();
        LowLatencyCombineInput ci;
        ci.y = device_view(y, DType::bf16, {l_count, slots, c.hidden}, dev);
        if (!weights_at_dispatch) ci.topk_weights = weights;
        Tensor combined;
        if (fused) {
          combined = b.combine(ci, res.handle);
        } else {
          b.combine_send(ci, res.handle);
          combined = b.combine_recv();
        }
        b.synchronize();
        host = ll_to_host(res);  // before the set comes round again
        out = epx::to_host(combined);
      } catch (const Error& e) {
        throw Error(e.code(), "repetition " + std::to_string(rep) + ": " + e.what());
      }
      add_ll_dispatch(now, host);
      now.add("ll_combine out", out);
      if (rep == 0) {
        got[r] = host;
        outs[r] = out;
        first = std::move(now);
      } else if (mismatches[r].empty()) {
        const std::string diff = first.first_difference(now);
        if (!diff.empty())
          mismatches[r] = "repetition " + std::to_string(rep) + " (set " + std::to_string(rep % 2) +
                          (fused ? ", fused" : ", split") +
                          (weights_at_dispatch ? ", weights at dispatch" : ", weights at combine") + "): " + diff;
      }
    }
  });
  for (int r = 0; r < c.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int r = 0; r < c.ranks; ++r) {  // the first repetition against the reference
    EXPECT_EQ(verify::check_ll_dispatch(p, counts, r, 0.0f, got[r]), "") << "rank " << r;
    EXPECT_EQ(verify::check_ll_combine(p, counts, ys, r, true, outs[r], "ll_combine out"), "") << "rank " << r;
  }
  for (int r = 0; r < c.ranks; ++r) EXPECT_EQ(mismatches[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLowLatencyDeterminism,
                         testing::Values(LlRepeatCase{false, 1, 1024, 64, 16, 4, W::bf16},
                                         LlRepeatCase{false, 1, 1024, 64, 16, 4, W::fp8},
                                         LlRepeatCase{false, 1, 1024, 32, 16, 4, W::nvfp4},
                                         LlRepeatCase{true, 2, 1024, 32, 16, 4, W::bf16},
                                         LlRepeatCase{true, 2, 1024, 32, 16, 4, W::fp8}),
                         ll_repeat_case_name);

// ---- A rank that stops mid-call ----

constexpr int64_t kStopTimeoutMs = 2000;
// A timeout must be raised within its timeout and this much more (launches, the call's other steps).
constexpr int64_t kMarginMs = 3000;
// Longer than any body of these tests takes with epx working (a few timeouts): past it the test
// binary stops with a message instead of hanging.
constexpr auto kWatchdog = std::chrono::seconds(90);

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// Per rank, device copies of its inputs and of a y (rows for combine), made on the test's thread
// before any buffer and freed after every buffer: a cudaFree while a peer is inside a call waits for
// the peer's kernels and holds back every other thread's launches (docs/cuda.md).
struct RankArrays {
  DeviceArray x, idx, weights, y;
};

// What a call threw.
struct Thrown {
  bool thrown = false;
  ErrorCode code = ErrorCode::internal;
  std::string message;
  double ms = 0.0;  // from the call to the throw
};

template <typename Call>
Thrown thrown_by(Call call) {
  Thrown t;
  const auto start = std::chrono::steady_clock::now();
  try {
    call();
  } catch (const Error& e) {
    t.thrown = true;
    t.code = e.code();
    t.message = e.what();
  }
  t.ms = ms_since(start);
  return t;
}

// Two ranks on one GPU, where rank 1 stops: `peer` runs on rank 1's thread (its calls before it
// stops), then that thread ends without another call while rank 1's buffer lives on, idle, as the
// window of a process whose host hung or died after its last launch would. `survivor` runs on rank
// 0's thread. Once the survivor is done, both buffers go at once, rank 1's from this thread: each
// buffer's destructor waits (up to its timeout) for every rank to release the window
// (SymmetricWindow::await_peers_release), so neither waits out its timeout. Returns each rank's
// exception message ("" if none; the bodies catch what they expect themselves).
template <typename Buf, typename Cfg>
std::array<std::string, 2> run_with_stopping_peer(const Cfg& cfg, const verify::Problem& p, int64_t y_elems,
                                                  const std::function<void(Buf&, const RankArrays&)>& peer,
                                                  const std::function<void(Buf&, const RankArrays&)>& survivor) {
  const CudaWorld world = CudaWorld::shared_gpu(2, 0);
  cudaSetDevice(0);
  std::array<RankArrays, 2> arrays;
  for (int r = 0; r < 2; ++r) {
    arrays[r].x = DeviceArray(p.inputs[r].x);
    arrays[r].idx = DeviceArray(p.inputs[r].idx);
    arrays[r].weights = DeviceArray(p.inputs[r].weights);
    arrays[r].y = DeviceArray(verify::random_bf16(y_elems, 500 + r));
  }
  std::array<std::string, 2> errors;
  std::array<std::optional<Buf>, 2> buffers;
  std::array<std::promise<void>, 2> done;
  std::array<std::future<void>, 2> finished{done[0].get_future(), done[1].get_future()};
  auto body = [&](int r) {
    try {
      cudaSetDevice(0);
      buffers[r].emplace(world.group(r), cfg);
      (r == 0 ? survivor : peer)(*buffers[r], arrays[r]);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
    done[r].set_value();
    if (r == 0) buffers[0].reset();  // meets rank 1's release, made below
  };
  std::thread survivor_thread(body, 0), peer_thread(body, 1);
  const auto deadline = std::chrono::steady_clock::now() + kWatchdog;
  for (int r = 0; r < 2; ++r)
    if (finished[r].wait_until(deadline) != std::future_status::ready) {
      std::fprintf(stderr, "%s: rank %d is still inside epx after %lld s (a wait without a timeout?); stopping\n",
                   testing::UnitTest::GetInstance()->current_test_info()->name(), r,
                   static_cast<long long>(kWatchdog.count()));
      std::fflush(nullptr);
      std::abort();
    }
  peer_thread.join();  // rank 1's thread has ended; its buffer has not
  buffers[1].reset();
  survivor_thread.join();
  return errors;
}

verify::Problem two_rank_problem(const BufferConfig& cfg, uint64_t seed) {
  verify::ProblemSpec spec;
  spec.cfg = cfg;
  spec.ranks = 2;
  spec.seed = seed;
  return verify::make_problem(spec);
}

BufferConfig stop_config(WireFormat wire) {
  BufferConfig cfg = small_config(1024, 64, 16, 4, wire);
  cfg.timeout_ms = kStopTimeoutMs;
  cfg.num_sms = 4;
  return cfg;
}

DispatchInput dispatch_input(const BufferConfig& cfg, const RankArrays& a) {
  DispatchInput in;
  in.x = device_view(a.x, DType::bf16, {cfg.max_tokens_per_rank, cfg.hidden}, 0);
  in.topk_idx = device_view(a.idx, DType::i32, {cfg.max_tokens_per_rank, cfg.topk}, 0);
  in.topk_weights = device_view(a.weights, DType::f32, {cfg.max_tokens_per_rank, cfg.topk}, 0);
  return in;
}

CombineInput combine_input(const BufferConfig& cfg, const RankArrays& a, const DispatchResult& d) {
  return {device_view(a.y, DType::bf16, {d.recv_x.size(0), cfg.hidden}, 0), {}};
}

// Two good rounds of dispatch -> combine (calls #0 to #3), then rank 1's thread ends: rank 0's
// dispatch #4 waits for rank 1's plan and gives up after the timeout, naming the call, the step and
// rank 1; the buffer is broken from then on. (CudaErrors.AMissingPeerTimesOutInsteadOfHanging has a
// peer that never makes a call at all.)
TEST(CudaStoppedPeer, ADispatchAfterEarlierGoodCallsTimesOutNamingCallStepAndRank) {
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  constexpr int kGoodRounds = 2;
  const BufferConfig cfg = stop_config(WireFormat::bf16);
  const verify::Problem p = two_rank_problem(cfg, 61);
  DispatchResult last_good;
  Thrown timed_out, next_dispatch, next_combine;
  auto good_rounds = [&](Buffer& b, const RankArrays& a, DispatchResult* keep) {
    for (int round = 0; round < kGoodRounds; ++round) {
      DispatchResult d = b.dispatch(dispatch_input(cfg, a));
      b.synchronize();
      b.combine(combine_input(cfg, a, d), d.handle, {true});
      b.synchronize();
      if (keep && round == kGoodRounds - 1) *keep = d;
    }
  };
  const auto errors = run_with_stopping_peer<Buffer>(
      cfg, p, rows_bound(p) * cfg.hidden, [&](Buffer& b, const RankArrays& a) { good_rounds(b, a, nullptr); },
      [&](Buffer& b, const RankArrays& a) {
        DispatchResult d;
        good_rounds(b, a, &d);
        last_good = to_host(d);
        timed_out = thrown_by([&] { b.dispatch(dispatch_input(cfg, a)); });
        next_dispatch = thrown_by([&] { b.dispatch(dispatch_input(cfg, a)); });
        next_combine = thrown_by([&] { b.combine(combine_input(cfg, a, d), d.handle, {true}); });
      });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_EQ(verify::check_dispatch(p, verify::kept_routing(p), 0, Layout::expert_major, 0.0f, last_good), "");
  ASSERT_TRUE(timed_out.thrown) << "rank 0's dispatch #4 returned although rank 1 never called it";
  EXPECT_EQ(timed_out.code, ErrorCode::timeout) << timed_out.message;
  EXPECT_THAT(timed_out.message,
              testing::HasSubstr("dispatch #4 (plan exchange): rank 0 waited 2000 ms for rank(s) 1, which never arrived"));
  EXPECT_GE(timed_out.ms, 0.9 * kStopTimeoutMs) << "it gave up before its timeout: " << timed_out.message;
  EXPECT_LT(timed_out.ms, kStopTimeoutMs + kMarginMs) << timed_out.message;
  // Broken: later calls fail at once, naming the first failure.
  EXPECT_EQ(next_dispatch.code, ErrorCode::peer_failed) << next_dispatch.message;
  EXPECT_THAT(next_dispatch.message,
              testing::HasSubstr("dispatch #5 (rank 0): the group already failed: dispatch #4 (plan exchange)"));
  EXPECT_EQ(next_combine.code, ErrorCode::peer_failed) << next_combine.message;
  EXPECT_THAT(next_combine.message, testing::HasSubstr("combine #5 (rank 0): the group already failed"));
  EXPECT_LT(next_dispatch.ms + next_combine.ms, 1000.0);
}

// Rank 1 dispatches (after one good round) and stops before the combine: rank 0's dispatch #2
// completes with rank 1's rows, its combine #3 waits for rank 1's plan and gives up, naming the
// combine, the step and rank 1; then its dispatch_backward on that dispatch fails at once.
TEST(CudaStoppedPeer, ACombineWhoseDispatchThePeerMadeTimesOutNamingCallStepAndRank) {
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  const BufferConfig cfg = stop_config(WireFormat::fp8);
  const verify::Problem p = two_rank_problem(cfg, 62);
  const DispatchOptions rank_major{Layout::rank_major, 0.0f};
  DispatchResult dispatched;
  Thrown timed_out, next_call;
  auto good_round = [&](Buffer& b, const RankArrays& a) {
    DispatchResult d = b.dispatch(dispatch_input(cfg, a), rank_major);
    b.synchronize();
    b.combine(combine_input(cfg, a, d), d.handle, {false});
    b.synchronize();
  };
  const auto errors = run_with_stopping_peer<Buffer>(
      cfg, p, rows_bound(p) * cfg.hidden,
      [&](Buffer& b, const RankArrays& a) {
        good_round(b, a);
        b.dispatch(dispatch_input(cfg, a), rank_major);
        b.synchronize();  // and no combine
      },
      [&](Buffer& b, const RankArrays& a) {
        good_round(b, a);
        DispatchResult d = b.dispatch(dispatch_input(cfg, a), rank_major);
        b.synchronize();
        dispatched = to_host(d);
        timed_out = thrown_by([&] { b.combine(combine_input(cfg, a, d), d.handle, {false}); });
        next_call = thrown_by([&] {
          b.dispatch_backward({device_view(a.y, DType::bf16, {d.recv_x.size(0), cfg.hidden}, 0), {}}, d.handle);
        });
      });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_EQ(verify::check_dispatch(p, verify::kept_routing(p), 0, Layout::rank_major, 0.0f, dispatched), "");
  ASSERT_TRUE(timed_out.thrown) << "rank 0's combine #3 returned although rank 1 never called it";
  EXPECT_EQ(timed_out.code, ErrorCode::timeout) << timed_out.message;
  EXPECT_THAT(timed_out.message,
              testing::HasSubstr("combine #3 (plan exchange): rank 0 waited 2000 ms for rank(s) 1, which never arrived"));
  EXPECT_GE(timed_out.ms, 0.9 * kStopTimeoutMs) << "it gave up before its timeout: " << timed_out.message;
  EXPECT_LT(timed_out.ms, kStopTimeoutMs + kMarginMs) << timed_out.message;
  EXPECT_EQ(next_call.code, ErrorCode::peer_failed) << next_call.message;
  EXPECT_THAT(next_call.message,
              testing::HasSubstr("dispatch_backward #4 (rank 0): the group already failed: combine #3 (plan exchange)"));
  EXPECT_LT(next_call.ms, 1000.0);
}

// ---- A low-latency rank that stops mid-call ----

// Whether `message` names `call` ("ll_combine #0") and its step, in the form of the
// high-throughput messages: the call, then the step in parentheses ("dispatch #4 (plan exchange)").
// The rank a message comes from ("ll_dispatch #1 (rank 0): ...") is not a step.
testing::AssertionResult names_call_and_step(const std::string& message, const std::string& call) {
  const std::string opening = call + " (";
  for (size_t at = message.find(opening); at != std::string::npos; at = message.find(opening, at + 1))
    if (message.compare(at + opening.size(), 5, "rank ") != 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "the message does not name the call that timed out with its step, as '" << call
                                     << " (<step>)': " << message;
}

LowLatencyConfig ll_stop_config() { return LowLatencyConfig{512, 32, 16, 4, WireFormat::bf16, kStopTimeoutMs}; }

verify::Problem ll_two_rank_problem(const LowLatencyConfig& c, uint64_t seed) {
  return two_rank_problem(small_config(c.hidden, c.max_tokens_per_rank, c.num_experts, c.topk, c.wire), seed);
}

LowLatencyDispatchInput ll_input(const LowLatencyConfig& c, const RankArrays& a, bool weights) {
  LowLatencyDispatchInput in;
  in.x = device_view(a.x, DType::bf16, {c.max_tokens_per_rank, c.hidden}, 0);
  in.topk_idx = device_view(a.idx, DType::i32, {c.max_tokens_per_rank, c.topk}, 0);
  if (weights) in.topk_weights = device_view(a.weights, DType::f32, {c.max_tokens_per_rank, c.topk}, 0);
  return in;
}

LowLatencyCombineInput ll_combine_input(const LowLatencyConfig& c, const RankArrays& a, bool weights) {
  LowLatencyCombineInput in;
  in.y = device_view(a.y, DType::bf16, {c.num_experts / 2, 2 * c.max_tokens_per_rank, c.hidden}, 0);
  if (weights) in.topk_weights = device_view(a.weights, DType::f32, {c.max_tokens_per_rank, c.topk}, 0);
  return in;
}

int64_t ll_y_elems(const LowLatencyConfig& c) { return c.num_experts / 2 * 2 * c.max_tokens_per_rank * c.hidden; }

// Rank 1 launches its ll_dispatch's send half and never its receive half (nor anything else). Rank
// 0's dispatch_recv completes (rank 1's rows came); its ll_combine #0 waits for rank 1, which never
// sends, and gives up after the timeout. Low-latency calls do not wait for the device, so the next
// call raises it: the call that timed out, its step and rank 1 named; later calls: peer_failed.
// weights_at_dispatch: the combine's weights go with each rank's dispatch, so rank 0 waits only in
// its combine's receive half; else they go with the combines, and rank 0's send half first waits
// for rank 1's weights.
void ll_peer_never_receives(bool weights_at_dispatch) {
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  const LowLatencyConfig cfg = ll_stop_config();
  const verify::Problem p = ll_two_rank_problem(cfg, weights_at_dispatch ? 71 : 72);
  LowLatencyDispatchResult received;
  double combine_ms = 0.0;
  Thrown raised, after;
  const auto errors = run_with_stopping_peer<LowLatencyBuffer>(
      cfg, p, ll_y_elems(cfg),
      [&](LowLatencyBuffer& b, const RankArrays& a) { b.dispatch_send(ll_input(cfg, a, weights_at_dispatch)); },
      [&](LowLatencyBuffer& b, const RankArrays& a) {
        b.dispatch_send(ll_input(cfg, a, weights_at_dispatch));
        const LowLatencyDispatchResult d = b.dispatch_recv();
        b.synchronize();
        received = ll_to_host(d);
        const auto start = std::chrono::steady_clock::now();
        b.combine_send(ll_combine_input(cfg, a, !weights_at_dispatch), d.handle);
        b.combine_recv();
        b.synchronize();
        combine_ms = ms_since(start);
        raised = thrown_by([&] { b.dispatch_send(ll_input(cfg, a, weights_at_dispatch)); });
        after = thrown_by([&] { b.dispatch_send(ll_input(cfg, a, weights_at_dispatch)); });
      });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  const std::vector<int64_t> all(2, cfg.max_tokens_per_rank);
  EXPECT_EQ(verify::check_ll_dispatch(p, all, 0, 0.0f, received), "") << "rank 0's dispatch_recv";
  EXPECT_GE(combine_ms, 0.9 * kStopTimeoutMs) << "rank 0's combine did not wait for rank 1";
  // Weights with the combine: the send half waits for rank 1's weights, then the receive half waits
  // for rank 1 again (its wait does not stop at the call's first failure), hence up to two timeouts.
  EXPECT_LT(combine_ms, (weights_at_dispatch ? 1 : 2) * kStopTimeoutMs + kMarginMs);
  ASSERT_TRUE(raised.thrown) << "rank 0's call after its timed-out combine raised nothing";
  EXPECT_EQ(raised.code, ErrorCode::timeout) << raised.message;
  EXPECT_THAT(raised.message, testing::HasSubstr("waited 2000 ms for rank 1, which never arrived"));
  EXPECT_TRUE(names_call_and_step(raised.message, "ll_combine #0"));
  EXPECT_EQ(after.code, ErrorCode::peer_failed) << after.message;
  EXPECT_THAT(after.message, testing::HasSubstr("the low-latency buffer already failed"));
}

TEST(CudaLowLatencyStoppedPeer, APeerThatNeverReceivesTimesOutTheCombineNamingCallStepAndRank) {
  ll_peer_never_receives(true);
}

TEST(CudaLowLatencyStoppedPeer, APeerThatNeverReceivesTimesOutTheCombineWaitingForItsWeights) {
  ll_peer_never_receives(false);
}

// Three good rounds (both buffer sets), then rank 1 never launches its next dispatch_send: rank 0's
// ll_dispatch #3 (split) gives up in its receive half; its next call raises that, naming the call,
// the step and rank 1; the buffer refuses the calls after. (CudaLowLatencyErrors.
// AMissingPeerTimesOutInsteadOfHanging has a peer that never makes a call at all.)
TEST(CudaLowLatencyStoppedPeer, ADispatchAfterEarlierGoodRoundsTimesOutNamingCallStepAndRank) {
  if (!cuda_available()) GTEST_SKIP() << "needs a GPU";
  constexpr int kGoodRounds = 3;
  const LowLatencyConfig cfg = ll_stop_config();
  const verify::Problem p = ll_two_rank_problem(cfg, 73);
  double dispatch_ms = 0.0;
  Thrown raised, after;
  auto good_rounds = [&](LowLatencyBuffer& b, const RankArrays& a) {
    for (int round = 0; round < kGoodRounds; ++round) {
      b.dispatch_send(ll_input(cfg, a, false));
      const LowLatencyDispatchResult d = b.dispatch_recv();
      b.synchronize();  // on one GPU no rank queues a kernel behind its own waiting one
      b.combine_send(ll_combine_input(cfg, a, true), d.handle);
      b.combine_recv();
      b.synchronize();
    }
  };
  const auto errors = run_with_stopping_peer<LowLatencyBuffer>(
      cfg, p, ll_y_elems(cfg), good_rounds, [&](LowLatencyBuffer& b, const RankArrays& a) {
        good_rounds(b, a);
        const auto start = std::chrono::steady_clock::now();
        b.dispatch_send(ll_input(cfg, a, false));
        const LowLatencyDispatchResult d = b.dispatch_recv();
        b.synchronize();
        dispatch_ms = ms_since(start);
        raised = thrown_by([&] { b.dispatch_send(ll_input(cfg, a, false)); });
        after = thrown_by([&] { b.combine_send(ll_combine_input(cfg, a, true), d.handle); });
      });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  EXPECT_GE(dispatch_ms, 0.9 * kStopTimeoutMs) << "rank 0's dispatch did not wait for rank 1";
  EXPECT_LT(dispatch_ms, kStopTimeoutMs + kMarginMs);
  ASSERT_TRUE(raised.thrown) << "rank 0's call after its timed-out dispatch raised nothing";
  EXPECT_EQ(raised.code, ErrorCode::timeout) << raised.message;
  EXPECT_THAT(raised.message, testing::HasSubstr("waited 2000 ms for rank 1, which never arrived"));
  EXPECT_TRUE(names_call_and_step(raised.message, "ll_dispatch #3"));
  EXPECT_EQ(after.code, ErrorCode::peer_failed) << after.message;
  EXPECT_THAT(after.message, testing::HasSubstr("ll_combine #3 (rank 0): the low-latency buffer already failed"));
}

}  // namespace
}  // namespace epx::test
