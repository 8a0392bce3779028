// Weighted row sums whose terms come through the warp's bulk-copy stage (bulk_copy.cuh): lane 0
// loads a 2 KiB slice of up to 7 terms' rows into the stage with one cp.async.bulk each, every lane
// waits on the stage's mbarrier, then adds its 16-byte vectors of each slice from shared memory in
// term order. A warp keeps up to 14 KiB of loads in flight where the register loop of sum_rows keeps
// 2 KiB (one term's 4 vectors per lane), without more registers (docs/performance.md).
#pragma once
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail {

constexpr int64_t kBulkSliceBytes = 2048;  // of each term per round: 4 vectors of 16 bytes per lane
constexpr int kBulkTerms = static_cast<int>(kBulkStageBytes / kBulkSliceBytes);  // terms per round: 7
static_assert(kSumUnroll * 32 * 16 == kBulkSliceBytes, "a slice is kSumUnroll vectors per lane");

// Whether sum_rows_bulk can take these rows: 16-byte aligned rows of a whole number of vectors.
__device__ inline bool bulk_summable(const uint16_t* out, int64_t hidden) { return hidden % 8 == 0 && aligned16(out); }

constexpr int kFewTerms = kBulkTerms / 2;  // up to this many present terms: sum_few_rows_bulk

// Waits until the stage's loads of this round are in, then (fn) reads them; the phase moves on.
template <typename Read>
__device__ void consume_bulk_round(const BulkStage& st, int lane, Read fn) {
  const uint32_t phase = *st.phase;
  while (!cuda::ptx::mbarrier_try_wait_parity(st.bar, phase)) {
  }
  fn();
  __syncwarp();  // every lane saw this phase complete before lane 0 moves the phase word on
  if (lane == 0) *st.phase = phase ^ 1u;
}

// sum_rows_bulk for at most kFewTerms present terms (a rank-major reducer's: every rank's row of
// a token, then the shared expert's): a round loads `per` slices of every term at once (one bulk
// copy per term, 12-14 KiB in flight), so a slice's sum is complete within its round and no
// partial sums are carried from round to round. Same sums, same order.
__device__ inline void sum_few_rows_bulk(unsigned terms, const uint16_t* my_row, float my_weight, bool weighted,
                                         uint16_t* out, int64_t row_bytes, int lane) {
  namespace ptx = cuda::ptx;
  const BulkStage st = warp_bulk_stage();
  const int count = __popc(terms);
  const char* row[kFewTerms];
  float weight[kFewTerms];
  unsigned left = terms;
#pragma unroll
  for (int g = 0; g < kFewTerms; ++g) {  // the present terms in order, in every lane
    const int i = left ? __ffs(static_cast<int>(left)) - 1 : 0;
    row[g] = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_row), i));
    weight[g] = __shfl_sync(0xffffffffu, my_weight, i);
    left &= left - 1;
  }
  const int64_t span = kBulkTerms / count * kBulkSliceBytes;  // of each term per round
  for (int64_t at = 0; at < row_bytes; at += span) {
    const int64_t bytes = row_bytes - at < span ? row_bytes - at : span;
    __syncwarp();  // every lane's reads of the stage's previous round are done
    if (lane == 0) {
      ptx::fence_proxy_async(ptx::space_shared);  // those generic reads before the async writes
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, st.bar,
                                     static_cast<uint32_t>(count * bytes));
#pragma unroll
      for (int g = 0; g < kFewTerms; ++g)
        if (g < count)
          ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, st.buf + g * span, row[g] + at,
                             static_cast<uint32_t>(bytes), st.bar);
    }
    consume_bulk_round(st, lane, [&] {
      for (int64_t v = lane; v * 16 < bytes; v += 32) {
        float acc[8] = {};
#pragma unroll
        for (int g = 0; g < kFewTerms; ++g)
          if (g < count) fma_bf16x8(acc, reinterpret_cast<const int4*>(st.buf + g * span)[v], weighted ? weight[g] : 1.0f);
        reinterpret_cast<int4*>(out + at / 2)[v] = pack_bf16x8(acc);
      }
    });
  }
}

// The same sums as sum_rows (fp32 from 0 in term order, fma with the weight when weighted, bf16
// rounding at the end) for n <= 32 terms whose rows are 16-byte aligned. The warp's stage was
// set up by init_bulk_stage; term(i, row, weight) is called by lane i only. The rows may have been
// written by other GPUs or the copy engines: the caller acquired the flags that cover them.
template <typename Term>
__device__ void sum_rows_bulk(int n, Term term, bool weighted, uint16_t* out, int64_t hidden, int lane) {
  namespace ptx = cuda::ptx;
  const BulkStage st = warp_bulk_stage();
  const uint16_t* my_row = nullptr;
  float my_weight = 0.0f;
  const bool present = lane < n && term(lane, my_row, my_weight);
  const unsigned terms = __ballot_sync(0xffffffffu, present);  // in term order, lowest first
  const int64_t row_bytes = hidden * 2;
  // The bulk copies (async proxy) read global memory after the warp's generic acquires.
  if (lane == 0) ptx::fence_proxy_async(ptx::space_global);
  if (terms != 0 && __popc(terms) <= kFewTerms) {
    sum_few_rows_bulk(terms, my_row, my_weight, weighted, out, row_bytes, lane);
    return;
  }
  for (int64_t at = 0; at < row_bytes; at += kBulkSliceBytes) {
    const int64_t slice = row_bytes - at < kBulkSliceBytes ? row_bytes - at : kBulkSliceBytes;
    float acc[kSumUnroll][8] = {};
    for (unsigned left = terms; left != 0;) {
      // The next round's terms: up to kBulkTerms of the ones left, in order.
      unsigned round = 0;
      for (int g = 0; g < kBulkTerms && left != 0; ++g, left &= left - 1) round |= left & (0u - left);
      __syncwarp();  // every lane's reads of the stage's previous round are done
      if (lane == 0) {
        // Those generic reads of the stage come before the async proxy's writes to it.
        ptx::fence_proxy_async(ptx::space_shared);
        ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, st.bar,
                                       static_cast<uint32_t>(__popc(round) * slice));
      }
      int g = 0;
      for (unsigned r = round; r != 0; r &= r - 1, ++g) {
        const int i = __ffs(r) - 1;
        const char* row = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_row), i));
        if (lane == 0)
          ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, st.buf + g * kBulkSliceBytes, row + at,
                             static_cast<uint32_t>(slice), st.bar);
      }
      consume_bulk_round(st, lane, [&] {
        int t = 0;
        for (unsigned r = round; r != 0; r &= r - 1, ++t) {
          const float weight = weighted ? __shfl_sync(0xffffffffu, my_weight, __ffs(r) - 1) : 1.0f;
#pragma unroll
          for (int u = 0; u < kSumUnroll; ++u)
            if ((u * 32 + lane) * 16 < slice)
              fma_bf16x8(acc[u], reinterpret_cast<const int4*>(st.buf + t * kBulkSliceBytes)[u * 32 + lane], weight);
        }
      });
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const int64_t v = u * 32 + lane;
      if (v * 16 < slice) reinterpret_cast<int4*>(out + at / 2)[v] = pack_bf16x8(acc[u]);
    }
  }
}

}  // namespace epx::detail
