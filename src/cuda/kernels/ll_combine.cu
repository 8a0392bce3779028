// Low-latency combine (docs/low-latency.md): each expert rank sums a token's rows of its experts
// (slot order, the source's weights: sent beside its routing by ll_dispatch, or first thing by
// combine's send half) into one partial back at the source (bf16, or the fp8 combine wire's codes
// and scales), which adds the partials in rank order (the high-throughput combine's sums), then
// the shared expert's row.
#include "cuda/kernels/fp8_partials.cuh"
#include "cuda/kernels/ll_common.cuh"

namespace epx::detail::ll {

namespace {

constexpr int64_t kSendSpan = 1024;  // channels of a row one warp returns in combine_send
constexpr int kMaxTopk = 64;
constexpr int64_t kSumSpan = 1024;   // channels of a token one warp sums in combine_recv

// Weighted combine, block 0 of the send half: this rank's tokens' weights (t < its count) to
// every rank, then its weights_in word there, so the expert ranks can sum with them.
__device__ void send_weights(const Ctx& c, int set, const Set& d, const Sums& sums) {
  const int ranks = c.peers.ranks, rank = c.peers.rank;
  const int64_t pairs = static_cast<int64_t>(*d.num_tokens) * c.topk;
  for (int p = 0; p < ranks; ++p) {
    float* dst = at_window<float>(c.peers, p, c.map.weights) + (static_cast<int64_t>(set) * ranks + rank) * c.max_tokens * c.topk;
    for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x)
      dst[i] = sums.weights[i / c.topk * sums.weight_stride + i % c.topk];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (int p = 0; p < ranks; ++p) set_flag(weights_word(c, p, set, rank), 1u);
}

// Lane 0 waits until `source`'s weights are here (its weights_in word is 1, a flag of "epoch" 1);
// false (in every lane) after the timeout, or when the call failed already.
__device__ bool wait_weights(const Ctx& c, int set, int source, int lane) {
  return warp_wait_lane_flags(lane == 0 ? weights_word(c, c.peers.rank, set, source) : nullptr, source, 1u,
                              c.timeout_ns, c.status, timeout_where(c.call, kCombineWeights));
}

// The same for the whole block, for every source that did not send its weights with its dispatch:
// threads 0..R-1 wait, the others at the barrier (one poller per source and block: a poller per
// warp, 2112 of them on one word, queue behind each other). The same in every thread.
__device__ bool block_wait_weights(const Ctx& c, int set, const int32_t* weights_from) {
  int ok = 1;
  if (threadIdx.x < 32) {
    const int source = static_cast<int>(threadIdx.x);
    const bool needed = source < c.peers.ranks && weights_from[source] == 0;
    ok = warp_wait_lane_flags(needed ? weights_word(c, c.peers.rank, set, source) : nullptr, source, 1u, c.timeout_ns,
                              c.status, timeout_where(c.call, kCombineWeights));
  }
  return __syncthreads_and(ok) != 0;
}

// Send phase. Warp per (source, token, kSendSpan channels) with one of its experts here: the
// rows of those experts summed in slot order (fma with the source's weight, or a plain sum) into
// one partial at the source's (token, this rank) place, bf16 or (combine_wire fp8) its fp8 codes
// at the slot's start and scales after its H bytes. `dset`: the dispatch's set.
__device__ void combine_send(const Ctx& c, int set, int dset, const Set& d, const uint16_t* y, const Sums& sums) {
  const int lane = threadIdx.x % 32, ranks = c.peers.ranks, rank = c.peers.rank;
  if (sums.weighted && !sums.at_dispatch && blockIdx.x == 0) send_weights(c, set, d, sums);
  const int64_t spans = (c.hidden + kSendSpan - 1) / kSendSpan, m = c.max_tokens;
  const int32_t* ntok = at_window<const int32_t>(c.peers, rank, c.map.ntok) + dset * ranks;
  const int32_t* routes = at_window<const int32_t>(c.peers, rank, c.map.routes) + dset * ranks * m * c.topk;
  // Each source's weights: sent with its dispatch (weights_from), or by its combine's send half.
  const int32_t* weights_from = at_window<const int32_t>(c.peers, rank, c.map.weights_from) + dset * ranks;
  const float* combine_weights = at_window<const float>(c.peers, rank, c.map.weights) + set * ranks * m * c.topk;
  const float* dispatch_weights = at_window<const float>(c.peers, rank, c.map.route_weights) + dset * ranks * m * c.topk;
  const bool wide = c.hidden % 8 == 0 && aligned16(y);
  // The warp's unit: per slot k, the row of y holding it if its expert is here (else -1) and its
  // weight, looked up by lanes k and k + 32 in one load round, then read by every lane as the sum
  // goes (not one dependent pair of loads per term).
  __shared__ int32_t term_rows[kWarps][kMaxTopk];
  __shared__ float term_weights[kWarps][kMaxTopk];
  const int warp = threadIdx.x / 32;
  const int64_t units = ranks * m * spans;
  auto look_up = [&](int64_t unit) {  // true when the unit has a term here
    const int source = static_cast<int>(unit / (m * spans));
    const int64_t t = unit / spans % m, first = (source * m + t) * c.topk;
    // Loaded together: past the source's count, or for a slot elsewhere, the values go unused.
    const int64_t tokens = ntok[source];
    bool any = false;
    for (int64_t k = lane; k < c.topk; k += 32) {
      const int32_t e = routes[first + k], row = d.row_of[first + k];  // row_of: for local slots only
      const float w = dispatch_weights[first + k];
      const bool here = e >= 0 && e / c.local == rank;
      term_rows[warp][k] = here ? row : -1;
      term_weights[warp][k] = w;
      any |= here;
    }
    return t < tokens && __ballot_sync(kAll, any) != 0;
  };
  // The first unit's terms are looked up before the weights are waited for (they come from this
  // rank's dispatch, not from the sources), so that load round overlaps the weights' round trip.
  int64_t unit = first_warp();
  bool has_terms = unit < units && look_up(unit);
  if (unit < units) stamp(c, kCombine, kFirstSent);
  // Weights given to this combine (not to the dispatch): the whole block waits for them once. A
  // source that sent its weights at combine while this rank gave them at dispatch is waited for
  // by each warp that needs it.
  const bool block_waits = sums.weighted && !sums.at_dispatch;
  const bool weights_here = !block_waits || block_wait_weights(c, set, weights_from);
  stamp(c, kCombine, kFirstChecked);
  uint32_t weights_seen = 0;  // sources whose weights this warp saw arrive
  for (; weights_here && unit < units; unit += warps_in_grid(), has_terms = unit < units && look_up(unit)) {
    if (!has_terms) continue;
    const int source = static_cast<int>(unit / (m * spans));
    const int64_t t = unit / spans % m, h0 = unit % spans * kSendSpan, first = (source * m + t) * c.topk;
    if (sums.weighted && weights_from[source] == 0) {  // the source's weights came with its combine
      if (!block_waits && !(weights_seen >> source & 1u) && !wait_weights(c, set, source, lane)) break;
      weights_seen |= 1u << source;
      for (int64_t k = lane; k < c.topk; k += 32) term_weights[warp][k] = combine_weights[first + k];
    }
    __syncwarp();
    uint16_t* slot = at_window<uint16_t>(c.peers, source, c.map.ret) + ((set * m + t) * ranks + rank) * c.hidden;
    auto term = [&](int k, const uint16_t*& row, float& weight) {
      const int32_t r = term_rows[warp][k];
      if (r < 0) return false;
      row = y + static_cast<int64_t>(r) * c.hidden + h0;
      weight = sums.weighted ? term_weights[warp][k] : 1.0f;
      return true;
    };
    const int64_t len = min(kSendSpan, c.hidden - h0);
    if (c.combine_wire == WireFormat::bf16) {
      sum_rows<2>(static_cast<int>(c.topk), term, sums.weighted, slot + h0, len, wide, lane);
    } else {  // y is 16-byte aligned (the host checks) and H % 128 == 0
      char* bytes = reinterpret_cast<char*>(slot);
      sum_rows_wide<2>(static_cast<int>(c.topk), term, sums.weighted, len, lane,
                       Fp8Partial{bytes + h0, reinterpret_cast<float*>(bytes + c.hidden) + h0 / kFp8Block,
                                  c.combine_wire == WireFormat::fp8_ue8m0});
    }
    __syncwarp();  // every lane done reading the unit's terms before the next unit's go in
  }
  stamp(c, kCombine, kOwnWrites);
  block_arrived(c, kCombine, set, gridDim.x);
  stamp(c, kCombine, kCountedIn);
}

// Receive phase. Warp per (token, kSumSpan channels): the partials of the ranks holding its
// experts, in rank order (bf16, or fp8 by sum_fp8_partials), then the shared expert's row (times
// its weight when weighted); rows past the token count are zero.
__device__ void combine_recv(const Ctx& c, int set, const Set& d, const Sums& sums) {
  const int lane = threadIdx.x % 32, ranks = c.peers.ranks;
  const int64_t count = *d.num_tokens;  // this rank's dispatch wrote it: read while the sources come
  const bool ok = wait_sources(c, kCombine, set);
  stamp(c, kCombine, kSourcesIn);
  const int64_t n = ok ? count : 0, spans = (c.hidden + kSumSpan - 1) / kSumSpan;
  const uint16_t* ret = at_window<const uint16_t>(c.peers, c.peers.rank, c.map.ret) + set * c.max_tokens * ranks * c.hidden;
  const bool wide = c.hidden % 8 == 0 && aligned16(sums.out) && aligned16(sums.shared_y);
  for (int64_t unit = first_warp(); unit < sums.tokens * spans; unit += warps_in_grid()) {
    const int64_t t = unit / spans, h0 = unit % spans * kSumSpan;
    uint32_t held = 0;  // bit d: one of the token's experts is on rank d
    for (int64_t k = lane; k < c.topk; k += 32) {  // loaded beside the count (-1 past it anyway)
      const int32_t e = d.slot_expert[t * c.topk + k];
      if (t < n && e >= 0) held |= 1u << (e / c.local);
    }
    held = __reduce_or_sync(kAll, held);
    const uint16_t* shared_row = sums.shared_y && t < n ? sums.shared_y + t * c.hidden : nullptr;
    const float shared_weight = shared_row && sums.weighted ? sums.shared_weight[t] : 1.0f;
    if (c.combine_wire != WireFormat::bf16) {
      const char* slot0 = reinterpret_cast<const char*>(ret + t * ranks * c.hidden);  // rank r's slot 2H bytes on
      sum_fp8_partials([&](int r) { return held >> r & 1u ? slot0 + r * 2 * c.hidden : nullptr; }, ranks, c.hidden, h0,
                       min(kSumSpan, c.hidden - h0), ExtraRows{{shared_row, nullptr}, shared_weight},
                       sums.out + t * c.hidden, lane);
      continue;
    }
    // Weighted: the partials' weight 1 (fma(1, v, acc) is acc + v), the shared row's its own.
    sum_rows<2>(ranks + 1, [&](int r, const uint16_t*& row, float& weight) {
      weight = 1.0f;
      if (r == ranks) {
        if (!shared_row) return false;
        row = shared_row + h0;
        weight = shared_weight;
        return true;
      }
      row = ret + ((t * ranks + r) * c.hidden + h0);
      return (held >> r & 1u) != 0;
    }, sums.weighted, sums.out + t * c.hidden + h0, min(kSumSpan, c.hidden - h0), wide, lane);
  }
  stamp(c, kCombine, kReceived);
  if (!last_block(c.done + 1)) return;
  end_call(c, kCombine, set);
  stamp(c, kCombine, kEnd);
}

// As dispatch_kernel: either phase, or both.
__global__ void __launch_bounds__(kWarps * 32) combine_kernel(Ctx c, int phases, int set, int dset, Set d, const uint16_t* y,
                                                              Sums sums) {
  stamp(c, kCombine, kStart);
  note_start(c, kCombine, set, phases);
  if (phases & kSendPhase) combine_send(c, set, dset, d, y, sums);
  if (phases & kRecvPhase) combine_recv(c, set, d, sums);
}

}  // namespace

void combine(const Ctx& c, int phases, int set, int dispatch_set, const Set& dispatched, const uint16_t* y,
             const Sums& sums) {
  combine_kernel<<<c.blocks, kWarps * 32, 0, c.stream>>>(c, phases, set, dispatch_set, dispatched, y, sums);
}

void preload_combine_kernels() { preload(combine_kernel); }

}  // namespace epx::detail::ll
