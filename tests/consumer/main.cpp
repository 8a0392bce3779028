// An installed epx from C++: a host world of 2 ranks (one thread each), one Buffer per rank,
// one weighted dispatch + combine with y = recv_x, so out[t] = x[t] * (sum of t's weights).
// Exits non-zero on any mismatch or error.
#include <epx/epx.hpp>
#ifdef EPX_HAS_CUDA
#include <epx/cuda.hpp>
#endif

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

namespace {

constexpr int kRanks = 2, kTokens = 6, kHidden = 64, kExperts = 4, kTopk = 2;
std::atomic<int> failures{0};
std::atomic<int64_t> rows_received{0};

void fail(int rank, const char* what) {
  std::printf("rank %d: %s\n", rank, what);
  ++failures;
}

float x_value(int rank, int t, int h) { return static_cast<float>(1 + (3 * t + h + rank) % 7); }
bool second_used(int t) { return t % 3 != 0; }  // tokens 0 and 3 use one expert only

void run_rank(const epx::HostWorld& world, int rank) {
  try {
    epx::BufferConfig cfg;
    cfg.hidden = kHidden;
    cfg.max_tokens_per_rank = kTokens;
    cfg.num_experts = kExperts;
    cfg.topk = kTopk;
    cfg.timeout_ms = 20000;
    epx::Buffer buffer(world.group(rank), cfg);

    std::vector<uint16_t> x(kTokens * kHidden);
    std::vector<int64_t> idx(kTokens * kTopk);
    std::vector<float> w(kTokens * kTopk);
    for (int t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kHidden; ++h) x[t * kHidden + h] = epx::float_to_bf16(x_value(rank, t, h));
      idx[t * kTopk] = (t + rank) % kExperts;
      idx[t * kTopk + 1] = second_used(t) ? (t + rank + 1) % kExperts : -1;
      w[t * kTopk] = 0.5f;
      w[t * kTopk + 1] = 0.25f;
    }
    epx::DispatchInput in;
    in.x = epx::TensorView::of(x.data(), epx::DType::bf16, {kTokens, kHidden});
    in.topk_idx = epx::TensorView::of(idx.data(), epx::DType::i64, {kTokens, kTopk});
    in.topk_weights = epx::TensorView::of(w.data(), epx::DType::f32, {kTokens, kTopk});
    epx::DispatchResult d = buffer.dispatch(in);
    if (d.recv_x.size(0) != d.num_rows) fail(rank, "recv_x rows differ from num_rows");
    rows_received += d.num_rows;

    epx::CombineInput cin;
    cin.y = d.recv_x.view();
    epx::CombineResult c = buffer.combine(cin, d.handle);  // weighted by default
    if (c.out.size(0) != kTokens || c.out.size(1) != kHidden) {
      fail(rank, "combine output has the wrong shape");
      return;
    }
    const uint16_t* out = c.out.data<uint16_t>();
    for (int t = 0; t < kTokens; ++t) {
      const float weight = second_used(t) ? 0.75f : 0.5f;
      for (int h = 0; h < kHidden; ++h) {
        const float want = weight * x_value(rank, t, h);
        if (out[t * kHidden + h] != epx::float_to_bf16(want)) {
          std::printf("rank %d: out[%d, %d] = %g, want %g\n", rank, t, h,
                      epx::bf16_to_float(out[t * kHidden + h]), want);
          ++failures;
          return;
        }
      }
    }
  } catch (const std::exception& e) {
    std::printf("rank %d: %s\n", rank, e.what());
    ++failures;
  }
}

}  // namespace

int main() {
  epx::HostWorld world(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) threads.emplace_back(run_rank, std::cref(world), r);
  for (auto& t : threads) t.join();

  int64_t pairs = 0;
  for (int t = 0; t < kTokens; ++t) pairs += second_used(t) ? 2 : 1;
  if (rows_received != kRanks * pairs) {
    std::printf("received %lld rows in all, want %lld\n", static_cast<long long>(rows_received.load()),
                static_cast<long long>(kRanks * pairs));
    ++failures;
  }
#ifdef EPX_HAS_CUDA
  // The CUDA half of the library links and answers (false on a machine without a GPU).
  std::printf("cuda_available: %d\n", epx::cuda_available() ? 1 : 0);
#endif
  std::printf("epx consumer (C++): %s\n", failures ? "FAIL" : "OK");
  return failures ? 1 : 0;
}
