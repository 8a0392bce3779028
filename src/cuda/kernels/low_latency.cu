// Low-latency mode (docs/low-latency.md): every (token, expert) pair travels to the slot
// (local expert, source rank, token) of the expert rank's window, known without any count or
// plan, so the send half starts moving rows at once, one warp per pair. Each source also copies
// its checked routing and counts to every rank and then flags it; the receive half finds each
// expert's tokens in the routings and packs them in (source rank, token) order.
#include <cub/block/block_scan.cuh>

#include "cuda/kernels/ll_launch.hpp"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail::ll {

namespace {

constexpr int kWarps = 16;
constexpr int64_t kSendSpan = 2048;  // channels of a row one warp returns in combine_send
constexpr int64_t kSumSpan = 1024;   // channels of a token one warp sums in combine_recv
constexpr unsigned kAll = 0xffffffffu;

__device__ int64_t read_index(const Route& r, int64_t t, int64_t k) {
  return r.idx64 ? static_cast<const int64_t*>(r.topk_idx)[t * r.idx_stride + k]
                 : static_cast<const int32_t*>(r.topk_idx)[t * r.idx_stride + k];
}

// Rows that count this call: num_tokens read on the device, or T; a bad count is reported and
// nothing is sent.
__device__ int64_t token_count(const Ctx& c, const Route& r, bool reporter) {
  int64_t n = r.num_tokens ? *r.num_tokens : r.tokens;
  if (n < 0 || n > r.tokens) {
    if (reporter) report(c.status, kStatusBadTokenCount, c.peers.rank, n, r.tokens);
    n = 0;
  }
  return n;
}

// Pair (t, k)'s expert, or -1: unused, past the token count, out of range or a repeat of an
// earlier slot of the token (those two are reported; the first slot of a repeated expert keeps
// it). Every lane of the warp calls it; lanes hold slots lane and lane + 32 (K <= 64), so the
// token's ids are read in one step.
__device__ int32_t checked_expert(const Ctx& c, const Route& r, int64_t n, int64_t t, int k, int lane) {
  const int64_t lo = t < n && lane < c.topk ? read_index(r, t, lane) : -1;
  const int64_t hi = t < n && lane + 32 < c.topk ? read_index(r, t, lane + 32) : -1;
  const int64_t id = k < 32 ? __shfl_sync(kAll, lo, k) : __shfl_sync(kAll, hi, k - 32);
  if (id == -1) return -1;
  if (id < -1 || id >= c.experts) {
    if (lane == 0) report(c.status, kStatusBadExpert, c.peers.rank, t, k, id);
    return -1;
  }
  const unsigned before_lo = __ballot_sync(kAll, lane < k && lo == id);
  const unsigned before_hi = __ballot_sync(kAll, lane + 32 < k && hi == id);
  if (before_lo == 0 && before_hi == 0) return static_cast<int32_t>(id);
  if (lane == 0)
    report(c.status, kStatusRepeatedExpert, c.peers.rank, t, before_lo ? __ffs(before_lo) - 1 : 31 + __ffs(before_hi), id);
  return -1;
}

__device__ int64_t set_rows(const Ctx& c, int set) { return static_cast<int64_t>(set) * c.local * c.peers.ranks * c.max_tokens; }

__device__ uint64_t* flag_of(const Ctx& c, int owner, Kind kind, int set, int source) {
  return at_window<uint64_t>(c.peers, owner, c.map.flags) + (static_cast<int64_t>(kind) * 2 + set) * c.peers.ranks + source;
}

// True in every thread of the last block of the grid to finish (the counter is reset there, so
// it starts from 0 at the next launch). Each block fences its writes at GPU scope before it
// counts; the last block's system-scope fence before it flags the peers (flag_all) then orders
// every block's writes before the flag, fences being cumulative (PTX memory model). One
// system-scope fence per call instead of one per block.
__device__ bool last_block(uint32_t* done) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (last) *done = 0;
  }
  __syncthreads();
  return last;
}

// Sets this rank's flag at every rank: its rows (and counts) of this call are there.
__device__ void flag_all(const Ctx& c, Kind kind, int set) {
  if (threadIdx.x != 0) return;
  __threadfence_system();
  const int32_t code = *reinterpret_cast<volatile int32_t*>(&c.status->code);
  const uint64_t value = 1u | (static_cast<uint64_t>(code > 0 ? code : 0) << 8);
  for (int d = 0; d < c.peers.ranks; ++d) set_flag(flag_of(c, d, kind, set, c.peers.rank), value);
}

// Lanes 0..R-1 wait for every source's flag of this call; a flag with an error stops the call.
__device__ bool wait_sources(const Ctx& c, Kind kind, int set, int lane) {
  int ok = 1;
  if (lane < c.peers.ranks) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> f(*flag_of(c, c.peers.rank, kind, set, lane));
    const uint64_t start = globaltimer_ns();
    uint64_t v = 0;
    while ((v = f.load(cuda::memory_order_acquire)) == 0) {
      if (globaltimer_ns() - start > c.timeout_ns) {
        report(c.status, kStatusTimeout, lane, kind + 1);
        ok = 0;
        break;
      }
    }
    if (ok && (v >> 8) != 0) {
      if (lane != c.peers.rank) report(c.status, kStatusPeerRejected, lane, static_cast<int64_t>(v >> 8));
      ok = 0;
    }
  }
  ok = __all_sync(0xffffffffu, ok);
  __syncwarp();
  return ok != 0;
}

__device__ int64_t first_warp() { return blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; }
__device__ int64_t warps_in_grid() { return static_cast<int64_t>(gridDim.x) * kWarps; }

__device__ int64_t chunks_of(const Ctx& c) { return (c.max_tokens + kChunk - 1) / kChunk; }

// Send phase. Warp per (token, slot) pair: its wire row to slot (local expert, this rank * M +
// token) of the expert's rank; its checked expert id to every rank's copy of this rank's routing
// (receivers find each token's slot there). Pairs are counted per (expert, chunk of 32 tokens);
// the grid's last block sends the counts and the token count, then flags every rank.
__device__ void dispatch_send(const Ctx& c, int set, const Route& route, const Rows& rows, const Set& s) {
  const int lane = threadIdx.x % 32, rank = c.peers.rank;
  const bool first_thread = blockIdx.x == 0 && threadIdx.x == 0;
  const int64_t n = token_count(c, route, first_thread);
  if (first_thread) *s.num_tokens = static_cast<int32_t>(n);  // for combine_recv
  const int64_t slots = c.peers.ranks * c.max_tokens, chunks = chunks_of(c);
  const int64_t routes = c.map.routes + ((static_cast<int64_t>(set) * c.peers.ranks + rank) * c.max_tokens) * c.topk * 4;
  for (int64_t p = first_warp(); p < route.tokens * c.topk; p += warps_in_grid()) {
    const int64_t t = p / c.topk;
    const int32_t e = checked_expert(c, route, n, t, static_cast<int>(p % c.topk), lane);
    if (lane == 0) {
      s.slot_expert[p] = e;
      if (e >= 0) atomicAdd(&s.chunk_count[e * chunks + t / kChunk], 1);
    }
    if (t < n && lane < c.peers.ranks) at_window<int32_t>(c.peers, lane, routes)[p] = e;
    if (e < 0) continue;
    const int64_t slot = set_rows(c, set) + (e % c.local) * slots + rank * c.max_tokens + t;
    char* dst = at_window<char>(c.peers, static_cast<int>(e / c.local), c.map.rows + slot * c.map.payload_stride);
    const uint16_t* x = rows.x + t * rows.x_stride;
    if (c.wire == WireFormat::bf16) copy_row<true>(reinterpret_cast<const char*>(x), &dst, 1, 2 * c.hidden, lane);
    else if (c.wire == WireFormat::nvfp4) quantize_nvfp4_row(x, c.hidden, rows.nvfp4_global_scale, &dst, 1, lane);
    else quantize_fp8_row(x, c.hidden, c.wire == WireFormat::fp8_ue8m0, &dst, 1, lane);
  }
  if (!last_block(c.done + 0)) return;
  // The counts of destination d's experts are one contiguous run [d L chunks, (d + 1) L chunks);
  // they start from zero again at the next call.
  const int64_t run = c.local * chunks;
  for (int64_t i = threadIdx.x; i < c.experts * chunks; i += blockDim.x) {
    at_window<int32_t>(c.peers, static_cast<int>(i / run), c.map.counts)[(static_cast<int64_t>(set) * c.peers.ranks + rank) * run +
                                                                          i % run] = s.chunk_count[i];
    s.chunk_count[i] = 0;
  }
  if (threadIdx.x < c.peers.ranks)
    at_window<int32_t>(c.peers, threadIdx.x, c.map.ntok)[set * c.peers.ranks + rank] = static_cast<int32_t>(n);
  __syncthreads();
  flag_all(c, kDispatch, set);
}

// What this rank's window holds of one call (set) of dispatch: per source, its counts per
// (local expert, chunk of 32 tokens), its token count and its checked routing.
struct Arrived {
  const int32_t* counts;  // [R][L][chunks]
  const int32_t* ntok;    // [R]
  const int32_t* routes;  // [R][M][K]
};

__device__ Arrived arrived(const Ctx& c, int set) {
  const int64_t r = c.peers.ranks;
  return {at_window<const int32_t>(c.peers, c.peers.rank, c.map.counts) + set * r * c.local * chunks_of(c),
          at_window<const int32_t>(c.peers, c.peers.rank, c.map.ntok) + set * r,
          at_window<const int32_t>(c.peers, c.peers.rank, c.map.routes) + set * r * c.max_tokens * c.topk};
}

// Rows of local expert l from `source`'s chunks [0, chunks): one thread's sum, or (warp_rows_from)
// the warp's, each lane adding every 32nd chunk.
__device__ int32_t rows_from(const Ctx& c, const Arrived& a, int64_t l, int source, int64_t chunks) {
  const int32_t* v = a.counts + (source * c.local + l) * chunks_of(c);
  int32_t n = 0;
  for (int64_t q = 0; q < chunks; ++q) n += v[q];
  return n;
}

__device__ int32_t warp_rows_from(const Ctx& c, const Arrived& a, int64_t l, int source, int64_t chunks, int lane) {
  const int32_t* v = a.counts + (source * c.local + l) * chunks_of(c);
  int32_t n = 0;
  for (int64_t q = lane; q < chunks; q += 32) n += v[q];
  for (int o = 16; o > 0; o /= 2) n += __shfl_xor_sync(kAll, n, o);
  return n;
}

// Receive unit (l, source, chunk, part): the source's tokens [32 chunk, 32 chunk + 32) that
// chose local expert l, packed after the rows of earlier sources and chunks (from the counts);
// the unit's part of them (every pack_parts-th row) when experts are few and rows many.
__device__ void pack_chunk(const Ctx& c, int set, const Set& s, const Arrived& a, int64_t unit, int lane) {
  const int64_t chunks = chunks_of(c), slots = c.peers.ranks * c.max_tokens;
  const int part = static_cast<int>(unit % c.pack_parts);
  unit /= c.pack_parts;
  const int64_t l = unit / (c.peers.ranks * chunks), chunk = unit % chunks;
  const int source = static_cast<int>(unit / chunks % c.peers.ranks);
  if (a.counts[(source * c.local + l) * chunks + chunk] == 0) return;
  const int64_t n = a.ntok[source], t = chunk * kChunk + lane;
  const int32_t expert = static_cast<int32_t>(c.peers.rank * c.local + l);
  int k = -1;  // the slot of lane's token holding the expert
  if (t < n) {
    const int32_t* route = a.routes + (source * c.max_tokens + t) * c.topk;
    for (int k0 = 0; k0 < c.topk; k0 += 8) {  // 8 loads in flight at once
      int32_t id[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) id[i] = k0 + i < c.topk ? route[k0 + i] : -1;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (k < 0 && id[i] == expert) k = k0 + i;
    }
  }
  int64_t first = warp_rows_from(c, a, l, source, chunk, lane);
  for (int p = 0; p < source; ++p) first += warp_rows_from(c, a, l, p, chunks, lane);
  const unsigned held = __ballot_sync(kAll, k >= 0);
  int rank_in_chunk = 0;
  for (unsigned left = held; left != 0; left &= left - 1, ++rank_in_chunk) {
    if (rank_in_chunk % c.pack_parts != part) continue;  // another warp's row
    const int i = __ffs(left) - 1;
    const int64_t token = chunk * kChunk + i, u = l * slots + first + rank_in_chunk;
    const int32_t slot = __shfl_sync(kAll, k, i);
    const int64_t from = set_rows(c, set) + l * slots + source * c.max_tokens + token;
    const char* payload = at_window<const char>(c.peers, c.peers.rank, c.map.rows + from * c.map.payload_stride);
    char* x = s.recv_x + u * c.x_bytes;
    copy_row(payload, &x, 1, c.x_bytes, lane);
    if (s.recv_scales) {
      char* sc = s.recv_scales + u * c.scale_bytes;
      copy_row(payload + c.x_bytes, &sc, 1, c.scale_bytes, lane);
    }
    if (s.recv_global) {
      char* g = s.recv_global + u * 4;
      copy_row(payload + c.x_bytes + c.scale_bytes, &g, 1, 4, lane);
    }
    if (lane == 0) {
      s.recv_src[2 * u] = source;
      s.recv_src[2 * u + 1] = static_cast<int32_t>(token);
      s.src_rank[u] = source;
      s.src_token[u] = static_cast<int32_t>(token);
      s.src_slot[u] = slot;
    }
  }
}

// Clear unit (l, 32 output rows): rows at or past this call's count that held data at the
// previous dispatch on this set are zeroed.
__device__ void clear_chunk(const Ctx& c, const Set& s, const Arrived& a, int64_t unit, int lane) {
  const int64_t slots = c.peers.ranks * c.max_tokens, units = (slots + kChunk - 1) / kChunk;
  const int64_t l = unit / units, begin = unit % units * kChunk;
  const int64_t to = min(begin + kChunk, static_cast<int64_t>(s.prev_count[l]));
  if (to <= begin) return;
  int64_t count = 0;
  for (int p = 0; p < c.peers.ranks; ++p) count += warp_rows_from(c, a, l, p, chunks_of(c), lane);
  for (int64_t j = max(begin, count); j < to; ++j) {
    const int64_t u = l * slots + j;
    char* x = s.recv_x + u * c.x_bytes;
    zero_row(&x, 1, c.x_bytes, lane);
    if (s.recv_scales) {
      char* sc = s.recv_scales + u * c.scale_bytes;
      zero_row(&sc, 1, c.scale_bytes, lane);
    }
    if (s.recv_global) {
      char* g = s.recv_global + u * 4;
      zero_row(&g, 1, 4, lane);
    }
    if (lane == 0) s.recv_src[2 * u] = s.recv_src[2 * u + 1] = -1;
  }
}

// Receive phase. Warp per unit: every (local expert, source, chunk of tokens) to pack, then every
// (local expert, 32 output rows) to clear; a failed call packs and clears nothing. The grid's
// last block writes the counts, the layout and each expert's first row among all received rows
// (for combine_send), publishes the status and resets this set's flags.
__device__ void dispatch_recv(const Ctx& c, int set, const Set& s) {
  const int lane = threadIdx.x % 32;
  const bool ok = wait_sources(c, kDispatch, set, lane);
  const Arrived a = arrived(c, set);
  const int64_t slots = c.peers.ranks * c.max_tokens;
  const int64_t pack_units = c.local * c.peers.ranks * chunks_of(c) * c.pack_parts;
  const int64_t units = pack_units + c.local * ((slots + kChunk - 1) / kChunk);
  for (int64_t u = ok ? first_warp() : units; u < units; u += warps_in_grid()) {
    if (u < pack_units) pack_chunk(c, set, s, a, u, lane);
    else clear_chunk(c, s, a, u - pack_units, lane);
  }
  if (!last_block(c.done + 1)) return;
  using Scan = cub::BlockScan<int32_t, kWarps * 32>;
  __shared__ typename Scan::TempStorage scan;
  int32_t rows_before = 0;  // all experts' rows before this step of blockDim.x experts
  for (int64_t base = 0; base < c.local; base += blockDim.x) {
    const int64_t l = base + threadIdx.x;
    int32_t first = 0;
    for (int p = 0; l < c.local && p < c.peers.ranks; ++p) {
      const int32_t n = ok ? rows_from(c, a, l, p, chunks_of(c)) : 0;
      s.recv_layout[(l * c.peers.ranks + p) * 2] = first;
      s.recv_layout[(l * c.peers.ranks + p) * 2 + 1] = n;
      first += n;
    }
    int32_t before = 0, step = 0;
    Scan(scan).ExclusiveSum(first, before, step);
    if (l < c.local) {
      s.recv_count[l] = first;
      s.prev_count[l] = max(first, ok ? 0 : s.prev_count[l]);
      s.row_start[l] = rows_before + before;
    }
    rows_before += step;
    __syncthreads();  // the scan storage is reused
  }
  if (threadIdx.x == 0) {
    s.row_start[c.local] = rows_before;
    publish(c.status, c.host_status);  // the call's status, for the host's next call
  }
  if (threadIdx.x < c.peers.ranks) *flag_of(c, c.peers.rank, kDispatch, set, threadIdx.x) = 0;
}

// One launch for either phase or both (the fused call): a block done sending goes on to
// receive. With both, every block of the grid must be resident at once (one per SM at most).
__global__ void __launch_bounds__(kWarps * 32) dispatch_kernel(Ctx c, int phases, int set, Route route, Rows rows, Set s) {
  if (phases & kSendPhase) dispatch_send(c, set, route, rows, s);
  if (phases & kRecvPhase) dispatch_recv(c, set, s);
}

// The local expert whose rows hold received row g (counting all experts' rows in order): the
// last l with row_start[l] <= g.
__device__ int32_t expert_of_row(const Ctx& c, const int32_t* row_start, int32_t g) {
  int32_t lo = 0, hi = static_cast<int32_t>(c.local) - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (row_start[mid] <= g) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Send phase. Warp per (received row, kSendSpan channels): the expert's output back to its
// source's (token, slot) place. Units are numbered over the received rows only (32-bit math).
__device__ void combine_send(const Ctx& c, int set, const Set& d, const uint16_t* y) {
  const int lane = threadIdx.x % 32;
  const int64_t slots = c.peers.ranks * c.max_tokens;
  const int32_t spans = static_cast<int32_t>((c.hidden + kSendSpan - 1) / kSendSpan);
  const int32_t units = d.row_start[c.local] * spans;
  for (int32_t unit = static_cast<int32_t>(first_warp()); unit < units; unit += static_cast<int32_t>(warps_in_grid())) {
    const int32_t g = unit / spans, l = expert_of_row(c, d.row_start, g);
    const int64_t u = l * slots + (g - d.row_start[l]), h0 = static_cast<int64_t>(unit % spans) * kSendSpan;
    const int64_t at = ((static_cast<int64_t>(set) * c.max_tokens + d.src_token[u]) * c.topk + d.src_slot[u]) * c.hidden;
    char* dst = at_window<char>(c.peers, d.src_rank[u], c.map.ret + (at + h0) * 2);
    copy_row(reinterpret_cast<const char*>(y + u * c.hidden + h0), &dst, 1, 2 * min(kSendSpan, c.hidden - h0), lane);
  }
  if (!last_block(c.done + 2)) return;
  flag_all(c, kCombine, set);
}

// Receive phase. Warp per (token, kSumSpan channels): its returned rows in slot order (fma with
// the weight, or a plain sum), bf16; rows past the token count are zero.
__device__ void combine_recv(const Ctx& c, int set, const Set& d, const Sums& sums) {
  const int lane = threadIdx.x % 32;
  const bool ok = wait_sources(c, kCombine, set, lane);
  const int64_t n = ok ? *d.num_tokens : 0, spans = (c.hidden + kSumSpan - 1) / kSumSpan;
  const uint16_t* ret = at_window<const uint16_t>(c.peers, c.peers.rank, c.map.ret) +
                        static_cast<int64_t>(set) * c.max_tokens * c.topk * c.hidden;
  const bool wide = c.hidden % 8 == 0 && aligned16(sums.out);
  for (int64_t unit = first_warp(); unit < sums.tokens * spans; unit += warps_in_grid()) {
    const int64_t t = unit / spans, h0 = unit % spans * kSumSpan;
    sum_rows(static_cast<int>(c.topk), [&](int k, const uint16_t*& row, float& weight) {
      row = ret + (t * c.topk + k) * c.hidden + h0;
      weight = sums.weighted ? sums.weights[t * sums.weight_stride + k] : 1.0f;
      return t < n && d.slot_expert[t * c.topk + k] >= 0;
    }, sums.weighted, sums.out + t * c.hidden + h0, min(kSumSpan, c.hidden - h0), wide, lane);
  }
  if (!last_block(c.done + 3)) return;
  if (threadIdx.x == 0) publish(c.status, c.host_status);
  if (threadIdx.x < c.peers.ranks) *flag_of(c, c.peers.rank, kCombine, set, threadIdx.x) = 0;
}

// As dispatch_kernel: either phase, or both.
__global__ void __launch_bounds__(kWarps * 32) combine_kernel(Ctx c, int phases, int set, Set d, const uint16_t* y, Sums sums) {
  if (phases & kSendPhase) combine_send(c, set, d, y);
  if (phases & kRecvPhase) combine_recv(c, set, d, sums);
}

__global__ void reject_kernel(Ctx c, Kind kind, int set, int32_t code) {
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int d = 0; d < c.peers.ranks; ++d)
    set_flag(flag_of(c, d, kind, set, c.peers.rank), 1u | (static_cast<uint64_t>(code) << 8));
}

}  // namespace

void reject(const Ctx& c, Kind kind, int set, int32_t code) { reject_kernel<<<1, 32, 0, c.stream>>>(c, kind, set, code); }

void dispatch(const Ctx& c, int phases, int set, const Route& route, const Rows& rows, const Set& s) {
  dispatch_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, phases, set, route, rows, s);
}

void combine(const Ctx& c, int phases, int set, const Set& dispatched, const uint16_t* y, const Sums& sums) {
  combine_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, phases, set, dispatched, y, sums);
}

void preload_kernels() { preload(dispatch_kernel, combine_kernel, reject_kernel); }

}  // namespace epx::detail::ll
