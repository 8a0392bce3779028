// Low-latency mode (docs/low-latency.md): every (token, expert) pair travels to a slot of its
// own in the expert rank's window, fixed before any row moves, so no plan is exchanged; each
// source flags each destination once its rows are there; the receive half packs the rows of
// each expert in (source rank, token) order.
#include "cuda/kernels/ll_launch.hpp"
#include "cuda/kernels/row_copy.cuh"

namespace epx::detail::ll {

namespace {

constexpr int kLayoutThreads = 1024;
constexpr int kWarps = 16;
constexpr int kMaxExperts = 4096;  // shared-memory counts of the layout kernel (checked on the host)
constexpr int kDestGroup = 8;      // destination rows one read of a token row is written to at once

__device__ int64_t read_index(const Route& r, int64_t t, int64_t k) {
  return r.idx64 ? static_cast<const int64_t*>(r.topk_idx)[t * r.idx_stride + k]
                 : static_cast<const int32_t*>(r.topk_idx)[t * r.idx_stride + k];
}

// One block: checks the routing and gives every pair its place among this rank's pairs of its
// expert, in token order (pairs in chunks of 1024; in a chunk, a pair counts the earlier ones).
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(Ctx c, Route route, Set s, int rank) {
  __shared__ int32_t count[kMaxExperts];
  __shared__ int32_t chunk[kLayoutThreads];
  __shared__ int64_t rows;
  const int tid = threadIdx.x;
  if (tid == 0) {
    int64_t n = route.num_tokens ? *route.num_tokens : route.tokens;
    if (n < 0 || n > route.tokens) {
      report(c.status, kStatusBadTokenCount, rank, n, route.tokens);
      n = 0;
    }
    rows = n;
    *s.num_tokens = static_cast<int32_t>(n);
  }
  for (int64_t e = tid; e < c.experts; e += kLayoutThreads) count[e] = 0;
  __syncthreads();
  const int64_t pairs = route.tokens * c.topk;
  for (int64_t base = 0; base < pairs; base += kLayoutThreads) {
    const int64_t p = base + tid, t = p / c.topk, k = p % c.topk;
    int32_t e = -1;
    if (p < pairs && t < rows) {
      const int64_t id = read_index(route, t, k);
      if (id < -1 || id >= c.experts) {
        report(c.status, kStatusBadExpert, rank, t, k, id);
      } else if (id >= 0) {
        e = static_cast<int32_t>(id);
        for (int64_t j = 0; j < k; ++j)
          if (read_index(route, t, j) == id) {
            report(c.status, kStatusRepeatedExpert, rank, t, j, id);
            e = -1;
          }
      }
    }
    chunk[tid] = e;
    __syncthreads();
    int32_t index = -1;
    if (e >= 0) {
      int32_t before = 0;
      for (int q = 0; q < tid; ++q) before += chunk[q] == e;
      index = count[e] + before;
      if (index >= c.max_tokens) index = -1;  // only with bad input (reported): never past the source's slots
    }
    __syncthreads();
    if (e >= 0) atomicAdd(&count[e], 1);
    if (p < pairs) {
      s.slot_expert[p] = index >= 0 ? e : -1;
      s.pair_index[p] = index;
    }
    __syncthreads();
  }
  for (int64_t e = tid; e < c.experts; e += kLayoutThreads) s.expert_count[e] = min(count[e], static_cast<int32_t>(c.max_tokens));
}

__device__ int64_t set_rows(const Ctx& c, int set) { return static_cast<int64_t>(set) * c.local * c.peers.ranks * c.max_tokens; }

__device__ uint64_t* flag_of(const Ctx& c, int owner, Kind kind, int set, int source) {
  return at_window<uint64_t>(c.peers, owner, c.map.flags) + (static_cast<int64_t>(kind) * 2 + set) * c.peers.ranks + source;
}

// True in every thread of the last block of the grid to finish (the counter is reset there, so
// it starts from 0 at the next launch). Each block's writes are fenced system-wide before it counts.
__device__ bool last_block(uint32_t* done) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
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

// Warp per token: its wire row to the slot of each of its experts (kDestGroup at a time).
__global__ void __launch_bounds__(kWarps * 32) dispatch_send_kernel(Ctx c, int set, Rows rows, Set s) {
  const int lane = threadIdx.x % 32;
  const int64_t n = *s.num_tokens, slots = c.peers.ranks * c.max_tokens;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; t < n;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    for (int64_t k0 = 0; k0 < c.topk; k0 += kDestGroup) {
      char* dst[kDestGroup];
      int count = 0;
      for (int64_t k = k0; k < min(k0 + kDestGroup, c.topk); ++k) {
        const int32_t e = s.slot_expert[t * c.topk + k];
        if (e < 0) continue;
        const int d = static_cast<int>(e / c.local);
        const int64_t slot = set_rows(c, set) + (e % c.local) * slots + c.peers.rank * c.max_tokens + s.pair_index[t * c.topk + k];
        dst[count++] = at_window<char>(c.peers, d, c.map.rows + slot * c.map.payload_stride);
        if (lane == 0) {
          at_window<int32_t>(c.peers, d, c.map.row_token)[slot] = static_cast<int32_t>(t);
          at_window<int32_t>(c.peers, d, c.map.row_slot)[slot] = static_cast<int32_t>(k);
        }
      }
      if (count == 0) continue;
      const uint16_t* x = rows.x + t * rows.x_stride;
      if (c.wire == WireFormat::bf16) copy_row<true>(reinterpret_cast<const char*>(x), dst, count, 2 * c.hidden, lane);
      else if (c.wire == WireFormat::nvfp4) quantize_nvfp4_row(x, c.hidden, rows.nvfp4_global_scale, dst, count, lane);
      else quantize_fp8_row(x, c.hidden, c.wire == WireFormat::fp8_ue8m0, dst, count, lane);
    }
  }
  if (!last_block(c.done + 0)) return;
  // The last block: this rank's counts for each destination's experts, then the flags.
  for (int64_t i = threadIdx.x; i < c.experts; i += blockDim.x) {
    const int d = static_cast<int>(i / c.local);
    at_window<int32_t>(c.peers, d, c.map.counts)[(static_cast<int64_t>(set) * c.peers.ranks + c.peers.rank) * c.local +
                                                 i % c.local] = s.expert_count[i];
  }
  __syncthreads();
  flag_all(c, kDispatch, set);
}

__device__ int32_t count_from(const Ctx& c, int set, int source, int64_t l) {
  return at_window<const int32_t>(c.peers, c.peers.rank, c.map.counts)[(static_cast<int64_t>(set) * c.peers.ranks + source) * c.local + l];
}

// Warp per output row (l, j): a packed received row, a row to clear (held data at the previous
// dispatch on this set), or nothing to do.
__global__ void __launch_bounds__(kWarps * 32) dispatch_recv_kernel(Ctx c, int set, Set s) {
  const int lane = threadIdx.x % 32;
  const int64_t slots = c.peers.ranks * c.max_tokens;
  const bool ok = wait_sources(c, kDispatch, set, lane);
  const int64_t warp = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t u = ok ? warp : c.local * slots; u < c.local * slots; u += warps) {
    const int64_t l = u / slots, j = u % slots;
    int64_t first = 0, source = -1;
    for (int p = 0; p < c.peers.ranks && source < 0; ++p) {
      const int32_t n = count_from(c, set, p, l);
      if (j < first + n) source = p;
      else first += n;
    }
    char* x = s.recv_x + u * c.x_bytes;
    char* sc = s.recv_scales ? s.recv_scales + u * c.scale_bytes : nullptr;
    char* g = s.recv_global ? s.recv_global + u * 4 : nullptr;
    if (source < 0) {  // past the count: zero, unless it already is
      if (j >= s.prev_count[l]) continue;
      zero_row(&x, 1, c.x_bytes, lane);
      if (sc) zero_row(&sc, 1, c.scale_bytes, lane);
      if (g) zero_row(&g, 1, 4, lane);
      if (lane == 0) s.recv_src[2 * u] = s.recv_src[2 * u + 1] = -1;
      continue;
    }
    const int64_t from = set_rows(c, set) + l * slots + source * c.max_tokens + (j - first);
    const char* payload = at_window<const char>(c.peers, c.peers.rank, c.map.rows + from * c.map.payload_stride);
    copy_row(payload, &x, 1, c.x_bytes, lane);
    if (sc) copy_row(payload + c.x_bytes, &sc, 1, c.scale_bytes, lane);
    if (g) copy_row(payload + c.x_bytes + c.scale_bytes, &g, 1, 4, lane);
    if (lane == 0) {
      const int32_t token = at_window<const int32_t>(c.peers, c.peers.rank, c.map.row_token)[from];
      s.recv_src[2 * u] = static_cast<int32_t>(source);
      s.recv_src[2 * u + 1] = token;
      s.src_rank[u] = static_cast<int32_t>(source);
      s.src_token[u] = token;
      s.src_slot[u] = at_window<const int32_t>(c.peers, c.peers.rank, c.map.row_slot)[from];
    }
  }
  if (!last_block(c.done + 1)) return;
  // The last block: counts and layout out, this set's flags reset for its next call.
  for (int64_t l = threadIdx.x; l < c.local; l += blockDim.x) {
    int32_t first = 0;
    for (int p = 0; p < c.peers.ranks; ++p) {
      const int32_t n = ok ? count_from(c, set, p, l) : 0;
      s.recv_layout[(l * c.peers.ranks + p) * 2] = first;
      s.recv_layout[(l * c.peers.ranks + p) * 2 + 1] = n;
      first += n;
    }
    s.recv_count[l] = first;
    s.prev_count[l] = max(first, ok ? 0 : s.prev_count[l]);
  }
  if (threadIdx.x < c.peers.ranks) *flag_of(c, c.peers.rank, kDispatch, set, threadIdx.x) = 0;
}

// Warp per received row: the expert's output row back to its source's (token, slot) place.
__global__ void __launch_bounds__(kWarps * 32) combine_send_kernel(Ctx c, int set, Set d, const uint16_t* y) {
  const int lane = threadIdx.x % 32;
  const int64_t slots = c.peers.ranks * c.max_tokens;
  for (int64_t u = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; u < c.local * slots;
       u += static_cast<int64_t>(gridDim.x) * kWarps) {
    if (u % slots >= d.recv_count[u / slots]) continue;
    const int source = d.src_rank[u];
    const int64_t at = ((static_cast<int64_t>(set) * c.max_tokens + d.src_token[u]) * c.topk + d.src_slot[u]) * c.hidden;
    char* dst = at_window<char>(c.peers, source, c.map.ret + at * 2);
    copy_row(reinterpret_cast<const char*>(y + u * c.hidden), &dst, 1, 2 * c.hidden, lane);
  }
  if (!last_block(c.done + 2)) return;
  flag_all(c, kCombine, set);
}

// Warp per token: its returned rows in slot order (fma with the weight, or a plain sum), bf16.
__global__ void __launch_bounds__(kWarps * 32) combine_recv_kernel(Ctx c, int set, Set d, const float* weights,
                                                                  int64_t weight_stride, bool weighted, int64_t tokens,
                                                                  uint16_t* out) {
  const int lane = threadIdx.x % 32;
  const bool ok = wait_sources(c, kCombine, set, lane);
  const int64_t n = ok ? *d.num_tokens : 0;
  const uint16_t* ret = at_window<const uint16_t>(c.peers, c.peers.rank, c.map.ret) +
                        static_cast<int64_t>(set) * c.max_tokens * c.topk * c.hidden;
  const bool wide = c.hidden % 8 == 0 && aligned16(out);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps)
    sum_rows(static_cast<int>(c.topk), [&](int k, const uint16_t*& row, float& weight) {
      row = ret + (t * c.topk + k) * c.hidden;
      weight = weighted ? weights[t * weight_stride + k] : 1.0f;
      return t < n && d.slot_expert[t * c.topk + k] >= 0;
    }, weighted, out + t * c.hidden, c.hidden, wide, lane);
  if (!last_block(c.done + 3)) return;
  if (threadIdx.x < c.peers.ranks) *flag_of(c, c.peers.rank, kCombine, set, threadIdx.x) = 0;
}

__global__ void reject_kernel(Ctx c, Kind kind, int set, int32_t code) {
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int d = 0; d < c.peers.ranks; ++d)
    set_flag(flag_of(c, d, kind, set, c.peers.rank), 1u | (static_cast<uint64_t>(code) << 8));
}

}  // namespace

void reject(const Ctx& c, Kind kind, int set, int32_t code) { reject_kernel<<<1, 32, 0, c.stream>>>(c, kind, set, code); }

void dispatch_send(const Ctx& c, int set, const Route& route, const Rows& rows, const Set& s) {
  layout_kernel<<<1, kLayoutThreads, 0, c.stream>>>(c, route, s, c.peers.rank);
  dispatch_send_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, set, rows, s);
}

void dispatch_recv(const Ctx& c, int set, const Set& s) {
  dispatch_recv_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, set, s);
}

void combine_send(const Ctx& c, int set, const Set& dispatched, const uint16_t* y) {
  combine_send_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, set, dispatched, y);
}

void combine_recv(const Ctx& c, int set, const Set& dispatched, const float* weights, int64_t weight_stride,
                  bool weighted, int64_t tokens, uint16_t* out) {
  combine_recv_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, set, dispatched, weights, weight_stride, weighted,
                                                               tokens, out);
}

void preload_kernels() {
  preload(layout_kernel, dispatch_send_kernel, dispatch_recv_kernel, combine_send_kernel, combine_recv_kernel,
          reject_kernel);
}

}  // namespace epx::detail::ll
