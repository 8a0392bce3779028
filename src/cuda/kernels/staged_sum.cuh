// Weighted row sums whose terms come through the warp's stage in shared memory (bulk_copy.cuh),
// used as a ring of kStageSlots 2 KiB slots (CpAsyncRing): every lane keeps its 16-byte vectors of
// the next kStageSlots (slice, term) loads in flight with cp.async, adds the oldest once in, and
// refills its slot with the load kStageSlots ahead; 14 KiB per warp stay in flight without
// registers. The bulk-copy (TMA) engine was the first form: it moved ~50 GB/s per SM where plain
// loads move ~100 (docs/lab/2026-12-01-performance-diary.md).
#pragma once
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/cp_async.cuh"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail {

static_assert(kSumUnroll * 32 * 16 == kSlotBytes, "a slot holds kSumUnroll vectors per lane");

// The same sums as sum_rows_wide (fp32 from 0 in term order, fma with the weight when weighted)
// for n <= 32 terms whose rows are 16-byte aligned, handed to store(v, acc, on) as sum_rows_wide
// hands them (every lane calls it; on: vector v is in the row). term(i, row, weight) is called by
// lane i only. The rows may have been written by other GPUs or the copy engines: the caller
// acquired the flags that cover them.
template <typename Term, typename Store>
__device__ void sum_rows_staged_to(int n, Term term, bool weighted, int64_t hidden, int lane, Store store) {
  char* const stage = warp_bulk_stage().buf;
  const uint16_t* my_row = nullptr;
  float my_weight = 0.0f;
  const bool present = lane < n && term(lane, my_row, my_weight);
  const unsigned terms = __ballot_sync(0xffffffffu, present);  // in term order, lowest first
  const int count = __popc(terms);
  // Lane g holds the g-th present term's row and weight (1 unweighted: fma(1, v, acc) = acc + v).
  const int from = lane < count ? static_cast<int>(__fns(terms, 0, lane + 1)) : 0;
  const char* row = shfl_ptr(my_row, from);
  const float weight = weighted ? __shfl_sync(0xffffffffu, my_weight, from) : 1.0f;
  const int row_bytes = static_cast<int>(hidden * 2);
  const int slot_bytes = static_cast<int>(kSlotBytes);
  const int slices = (row_bytes + slot_bytes - 1) / slot_bytes;
  const int items = slices * count;  // loads, slice by slice, each slice's terms in order
  int issue_slice = 0, issue_term = 0;
  // This lane's vectors of the next load (slice by slice, each slice's terms in order).
  auto load = [&](char* slot) {
    const int at = issue_slice * slot_bytes + lane * 16;  // this lane's first vector in the row
    const char* src = shfl_ptr(row, issue_term) + at;
    char* dst = slot + lane * 16;
    const int left = row_bytes - at;  // bytes of the row from there on
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u)
      if (u * 32 * 16 < left) cp_async16(dst + u * 32 * 16, src + u * 32 * 16);
    if (++issue_term == count) issue_term = 0, ++issue_slice;
  };
  CpAsyncRing<kStageSlots> ring(stage, slot_bytes, items);
  ring.fill(load);
  float acc[kSumUnroll][8] = {};
  int term_at = 0, slice_at = 0;
  for (int item = 0; item < items; ++item) {
    const float w = __shfl_sync(0xffffffffu, weight, term_at);
    const int4* in = reinterpret_cast<const int4*>(ring.oldest());
    // The lane's whole slot, branch-free: past a short last slice the sums are of stale bytes
    // and are never stored.
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) fma_bf16x8(acc[u], in[u * 32 + lane], w);
    ring.refill(load);  // the load kStageSlots ahead, into the slot just read (by this lane only)
    if (++term_at == count) {  // the slice's last term: its sums are complete
      const int vectors = min(slot_bytes, row_bytes - slice_at * slot_bytes) / 16;
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        store(slice_at * (slot_bytes / 16) + u * 32 + lane, acc[u], u * 32 + lane < vectors);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[u][c] = 0.0f;
      }
      term_at = 0;
      ++slice_at;
    }
  }
  if (count == 0)  // no term: the sum from 0
    for (int64_t base = 0; base < row_bytes / 16; base += 32 * kSumUnroll)
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) store(base + u * 32 + lane, acc[u], base + u * 32 + lane < row_bytes / 16);
}

// sum_rows_staged_to rounded to bf16 into out (16-byte aligned).
template <typename Term>
__device__ void sum_rows_staged(int n, Term term, bool weighted, uint16_t* out, int64_t hidden, int lane) {
  sum_rows_staged_to(n, term, weighted, hidden, lane, [&](int64_t v, const float (&acc)[8], bool on) {
    if (on) reinterpret_cast<int4*>(out)[v] = pack_bf16x8(acc);
  });
}

}  // namespace epx::detail
