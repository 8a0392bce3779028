// Redundant experts (EPLB) on the device: the per-call replica table checked (the first
// violation in row-major order, in the CPU backend's words: src/core/replicas.cpp) and hashed by
// one block, and the choice rule
// of docs/semantics.md ("Redundant experts (EPLB)") per (token, slot), which needs no state: the
// candidates of a logical expert are found again in its table row each time (W is small).
#pragma once
#include <climits>

#include "cuda/kernels/device_common.cuh"

namespace epx::detail {

// Entry [e][j] of the table (rows t.stride apart).
__device__ inline int32_t entry_of(const ReplicaTable& t, int64_t e, int64_t j) { return t.table[e * t.stride + j]; }

// The row-major order of the table's violations: entry i's own (out of range, a repeat) at 2i,
// row e's (no entry) at 2(e W + W - 1) + 1, after the row's last entry, where the CPU finds it.
__device__ inline int64_t entry_key(int64_t entry) { return 2 * entry; }
__device__ inline int64_t row_key(int64_t row, int64_t width) { return 2 * (row * width + width - 1) + 1; }

// splitmix64's finalizer: each entry's (index, value) into 64 well-mixed bits, summed, so that
// the hash is that of the whole table whatever the order the threads add in.
__device__ inline uint64_t entry_hash(int64_t entry, int32_t value) {
  uint64_t z = (static_cast<uint64_t>(entry) << 32 | static_cast<uint32_t>(value)) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// One block (every thread; a whole number of warps): checks the table (each row an entry at least, entries -1 or in
// [0, P), no physical id twice), reports the first violation in row-major order, and writes the
// table's hash into *hash for the plan exchange, which compares it across ranks. t.seen: P words
// of scratch, the first entry naming each id.
__device__ inline void check_replica_table_block(const ReplicaTable& t, int32_t rank, uint64_t* hash,
                                                 DeviceStatus* st) {
  __shared__ unsigned long long sum;
  __shared__ long long first_bad;
  const int64_t entries = t.logical * t.width;
  if (threadIdx.x == 0) sum = 0, first_bad = LLONG_MAX;
  for (int64_t p = threadIdx.x; p < t.physical; p += blockDim.x) t.seen[p] = INT32_MAX;
  __syncthreads();
  uint64_t mine = 0;  // this thread's entries' hashes, then its warp's: one shared add per warp
  for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) {
    const int32_t v = entry_of(t, i / t.width, i % t.width);
    mine += entry_hash(i, v);
    if (v >= 0 && v < t.physical) atomicMin(&t.seen[v], static_cast<int32_t>(i));
  }
  for (int offset = 16; offset > 0; offset /= 2) mine += __shfl_xor_sync(0xffffffffu, mine, offset);
  if (threadIdx.x % 32 == 0) atomicAdd(&sum, static_cast<unsigned long long>(mine));
  __syncthreads();
  for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) {
    const int32_t v = entry_of(t, i / t.width, i % t.width);
    const bool bad = v < -1 || v >= t.physical || (v >= 0 && t.seen[v] < i);
    if (bad) atomicMin(&first_bad, entry_key(i));
  }
  for (int64_t e = threadIdx.x; e < t.logical; e += blockDim.x) {
    bool any = false;
    for (int64_t j = 0; j < t.width && !any; ++j) any = entry_of(t, e, j) != -1;
    if (!any) atomicMin(&first_bad, row_key(e, t.width));
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  *hash = sum;
  if (first_bad == LLONG_MAX) return;
  if (first_bad % 2 == 1) {
    report(st, kStatusReplicaEmptyRow, rank, (first_bad - 1) / 2 / t.width);
    return;
  }
  const int64_t i = first_bad / 2;
  const int32_t v = entry_of(t, i / t.width, i % t.width);
  if (v < -1 || v >= t.physical) report(st, kStatusReplicaOutOfRange, rank, i, v);
  else report(st, kStatusReplicaRepeated, rank, i, v, t.seen[v]);
}

// The physical expert serving logical expert e for token t of source rank `rank`: candidates[(t +
// rank) % n] of the row's entries on this rank if any, else of all its entries, in table order.
// Entries out of range are skipped (check_replica_table_block fails such a call), and a row with
// no candidate gives -1, so a bad table never sends a row to a rank that does not exist.
__device__ inline int32_t chosen_replica(const ReplicaTable& t, int32_t e, int64_t token, int32_t rank,
                                         int64_t per_rank) {
  const int32_t* row = t.table + e * t.stride;
  auto usable = [&](int32_t v) { return v >= 0 && v < t.physical; };
  int64_t all = 0, own = 0;
  for (int64_t j = 0; j < t.width; ++j) {
    const int32_t v = row[j];
    all += usable(v);
    own += usable(v) && v / per_rank == rank;
  }
  const int64_t n = own > 0 ? own : all;
  if (n == 0) return -1;
  int64_t want = (token + rank) % n;
  for (int64_t j = 0; j < t.width; ++j) {
    const int32_t v = row[j];
    if (!usable(v) || (own > 0 && v / per_rank != rank)) continue;
    if (want-- == 0) return v;
  }
  return -1;
}

}  // namespace epx::detail
