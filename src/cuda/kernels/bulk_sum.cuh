// Weighted row sums whose terms come through the warp's bulk-copy stage (bulk_copy.cuh), used as
// a ring of kStageSlots 2 KiB slots: lane 0 keeps the next kStageSlots (slice, term) loads in
// flight (one cp.async.bulk each, a slot and its mbarrier per load), every lane waits for the
// oldest slot, adds its 16-byte vectors of it from shared memory, and lane 0 refills the slot with
// the load kStageSlots ahead. So 14 KiB per warp stay in flight whatever the number of terms, with
// no round where the warp only waits or only adds (docs/performance.md).
#pragma once
#include "cuda/kernels/bulk_copy.cuh"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail {

static_assert(kSumUnroll * 32 * 16 == kSlotBytes, "a slot holds kSumUnroll vectors per lane");

// Whether sum_rows_bulk can take these rows: 16-byte aligned rows of a whole number of vectors.
__device__ inline bool bulk_summable(const uint16_t* out, int64_t hidden) { return hidden % 8 == 0 && aligned16(out); }

__device__ inline const char* shfl_ptr(const void* p, int from) {
  return reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(p), from));
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
  const int count = __popc(terms);
  // Lane g holds the g-th present term's row and weight (1 unweighted: fma(1, v, acc) = acc + v).
  const int from = lane < count ? static_cast<int>(__fns(terms, 0, lane + 1)) : 0;
  const char* row = shfl_ptr(my_row, from);
  const float weight = weighted ? __shfl_sync(0xffffffffu, my_weight, from) : 1.0f;
  const int row_bytes = static_cast<int>(hidden * 2);
  const int slices = static_cast<int>((row_bytes + kSlotBytes - 1) / kSlotBytes);
  const int items = slices * count;  // loads, slice by slice, each slice's terms in order
  auto bytes_of = [&](int slice) { return min(static_cast<int>(kSlotBytes), row_bytes - slice * static_cast<int>(kSlotBytes)); };
  // The bulk copies (async proxy) read global memory after the warp's generic acquires, and
  // write the slots after the lanes' generic reads of them in the warp's previous sum.
  if (lane == 0) ptx::fence_proxy_async();
  int issued = 0, issue_slice = 0, issue_term = 0;
  auto issue = [&](int slot) {  // the next load into `slot` (every lane calls it: the shuffle)
    const char* src = shfl_ptr(row, issue_term) + issue_slice * kSlotBytes;
    if (lane == 0) {
      const uint32_t bytes = static_cast<uint32_t>(bytes_of(issue_slice));
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, st.bar + slot, bytes);
      ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, st.buf + slot * kSlotBytes, src, bytes, st.bar + slot);
    }
    ++issued;
    if (++issue_term == count) issue_term = 0, ++issue_slice;
  };
  for (int slot = 0; slot < kStageSlots && issued < items; ++slot) issue(slot);
  uint32_t phases = *st.phase;
  float acc[kSumUnroll][8] = {};
  int slot = 0, term_at = 0, slice_at = 0;
  for (int item = 0; item < items; ++item) {
    while (!ptx::mbarrier_try_wait_parity(st.bar + slot, (phases >> slot) & 1u)) {
    }
    phases ^= 1u << slot;
    const float w = __shfl_sync(0xffffffffu, weight, term_at);
    const int4* in = reinterpret_cast<const int4*>(st.buf + slot * kSlotBytes);
    // The whole slot, branch-free: past a short last slice the sums are of stale bytes and are
    // never stored.
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) fma_bf16x8(acc[u], in[u * 32 + lane], w);
    if (issued < items) {
      // Every lane's reads of the slot are done before lane 0 has it written again (a release
      // and acquire among the lanes, as a consumer's mbarrier arrive is in a TMA pipeline). No
      // proxy fence here: fence.proxy.async waits for the warp's loads still in flight, which
      // made every load wait for the one before it (measured: 425 -> 683 us partials).
      __syncwarp();
      issue(slot);
    }
    if (++term_at == count) {  // the slice's last term: its sums are complete
      const int vectors = bytes_of(slice_at) / 16;
      int4* to = reinterpret_cast<int4*>(out + slice_at * (kSlotBytes / 2));
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        if (u * 32 + lane < vectors) to[u * 32 + lane] = pack_bf16x8(acc[u]);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[u][c] = 0.0f;
      }
      term_at = 0;
      ++slice_at;
    }
    slot = slot + 1 == kStageSlots ? 0 : slot + 1;
  }
  if (count == 0)  // no term: the sum from 0
    for (int v = lane; v < row_bytes / 16; v += 32) reinterpret_cast<int4*>(out)[v] = int4{0, 0, 0, 0};
  __syncwarp();  // every lane read the phases before lane 0 stores them
  if (lane == 0) *st.phase = phases;
  __syncwarp();
}

}  // namespace epx::detail
