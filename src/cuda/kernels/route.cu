// A dispatch's plan in one launch: the routing read and checked, where every token and every
// (token, slot) pair of this rank goes (the sender's half of the layout), then the plan exchange
// with the receiver's half. Tokens are cut into chunks of kChunkTokens; a chunk's counts are
// scanned across chunks, so a position is (the chunk's base) + (its place in the chunk), both in
// token order, which keeps the layout deterministic. Each block owns consecutive chunks and scans
// them; the last block to finish scans the blocks' totals and runs the exchange. No block waits
// for another (the last one carries on alone), so the grid needs no co-residency: on a GPU shared
// by ranks, a peer's kernels may hold the other SMs.
#include "cuda/cuda_check.hpp"
#include "cuda/kernels/device_common.cuh"
#include "cuda/kernels/exchange.cuh"
#include "cuda/kernels/finite_scan.cuh"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/replicas.cuh"

namespace epx::detail::kernels {

namespace {

// A warp per chunk: at 24 blocks, every chunk of 6144 tokens in one round (each warp's chunk is a
// chain of dependent loads; more chunks per warp would queue them).
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kLoads = 8;                  // counts loaded at once by a scanning thread

__device__ int64_t read_index(const RoutingInput& in, int64_t t, int64_t k) {
  return in.idx64 ? static_cast<const int64_t*>(in.topk_idx)[t * in.idx_stride + k]
                  : static_cast<const int32_t*>(in.topk_idx)[t * in.idx_stride + k];
}

// Slot k of token t (id checked against the router's experts) into e[k], w[k]; false for an id
// out of range (reported).
__device__ bool canonical_slot(const Shape& s, const RoutingInput& in, int64_t t, int64_t k, int64_t id, float weight,
                               int32_t* e, float* w, DeviceStatus* st) {
  const bool valid = id >= -1 && id < in.experts;
  if (!valid) report(st, kStatusBadExpert, s.rank, t, k, id);
  e[k] = valid ? static_cast<int32_t>(id) : -1;
  w[k] = !valid || id < 0 ? 0.0f : in.topk_weights ? weight : 1.0f;
  return valid;
}

// Token t's routing, read and checked, in the router's (logical) ids. topk_idx: slots in groups
// of 8 whose ids and weights are loaded before any is stored (no dependent round per slot), and
// repeats found in registers within a group (earlier groups read back, K > 8 only).
__device__ void read_token(const Shape& s, const RoutingInput& in, int64_t t, int32_t* e, float* w, DeviceStatus* st) {
  constexpr int kGroup = 8;
  if (in.topk_idx) {
    for (int64_t k0 = 0; k0 < s.topk; k0 += kGroup) {
      int64_t id[kGroup];
      float weight[kGroup];
#pragma unroll
      for (int i = 0; i < kGroup; ++i) id[i] = k0 + i < s.topk ? read_index(in, t, k0 + i) : -1;
#pragma unroll
      for (int i = 0; i < kGroup; ++i)
        weight[i] = k0 + i < s.topk && in.topk_weights ? in.topk_weights[t * in.weight_stride + k0 + i] : 1.0f;
#pragma unroll
      for (int i = 0; i < kGroup; ++i)
        if (k0 + i < s.topk && !canonical_slot(s, in, t, k0 + i, id[i], weight[i], e, w, st)) id[i] = -1;
#pragma unroll
      for (int i = 0; i < kGroup; ++i) {
        if (id[i] < 0) continue;
        bool repeat = false;
        for (int64_t j = 0; j < k0 && !repeat; ++j)
          if (e[j] == id[i]) repeat = true, report(st, kStatusRepeatedExpert, s.rank, t, j, id[i]);
#pragma unroll
        for (int j = 0; j < i; ++j)
          if (!repeat && id[j] == id[i]) repeat = true, report(st, kStatusRepeatedExpert, s.rank, t, k0 + j, id[i]);
        if (repeat) e[k0 + i] = -1, w[k0 + i] = 0.0f, id[i] = -1;  // the first slot keeps it (the call fails)
      }
    }
    return;
  }
  int64_t k = 0;
  for (int64_t x = 0; x < in.experts; ++x) {
    if (!in.routing_map[t * in.map_stride + x]) continue;
    if (k == s.topk) {  // more experts than slots: reported as slot K
      report(st, kStatusBadExpert, s.rank, t, s.topk, x);
      break;
    }
    e[k] = static_cast<int32_t>(x);
    w[k] = in.probs ? in.probs[t * in.probs_stride + x] : 1.0f;
    ++k;
  }
  for (; k < s.topk; ++k) e[k] = -1, w[k] = 0.0f;
}

// Token t's routing into e[K] (the warp's chunk ids in shared memory, which chunk_ids copies to
// slot_expert) and slot_weight: read and checked, then (EPLB) each slot's logical expert mapped to
// its replica, also written to `chosen`, and (counts not null) counted per (physical) expert.
__device__ void canonicalize_token(const Shape& s, const RouteJob& job, int64_t t, int32_t* e, DeviceStatus* st) {
  float* w = job.slot_weight + t * s.topk;
  read_token(s, job.in, t, e, w, st);
  if (!job.replicas.table && !job.counts) return;
  for (int64_t k = 0; k < s.topk; ++k) {
    int32_t x = e[k];
    if (job.replicas.table) {
      if (x >= 0) x = chosen_replica(job.replicas, x, t, s.rank, s.local_experts);
      if (x < 0) w[k] = 0.0f;  // only a bad table leaves no replica (the call fails)
      e[k] = x;
      job.chosen[t * s.topk + k] = x;
    }
    if (job.counts && x >= 0) atomicAdd(reinterpret_cast<unsigned long long*>(&job.counts[x]), 1ull);
  }
}

// A warp's share of the plan kernel's dynamic shared memory: its chunk's slot ids (kChunkTokens x
// K), then its chunk's count row (E + R).
struct WarpShared {
  int32_t* ids;
  int32_t* row;
};

__host__ __device__ constexpr int64_t warp_shared_ints(int64_t topk, int64_t width) { return kChunkTokens * topk + width; }

__device__ WarpShared warp_shared(const Shape& s) {
  extern __shared__ int32_t plan_shared[];
  int32_t* mine = plan_shared + threadIdx.x / 32 * warp_shared_ints(s.topk, s.experts + s.ranks);
  return {mine, mine + kChunkTokens * s.topk};
}

// One warp, chunk c (its tokens' slot ids in ws.ids): its counts, counted in ws.row and then
// copied to its row of chunk_count, and each token's and pair's place in the chunk. Lanes 0..15
// own its tokens for the destination ranks (ballots). The pairs go token by token, in token
// order, a token's slots at once: its experts differ, so no two of its lanes add to one count,
// and a pair's place is its expert's count so far. (A match of each 32 pairs and shuffles of the
// earlier ones took 2.6-3.1 us of a one-warp chain: docs/lab/2026-12-03-plan-chain.md.)
__device__ void count_chunk(const Shape& s, int64_t tokens, const WarpShared& ws, const ChunkPositions& p, int64_t c,
                            int lane) {
  const unsigned lower = (1u << lane) - 1u;
  const int64_t width = s.experts + s.ranks, first = c * kChunkTokens, t = first + lane;
  const int n = static_cast<int>(min(int64_t{kChunkTokens}, tokens - first));
  const bool mine = lane < n;
  const int32_t local = static_cast<int32_t>(s.local_experts);
  for (int64_t i = lane; i < width; i += 32) ws.row[i] = 0;
  uint32_t dests = 0;
  if (mine)
    for (int64_t k = 0; k < s.topk; ++k) {
      const int32_t e = ws.ids[lane * s.topk + k];
      if (e >= 0) dests |= 1u << (e / local);
    }
  __syncwarp();  // the row is zeroed
  for (int d = 0; d < s.ranks; ++d) {
    const uint32_t to_d = __ballot_sync(0xffffffffu, (dests >> d) & 1u);
    if (mine) p.send_pos[t * s.ranks + d] = (dests >> d) & 1u ? __popc(to_d & lower) : -1;
    if (lane == 0) ws.row[s.experts + d] = __popc(to_d);
  }
  for (int i = 0; i < n; ++i) {
    for (int64_t k = lane; k < s.topk; k += 32) {
      const int32_t e = ws.ids[i * s.topk + k];
      int32_t place = 0;
      if (e >= 0) {
        place = ws.row[e];
        ws.row[e] = place + 1;
      }
      p.slot_pos[(first + i) * s.topk + k] = place;
    }
    __syncwarp();  // this token's counts before the next token's
  }
  int32_t* count = p.chunk_count + c * width;
  for (int64_t i = lane; i < width; i += 32) count[i] = ws.row[i];
}

// Thread per column: the exclusive scan of `values` over rows [first, end) (rows `width` apart)
// into `bases`, kLoads rows loaded before any is stored (the stores would otherwise keep each
// load behind the last). Returns the column's total. Values another warp or block wrote are read
// from L2 (__ldcg): their writers' barrier or fence made them visible there.
__device__ int64_t scan_column(const int32_t* values, int32_t* bases, int64_t width, int64_t col, int64_t first,
                               int64_t end) {
  int64_t running = 0;
  for (int64_t base = first; base < end; base += kLoads) {
    int32_t v[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) v[i] = base + i < end ? __ldcg(values + (base + i) * width + col) : 0;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      if (base + i < end) bases[(base + i) * width + col] = static_cast<int32_t>(running);
      running += v[i];
    }
  }
  return running;
}

// Zeroes bytes [from, from + bytes), the part of `parts` equal parts this caller's is `part`
// (16-byte stores where aligned, the rest bytewise).
__device__ void zero_part(const ZeroBytes& z, int64_t part, int64_t parts) {
  const int64_t vectors = reinterpret_cast<uintptr_t>(z.from) % 16 == 0 ? z.bytes / 16 : 0;
  const int64_t per = (vectors + parts - 1) / parts;
  int4* v = reinterpret_cast<int4*>(z.from);
  for (int64_t i = part * per + threadIdx.x; i < min(vectors, (part + 1) * per); i += blockDim.x) v[i] = int4{0, 0, 0, 0};
  if (part == parts - 1)
    for (int64_t i = vectors * 16 + threadIdx.x; i < z.bytes; i += blockDim.x) z.from[i] = 0;
}

// Work of the plan kernel's first block to start, before any other block goes on: the call's
// begin (job.begins_call: before any block reads the call's number or reports into its status),
// the zeroing of the drop rule's sums (before any block adds to them) and the replica table's
// check (before any block routes by it). The other blocks wait for it, a block that runs
// already, so none waits for a block without an SM.
__device__ bool needs_first_block(const RouteJob& job) {
  return job.begins_call || job.sums.bytes > 0 || job.replicas.table != nullptr;
}

__device__ void first_block_first(const Shape& s, const RouteJob& job, CallState* cs, DeviceStatus* st) {
  const int order = arrival_order(&cs->plan_arrivals);
  if (order == 0) {
    zero_part(job.sums, 0, 1);
    if (job.begins_call) begin_call_block(cs, st);
    if (job.replicas.table) check_replica_table_block(job.replicas, s.rank, &cs->replica_hash, st);
    __syncthreads();  // the zeroing and the check before the flag
    if (threadIdx.x == 0) {
      __threadfence();
      atomicExch(&cs->plan_begun, 1u);
    }
  } else if (threadIdx.x == 0) {
    while (atomicAdd(&cs->plan_begun, 0u) == 0u) {
    }
    __threadfence();
  }
  __syncthreads();
}

// Chunk c's slot ids into `ids` and slot_expert: read and checked (canonicalize), or (a drop rule's
// second run) read back from slot_expert.
__device__ void chunk_ids(const Shape& s, const RouteJob& job, int64_t tokens, int64_t c, int32_t* ids, DeviceStatus* st,
                          int lane) {
  const int64_t first = c * kChunkTokens, pairs = (min(first + kChunkTokens, tokens) - first) * s.topk;
  int32_t* global = job.slot_expert + first * s.topk;
  if (job.canonicalize) {
    if (lane < kChunkTokens && first + lane < tokens) canonicalize_token(s, job, first + lane, ids + lane * s.topk, st);
    __syncwarp();
    for (int64_t i = lane; i < pairs; i += 32) global[i] = ids[i];
  } else {
    for (int64_t i = lane; i < pairs; i += 32) ids[i] = global[i];
  }
  __syncwarp();
}

// One block per SM at most (ptxas would otherwise keep registers for two and spill).
__global__ void __launch_bounds__(kThreads, 1) plan_dispatch_kernel(PeerWindows w, WindowMap m, Shape s,
                                                                    int64_t tokens, RouteJob job, ExchangeJob x,
                                                                    uint64_t timeout_ns, CallState* cs,
                                                                    DeviceStatus* st) {
  const ChunkPositions& p = job.pos;
  const int lane = threadIdx.x % 32;
  const int64_t width = s.experts + s.ranks, chunks = (tokens + kChunkTokens - 1) / kChunkTokens;
  const int64_t first = blockIdx.x * p.chunks_per_block, end = min(chunks, first + p.chunks_per_block);
  if (needs_first_block(job)) first_block_first(s, job, cs, st);
  zero_part(job.zeroed, blockIdx.x, gridDim.x);  // fenced by last_block before the layout's writes
  // The first job.chunk_warps warps take the chunks (as many as the shared memory holds).
  const WarpShared ws = warp_shared(s);
  const int warp = static_cast<int>(threadIdx.x / 32);
  for (int64_t c = first + warp; warp < job.chunk_warps && c < end; c += job.chunk_warps) {
    chunk_ids(s, job, tokens, c, ws.ids, st, lane);
    if (job.positions) count_chunk(s, tokens, ws, p, c, lane);
    __syncwarp();  // every lane is done with the chunk's ids and row before the next chunk's
  }
  if (job.canonicalize) scan_finite_all(job.finite, tokens, blockIdx.x, gridDim.x, s.rank, st);
  __syncthreads();
  if (job.positions)
    for (int64_t col = threadIdx.x; col < width; col += blockDim.x)
      p.block_base[blockIdx.x * width + col] =
          static_cast<int32_t>(scan_column(p.chunk_count, p.chunk_base, width, col, first, end));
  if (!last_block(&cs->plan_blocks_done)) return;
  if (needs_first_block(job) && threadIdx.x == 0) cs->plan_begun = 0;  // every block is past its wait
  if (job.positions)  // the blocks' totals (in block_base) into their bases, and the rank's totals
    for (int64_t col = threadIdx.x; col < width; col += blockDim.x)
      p.totals[col] = scan_column(p.block_base, p.block_base, width, col, 0, gridDim.x);
  __syncthreads();  // the totals for the whole block
  // EPLB: the table's hash (the first block's) goes with the plan, so tables that differ fail every rank.
  exchange_plan_block<kThreads>(w, m, s, x, timeout_ns, cs, st, job.replicas.table ? &cs->replica_hash : nullptr);
}

// The dynamic shared memory a block of the plan kernel may take on the current device (its opt-in
// limit less the kernel's static shared memory).
int64_t plan_shared_limit() {
  int device = 0, optin = 0;
  EPX_CUDA(cudaGetDevice(&device));
  EPX_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  EPX_CUDA(cudaFuncGetAttributes(&attributes, plan_dispatch_kernel));
  return static_cast<int64_t>(optin) - static_cast<int64_t>(attributes.sharedSizeBytes);
}

int64_t warp_shared_bytes(int64_t topk, int64_t width) {
  return warp_shared_ints(topk, width) * static_cast<int64_t>(sizeof(int32_t));
}

// Blocks of per_block consecutive chunks that cover `tokens` tokens (one at least: the exchange).
int plan_grid(int64_t tokens, int64_t per_block) {
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens;
  return static_cast<int>(std::max<int64_t>(1, (chunks + per_block - 1) / per_block));
}

}  // namespace

PlanSplit plan_split(int blocks, int64_t tokens) {
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens;
  const int64_t per_block = std::max<int64_t>(1, (chunks + blocks - 1) / std::max(blocks, 1));
  return {plan_grid(tokens, per_block), per_block};
}

void plan_dispatch(const Ctx& ctx, int64_t tokens, const RouteJob& route, const ExchangeJob& x) {
  // The grid the handle's positions were carved for (route.pos.chunks_per_block: plan_split's).
  const int grid = plan_grid(tokens, route.pos.chunks_per_block);
  const int64_t width = ctx.shape.experts + ctx.shape.ranks;
  const size_t shared = static_cast<size_t>(route.chunk_warps * warp_shared_bytes(ctx.shape.topk, width));
  plan_dispatch_kernel<<<grid, kThreads, shared, ctx.stream>>>(ctx.peers, ctx.map, ctx.shape, tokens, route, x,
                                                               ctx.timeout_ns, ctx.state, ctx.status);
}

int plan_chunk_warps(int64_t topk, int64_t width) {
  return static_cast<int>(std::min<int64_t>(kWarps, plan_shared_limit() / warp_shared_bytes(topk, width)));
}

void preload_route_kernels() {
  preload(plan_dispatch_kernel);
  EPX_CUDA(cudaFuncSetAttribute(plan_dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(plan_shared_limit())));
}

}  // namespace epx::detail::kernels
