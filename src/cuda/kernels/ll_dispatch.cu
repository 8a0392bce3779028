// Low-latency dispatch (docs/low-latency.md). It sends each token's wire row once to each rank
// holding one of its experts, into slot (source rank, token) of that rank's window: known without
// any count or plan, so the send half moves rows at its first instruction. With the row go the
// source's checked routing (every rank gets all of it) and its rows per (expert, chunk of 32
// tokens), added at the destination; each block that had tokens to send counts itself in at every
// rank when it is done. The receive half waits until those blocks of every source are in, then
// packs each local expert's rows in (source rank, token) order, reading each row from its source's
// slot. Also the host rejection of either call (reject_kernel).
#include "cuda/kernels/finite_scan.cuh"
#include "cuda/kernels/ll_common.cuh"
#include "cuda/kernels/replicas.cuh"

namespace epx::detail::ll {

namespace {

constexpr int64_t kWireSpans = 8;  // at most, pieces of a row that warps send apart in dispatch_send (every wire)

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

// Token t's checked expert ids, lane i holding slots i (lo) and i + 32 (hi) (K <= 64): -1 for an
// unused slot, a token at or past the count, an id out of range or a repeat of an earlier slot's
// (the first slot of a repeated expert keeps it). The reporter warp reports the bad ones. With
// EPLB the router's ids are checked, then each becomes the physical expert chosen for it.
struct Checked {
  int32_t lo, hi;
};

__device__ Checked checked_route(const Ctx& c, const Route& r, int64_t n, int64_t t, int lane, bool reporter) {
  // Loaded whatever the count (t < T rows exist), so the loads need not wait for the count's.
  int64_t id[2] = {lane < c.topk ? read_index(r, t, lane) : -1, lane + 32 < c.topk ? read_index(r, t, lane + 32) : -1};
  if (t >= n) id[0] = id[1] = -1;
  int32_t out[2];
  for (int h = 0; h < 2; ++h) {
    const int k = lane + 32 * h;
    out[h] = static_cast<int32_t>(id[h]);
    if (id[h] < -1 || id[h] >= r.experts) {
      if (reporter) report(c.status, kStatusBadExpert, c.peers.rank, t, k, id[h]);
      out[h] = -1;
    }
  }
  for (int j = 0; j < c.topk; ++j) {  // slot j's id to every lane: repeats of it in later slots
    const int64_t idj = j < 32 ? __shfl_sync(kAll, id[0], j) : __shfl_sync(kAll, id[1], j - 32);
    for (int h = 0; h < 2; ++h)
      if (j < lane + 32 * h && out[h] >= 0 && idj == id[h]) {
        if (reporter) report(c.status, kStatusRepeatedExpert, c.peers.rank, t, j, id[h]);
        out[h] = -1;
      }
  }
  if (r.replicas.table)
    for (int h = 0; h < 2; ++h)
      if (out[h] >= 0) out[h] = chosen_replica(r.replicas, out[h], t, c.peers.rank, c.local);
  return {out[0], out[1]};
}


// Token t's checked routing (and weights, when given) to destination d's copy of this source's,
// and one count per expert of t at d in t's chunk there.
__device__ void send_routing(const Ctx& c, int set, const Route& route, int64_t t, int d, const Checked& e, bool lo_here,
                             bool hi_here, int lane) {
  const int rank = c.peers.rank, ranks = c.peers.ranks;
  const int64_t pair = ((static_cast<int64_t>(set) * ranks + rank) * c.max_tokens + t) * c.topk;
  int32_t* routes = at_window<int32_t>(c.peers, d, c.map.routes) + pair;
  if (lane < c.topk) routes[lane] = e.lo;
  if (lane + 32 < c.topk) routes[lane + 32] = e.hi;
  if (route.weights) {  // beside the routing: the combine's expert ranks wait for nothing else
    float* weights = at_window<float>(c.peers, d, c.map.route_weights) + pair;
    for (int64_t k = lane; k < c.topk; k += 32) weights[k] = route.weights[t * route.weight_stride + k];
  }
  const int64_t chunks = chunks_of(c);
  int32_t* counts = at_window<int32_t>(c.peers, d, c.map.counts) + (static_cast<int64_t>(set) * ranks + rank) * c.local * chunks;
  if (lo_here) atomicAdd(counts + (e.lo % c.local) * chunks + t / kChunk, 1);
  if (hi_here) atomicAdd(counts + (e.hi % c.local) * chunks + t / kChunk, 1);
}

// EPLB, block 0 of the send half (after its rows, before its arrival): the replica table checked
// (a violation goes out with the arrival, as a bad id does) and its hash to every rank, whose
// receive half compares the sources' hashes (tables_agree).
__device__ void check_and_send_table(const Ctx& c, int set, const ReplicaTable& table) {
  __shared__ uint64_t hash;
  check_replica_table_block(table, c.peers.rank, &hash, c.status);
  __syncthreads();  // thread 0's hash
  if (threadIdx.x < c.peers.ranks)
    at_window<uint64_t>(c.peers, threadIdx.x, c.map.table_hash)[set * c.peers.ranks + c.peers.rank] = hash;
}

// EPLB, the receive half (every thread; after wait_sources, whose pollers acquired every
// source's words): every source's table hash is this rank's, else the call fails here (its rows
// are not packed), naming the lowest source that differs. The same in every thread of the block.
__device__ bool tables_agree(const Ctx& c, int set) {
  int same = 1;
  if (threadIdx.x == 0) {
    const volatile uint64_t* h = at_window<uint64_t>(c.peers, c.peers.rank, c.map.table_hash) + set * c.peers.ranks;
    for (int p = 0; p < c.peers.ranks && same; ++p)
      if (h[p] != h[c.peers.rank]) {
        report(c.status, kStatusReplicaMismatch, p);
        same = 0;
      }
  }
  return __syncthreads_and(same) != 0;
}

// Send phase. Warp per (token, destination rank, span of the row: up to kWireSpans of them while
// the grid's warps cover every unit at once; nvfp4 with per-token global scales: each span's
// warp reads the whole row for its max): the token's checked routing; if one of its experts
// lives at the destination, the span of its wire row (once, whatever the number of those experts)
// to slot (this rank, token) there. The span-0 warp also sends the routing (and weights) and one
// count per such expert in the token's chunk; the (destination 0, span 0) warp keeps the routing
// for combine. Spans cut the chain of a row's load rounds a warp waits through (a one-token call
// is that chain) into one round per warp. With the shared expert every token's row goes to this
// rank's own slot (the receive half moves it into segment 0), and its shared-row weight is kept.
__device__ void dispatch_send(const Ctx& c, int set, const Route& route, const Rows& rows, const Set& s) {
  const int lane = threadIdx.x % 32, rank = c.peers.rank, ranks = c.peers.ranks;
  const bool first_thread = blockIdx.x == 0 && threadIdx.x == 0;
  const int64_t n = token_count(c, route, first_thread);
  // Spans only as far as the grid's warps cover them in one pass: with few warps per rank (the
  // shared-GPU transport: 8 blocks at EP8) they would only repeat each token's routing checks.
  int64_t span = c.hidden;
  for (int64_t parts = kWireSpans; parts > 1; parts /= 2)
    if (n * ranks * parts <= warps_in_grid()) {
      span = (c.hidden + parts - 1) / parts;
      span = (span + 511) / 512 * 512;  // whole 512-channel steps of quantize_fp8_row (nvfp4: 32 blocks)
      break;
    }
  const int64_t spans = (c.hidden + span - 1) / span;
  if (first_thread) *s.num_tokens = static_cast<int32_t>(n);  // for combine_recv
  if (blockIdx.x == 0 && threadIdx.x < ranks) {
    at_window<int32_t>(c.peers, threadIdx.x, c.map.ntok)[set * ranks + rank] = static_cast<int32_t>(n);
    at_window<int32_t>(c.peers, threadIdx.x, c.map.weights_from)[set * ranks + rank] = route.has_weights;
  }
  for (int64_t u = first_warp(); u < route.tokens * ranks * spans; u += warps_in_grid()) {
    const int64_t t = u / (ranks * spans), h0 = u % spans * span, h1 = min(h0 + span, c.hidden);
    const int d = static_cast<int>(u / spans % ranks);
    const Checked e = checked_route(c, route, n, t, lane, d == 0 && h0 == 0);
    const bool first_unit = u == first_warp();
    if (first_unit) stamp(c, kDispatch, kFirstChecked);
    if (d == 0 && h0 == 0) {
      if (lane < c.topk) s.slot_expert[t * c.topk + lane] = e.lo;
      if (lane + 32 < c.topk) s.slot_expert[t * c.topk + lane + 32] = e.hi;
    }
    if (t >= n) continue;
    const bool lo_here = e.lo >= 0 && e.lo / c.local == d, hi_here = e.hi >= 0 && e.hi / c.local == d;
    if (h0 == 0) send_routing(c, set, route, t, d, e, lo_here, hi_here, lane);
    if (first_unit) stamp(c, kDispatch, kFirstSent);
    const bool own_row = d == rank && c.shared_expert;  // the shared expert's input
    if (own_row && h0 == 0 && lane == 0) rows.shared_weight[t] = rows.shared_gate ? rows.shared_gate[t] : 1.0f;
    if (!own_row && __ballot_sync(kAll, lo_here || hi_here) == 0) continue;
    const int64_t slot = (static_cast<int64_t>(set) * ranks + rank) * c.max_tokens + t;
    char* dst = at_window<char>(c.peers, d, c.map.rows + slot * c.map.payload_stride);
    const uint16_t* x = rows.x + t * rows.x_stride;
    if (c.wire == WireFormat::bf16) {
      char* at = dst + 2 * h0;
      copy_row<true>(reinterpret_cast<const char*>(x + h0), &at, 1, 2 * (h1 - h0), lane);
    } else if (c.wire == WireFormat::nvfp4) {
      quantize_nvfp4_row(x, c.hidden, rows.nvfp4_global_scale, &dst, 1, lane, h0, h1);
    } else {
      quantize_fp8_row(x, c.hidden, c.wire == WireFormat::fp8_ue8m0, &dst, 1, lane, h0, h1);
    }
  }
  // Units (token, destination, span) with t < n sit in the first blocks (warp u of the grid takes
  // unit u first): the blocks past them only kept their tokens' routing here and need not count in.
  const int64_t sending = (n * ranks * spans + kWarps - 1) / kWarps;
  const int64_t arriving = sending < 1 ? 1 : sending > gridDim.x ? gridDim.x : sending;
  // check_finite: the counting blocks scan rows t < n between them, so what they find goes out
  // with their arrival (the error word every receiver reads).
  if (rows.check_finite && blockIdx.x < arriving)
    scan_finite(kernels::FiniteScan{reinterpret_cast<const char*>(rows.x), rows.x_stride * 2, c.hidden, 2, 0}, n,
                blockIdx.x, arriving, rank, c.status);
  if (blockIdx.x == 0 && route.replicas.table) check_and_send_table(c, set, route.replicas);
  stamp(c, kDispatch, kOwnWrites);
  block_arrived(c, kDispatch, set, arriving);
  stamp(c, kDispatch, kCountedIn);
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

// Rows of local expert l from `source`'s chunks [0, chunks): one thread's sum.
__device__ int32_t rows_from(const Ctx& c, const Arrived& a, int64_t l, int source, int64_t chunks) {
  const int32_t* v = a.counts + (source * c.local + l) * chunks_of(c);
  int32_t n = 0;
  for (int64_t q = 0; q < chunks; ++q) n += v[q];
  return n;
}

// The warp's sum of local expert l's rows in (source, chunk) order before (source, chunk): every
// lane adds every 32nd count, so the loads go out in one round (R x chunks counts: 32 at EP8, M 128).
__device__ int32_t warp_rows_before(const Ctx& c, const Arrived& a, int64_t l, int source, int64_t chunk, int lane) {
  const int64_t chunks = chunks_of(c);
  int32_t n = 0;
  for (int64_t i = lane; i < source * chunks + chunk; i += 32) n += a.counts[(i / chunks * c.local + l) * chunks + i % chunks];
  for (int o = 16; o > 0; o /= 2) n += __shfl_xor_sync(kAll, n, o);
  return n;
}

// A row a receive unit found: its output row (l * R*M + j) and its source slot ((set, source, token)).
struct RowMove {
  int64_t out;
  int32_t from;
};

// Receive unit (l, source, chunk): the source's tokens [32 chunk, 32 chunk + 32) that chose local
// expert l, packed after the rows of earlier sources and chunks (from the counts). Each lane
// holding such a token writes its row's source info and where combine finds it, and adds the row
// to the block's list of rows to move (`moves`, `*move_count`), which the block's warps share.
__device__ void find_rows(const Ctx& c, int set, const Set& s, const Arrived& a, int64_t unit, RowMove* moves,
                          int* move_count, int lane) {
  const int64_t chunks = chunks_of(c), slots = c.peers.ranks * c.max_tokens;
  const int64_t l = unit / (c.peers.ranks * chunks), chunk = unit % chunks;
  const int source = static_cast<int>(unit / chunks % c.peers.ranks);
  // One load round for the unit's count, the source's token count, the chunk's routing (rows past
  // the count hold stale ids, unused) and the counts of the rows packed before this unit's.
  const int32_t unit_rows = a.counts[(source * c.local + l) * chunks + chunk];
  const int64_t n = a.ntok[source], t = chunk * kChunk + lane;
  const int32_t expert = static_cast<int32_t>(c.peers.rank * c.local + l);
  int k = -1;  // the slot of lane's token holding the expert
  if (t < c.max_tokens) {
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
  const int64_t first = warp_rows_before(c, a, l, source, chunk, lane);
  if (unit_rows == 0) return;
  if (t >= n) k = -1;
  const unsigned held = __ballot_sync(kAll, k >= 0);
  int base = 0;
  if (lane == 0) base = atomicAdd(move_count, __popc(held));
  base = __shfl_sync(kAll, base, 0);
  if (k < 0) return;
  const int rank_in_chunk = __popc(held & ((1u << lane) - 1u));
  const int64_t u = l * slots + first + rank_in_chunk;
  s.recv_src[2 * u] = source;
  s.recv_src[2 * u + 1] = static_cast<int32_t>(t);
  s.row_of[(source * c.max_tokens + t) * c.topk + k] = static_cast<int32_t>(u);
  moves[base + rank_in_chunk] = {u, static_cast<int32_t>((static_cast<int64_t>(set) * c.peers.ranks + source) * c.max_tokens + t)};
}

// Receive unit (shared expert, chunk of tokens): this rank's tokens [32 chunk, 32 chunk + 32)
// below its count into segment 0 (row t), from its own slots, as find_rows lists rows.
__device__ void find_own_rows(const Ctx& c, int set, const Set& s, const Arrived& a, int64_t chunk, RowMove* moves,
                              int* move_count, int lane) {
  const int rank = c.peers.rank;
  const int64_t t = chunk * kChunk + lane, n = a.ntok[rank];
  const int rows = static_cast<int>(max(int64_t{0}, min(int64_t{kChunk}, n - chunk * kChunk)));
  if (rows == 0) return;
  int base = 0;
  if (lane == 0) base = atomicAdd(move_count, rows);
  base = __shfl_sync(kAll, base, 0);
  if (lane >= rows) return;
  const int64_t u = t - c.peers.ranks * c.max_tokens;  // row t of local expert -1
  s.recv_src[2 * u] = rank;
  s.recv_src[2 * u + 1] = static_cast<int32_t>(t);
  moves[base + lane] = {u, static_cast<int32_t>((static_cast<int64_t>(set) * c.peers.ranks + rank) * c.max_tokens + t)};
}

// One row of the block's list: its wire row (codes, scales, global scale) from the source's slot
// into its output row.
__device__ void move_row(const Ctx& c, const Set& s, const RowMove& m, int lane) {
  const char* payload = at_window<const char>(c.peers, c.peers.rank, c.map.rows + m.from * c.map.payload_stride);
  char* x = s.recv_x + m.out * c.x_bytes;
  if (s.recv_scales) copy_row_split(payload, x, c.x_bytes, s.recv_scales + m.out * c.scale_bytes, c.scale_bytes, lane);
  else copy_row(payload, &x, 1, c.x_bytes, lane);
  if (s.recv_global) {
    char* g = s.recv_global + m.out * 4;
    copy_row(payload + c.x_bytes + c.scale_bytes, &g, 1, 4, lane);
  }
}

// The shared expert's segment 0: its rows at the previous dispatch on the set, per half.
__device__ int32_t* own_prev(const Ctx& c, const Set& s) { return s.prev_count + 2 * c.local; }

// Output rows a clear unit checks.
constexpr int64_t kClearRows = 128;

// Clear unit (l, kClearRows output rows): rows at or past this call's count that held data at the
// previous dispatch on this set (its counts: half `half` of prev_count) are zeroed. With the
// shared expert the first units are segment 0's (l = -1: own_prev, and this rank's token count).
__device__ void clear_rows(const Ctx& c, const Set& s, const Arrived& a, int half, int64_t unit, int lane) {
  const int64_t slots = c.peers.ranks * c.max_tokens, units = (slots + kClearRows - 1) / kClearRows;
  const int64_t l = unit / units - (c.shared_expert ? 1 : 0), begin = unit % units * kClearRows;
  const int32_t prev = l < 0 ? own_prev(c, s)[half] : s.prev_count[half * c.local + l];
  const int64_t to = min(begin + kClearRows, static_cast<int64_t>(prev));
  if (to <= begin) return;
  const int64_t count = l < 0 ? a.ntok[c.peers.rank] : warp_rows_before(c, a, l, c.peers.ranks, 0, lane);
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

// Block 0, before its receive units: each local expert's rows per source into recv_layout and
// recv_count (from the counts, all in once the sources are), and the counts for the next dispatch
// on this set to clear against into the other half of prev_count (this call's clears read half
// `half`; a failed call moved nothing, so the next one clears what this one would have).
__device__ void write_layout(const Ctx& c, const Set& s, const Arrived& a, int half, bool ok) {
  for (int64_t l = threadIdx.x; l < c.local; l += blockDim.x) {
    int32_t first = 0;
    for (int p = 0; p < c.peers.ranks; ++p) {
      const int32_t n = ok ? rows_from(c, a, l, p, chunks_of(c)) : 0;
      s.recv_layout[(l * c.peers.ranks + p) * 2] = first;
      s.recv_layout[(l * c.peers.ranks + p) * 2 + 1] = n;
      first += n;
    }
    s.recv_count[l] = first;
    if (c.load) c.load[l] += first;  // a failed call's first is 0: it counts nothing
    s.prev_count[(half ^ 1) * c.local + l] = ok ? first : s.prev_count[half * c.local + l];
  }
  if (c.shared_expert && threadIdx.x == 0) {  // segment 0 (l = -1): this rank's tokens, all from this rank
    const int rank = c.peers.rank;
    const int32_t n = ok ? a.ntok[rank] : 0;
    int32_t* layout = s.recv_layout - 2 * c.peers.ranks;
    for (int p = 0; p < c.peers.ranks; ++p) {
      layout[2 * p] = p <= rank ? 0 : n;
      layout[2 * p + 1] = p == rank ? n : 0;
    }
    s.recv_count[-1] = n;
    own_prev(c, s)[half ^ 1] = ok ? n : own_prev(c, s)[half];
  }
}

// Receive phase, in rounds of one unit per warp: every (local expert, source, chunk of tokens) to
// pack, then every (local expert, kClearRows output rows) to clear; a failed call packs and clears
// nothing. Units go to the blocks in turn (unit i of a round to block i % grid), and a block's
// warps move the rows its units found together: a unit's rows (a Poisson count, up to 6 at the
// decode shape) would otherwise be a chain of row copies on one warp, the slowest of which the
// call waits for. Each packed row's place is kept by (source, token, slot) for combine_send.
// Block 0 writes the layout first; the grid's last block zeroes the counts, publishes the status,
// resets this set's flags and flips the half of prev_count the next dispatch on the set reads (a
// short tail: the call ends with it).
__device__ void dispatch_recv(const Ctx& c, int set, const Set& s, bool tables) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int half = *s.count_half;
  bool ok = wait_sources(c, kDispatch, set);  // the same in the whole block: the rounds meet at barriers
  if (ok && tables) ok = tables_agree(c, set);
  stamp(c, kDispatch, kSourcesIn);
  const Arrived a = arrived(c, set);
  if (blockIdx.x == 0) write_layout(c, s, a, half, ok);
  const int64_t slots = c.peers.ranks * c.max_tokens, segments = c.local + (c.shared_expert ? 1 : 0);
  const int64_t pack_units = c.local * c.peers.ranks * chunks_of(c), own_units = c.shared_expert ? chunks_of(c) : 0;
  const int64_t units = pack_units + own_units + segments * ((slots + kClearRows - 1) / kClearRows);
  const int64_t rounds = ok ? (units + warps_in_grid() - 1) / warps_in_grid() : 0;
  // A unit finds at most kChunk rows. Round r appends to count[r % 2]; the other is zeroed once
  // every warp has read it (after this round's first barrier) for the round after.
  __shared__ RowMove moves[kWarps * kChunk];
  __shared__ int move_count[2];
  if (threadIdx.x < 2) move_count[threadIdx.x] = 0;
  for (int64_t r = 0; r < rounds; ++r) {
    __syncthreads();  // the list is free: the previous round's rows are moved
    const int64_t u = r * warps_in_grid() + warp * static_cast<int64_t>(gridDim.x) + blockIdx.x;
    if (u < pack_units) find_rows(c, set, s, a, u, moves, &move_count[r % 2], lane);
    else if (u < pack_units + own_units) find_own_rows(c, set, s, a, u - pack_units, moves, &move_count[r % 2], lane);
    else if (u < units) clear_rows(c, s, a, half, u - pack_units - own_units, lane);
    __syncthreads();
    if (r == 0) stamp(c, kDispatch, kRowsFound);
    const int found = move_count[r % 2];
    if (threadIdx.x == 0) move_count[(r + 1) % 2] = 0;
    for (int i = warp; i < found; i += kWarps) move_row(c, s, moves[i], lane);
  }
  stamp(c, kDispatch, kReceived);
  if (!last_block(c.done + 0)) return;
  // The sources add their counts for the call after next on this set from zero.
  int32_t* counts = at_window<int32_t>(c.peers, c.peers.rank, c.map.counts) + set * c.peers.ranks * c.local * chunks_of(c);
  for (int64_t i = threadIdx.x; i < c.peers.ranks * c.local * chunks_of(c); i += blockDim.x) counts[i] = 0;
  if (threadIdx.x == 0) *s.count_half = half ^ 1;
  end_call(c, kDispatch, set);
  stamp(c, kDispatch, kEnd);
}

// One launch for either phase or both (the fused call): a block done sending goes on to
// receive. With both, every block of the grid must be resident at once (one per SM at most).
__global__ void __launch_bounds__(kWarps * 32) dispatch_kernel(Ctx c, int phases, int set, Route route, Rows rows, Set s) {
  stamp(c, kDispatch, kStart);
  note_start(c, kDispatch, set, phases);
  if (phases & kSendPhase) dispatch_send(c, set, route, rows, s);
  if (phases & kRecvPhase) dispatch_recv(c, set, s, route.replicas.table != nullptr);
}

// A host rejection: the call's error word at every rank, and a complete arrival of one block.
__global__ void reject_kernel(Ctx c, Kind kind, int set, int32_t code) {
  if (threadIdx.x != 0) return;
  for (int d = 0; d < c.peers.ranks; ++d)
    atomicMax_system(word_of<uint32_t>(c, c.map.errors, d, kind, set, c.peers.rank), static_cast<uint32_t>(code));
  __threadfence_system();
  for (int d = 0; d < c.peers.ranks; ++d) {
    atomicAdd_system(word_of<unsigned long long>(c, c.map.arrivals, d, kind, set, c.peers.rank), (1ull << kGridShift) + 1ull);
    if (kind == kCombine) set_flag(weights_word(c, d, set, c.peers.rank), 1u);  // no expert rank waits for its weights
  }
}

}  // namespace

void reject(const Ctx& c, Kind kind, int set, int32_t code) { reject_kernel<<<1, 32, 0, c.stream>>>(c, kind, set, code); }

void dispatch(const Ctx& c, int phases, int set, const Route& route, const Rows& rows, const Set& s) {
  dispatch_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, phases, set, route, rows, s);
}

void preload_dispatch_kernels() { preload(dispatch_kernel, reject_kernel); }

}  // namespace epx::detail::ll
