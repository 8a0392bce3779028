// Host-side launchers of the low-latency kernels (docs/low-latency.md). Sets alternate per call
// on the host (call n uses set n % 2), so a captured CUDA graph replays the same sets; arrival
// words and counts are reset by their receiver, so nothing carries over from one call to the next.
#pragma once
#include <cuda_runtime.h>

#include "cuda/kernels/device_types.hpp"
#include "epx/config.hpp"

namespace epx::detail::ll {

enum Kind : int { kDispatch = 0, kCombine = 1 };

// Source tokens per count (and per receive unit: one warp's ballot).
constexpr int kChunk = 32;

// Offsets in every rank's low-latency window (the same on all ranks). M = max_tokens_per_rank.
struct Map {
  int64_t arrivals;        // uint64 [2 kinds][2 sets][R]: each source's blocks done with the call
                           // (ll_common.cuh); reset by the receiver
  int64_t errors;          // uint32 [2 kinds][2 sets][R]: each source's error code of the call, or 0
  int64_t counts;          // int32 [2 sets][R][L][chunks]: each source's (token, local expert) pairs
                           // per chunk of kChunk tokens, added by the source, zeroed by the receiver
  int64_t ntok;            // int32 [2 sets][R]: each source's token count
  int64_t routes;          // int32 [2 sets][R][M][K]: each source's checked expert ids (-1: none)
  int64_t rows;            // [2 sets][R][M] wire rows of payload_stride bytes: source s's token t
  int64_t payload_stride;
  int64_t ret;             // bf16 [2 sets][M][R][H]: rank d's partial of token t, back at its source
  int64_t weights;         // f32 [2 sets][R][M][K]: each source's combine weights (weighted combine)
  int64_t weights_in;      // uint32 [2 sets][R]: 1 once source s's weights are here; reset by the receiver
  int64_t route_weights;   // f32 [2 sets][R][M][K]: the weights a source gave its dispatch (beside routes)
  int64_t weights_from;    // int32 [2 sets][R]: 1 when source s's dispatch of the set sent its weights
  int64_t table_hash;      // uint64 [2 sets][R]: EPLB, the hash of source s's replica table (before its arrival)
  int64_t total;
};

// This rank's arrays of one set (ordinary device memory). With the shared expert
// (LowLatencyConfig::shared_expert) the outputs' segment 0 sits one segment before the routed
// arrays (recv_x, recv_scales, recv_global, recv_src, recv_count, recv_layout begin at routed
// expert 0), so the kernels address it as local expert -1: its rows are this rank's tokens
// t < num_tokens, from this rank's own window slots (Ctx::shared_expert).
struct Set {
  int32_t* slot_expert;   // [M*K] the dispatch's checked routing; -1 unused or past num_tokens
  int32_t* num_tokens;    // [1] rows that counted
  char* recv_x;           // [L][R*M] x_bytes
  char* recv_scales;      // [L][R*M] scale_bytes, or null
  char* recv_global;      // [L][R*M] f32, or null
  int32_t* recv_src;      // [L][R*M][2]
  int32_t* recv_count;    // [L]
  int32_t* recv_layout;   // [L][R][2]
  int32_t* prev_count;    // [2][L] the counts of the previous dispatch on this set (rows to clear): half
                          // *count_half is read by a call, the other written for the next; with the
                          // shared expert [2][L] + [2]: segment 0's rows (own_prev)
  int32_t* count_half;    // [1] 0 or 1, flipped by each dispatch's last block
  int32_t* row_of;        // [R*M*K] received row (l * R*M + j) of (source, token, slot); read for local slots only
  uint16_t* out;          // [M][H] combine output
};

struct Ctx {
  PeerWindows peers;
  Map map;
  int64_t hidden, topk, experts, local, max_tokens;
  WireFormat wire;
  int64_t x_bytes, scale_bytes, global_bytes;
  DeviceStatus* status;
  DeviceStatus* host_status;  // mapped host copy, written at the end of each receive half
  uint64_t* host_started;     // mapped host [2 kinds][2 sets]: global timer when the call's send half began
  uint32_t* done;  // [2] blocks done with the receive phase of dispatch, combine; reset by the last
  uint64_t timeout_ns;
  int blocks;
  cudaStream_t stream;
  uint64_t* stamps;  // EPX_PROFILE=ll: [2 kinds][blocks][kStampSteps] global timer per step, else null
  int64_t call = 0;  // the call's number among its kind's (ll_dispatch #n, ll_combine #n), for a timeout's words
  int64_t* load = nullptr;  // [L] LowLatencyBuffer::expert_load's counters: each dispatch adds its recv_count
  WireFormat combine_wire = WireFormat::bf16;  // what the partials cross back in (docs/semantics.md, "Combine wire")
  bool shared_expert = false;  // LowLatencyConfig::shared_expert: the outputs' segment 0 (Set)
};

// What a timeout report's `a` holds: the call's number and the wait that ran out (the host reads
// it at its next call, so the call that timed out is named, not the one that finds out).
enum TimeoutStep : int64_t { kDispatchArrivals = 1, kCombineArrivals = 2, kCombineWeights = 3 };
constexpr int64_t kStepBits = 4;
__host__ __device__ constexpr int64_t timeout_where(int64_t call, TimeoutStep step) { return call << kStepBits | step; }

// The steps a block stamps (EPX_PROFILE=ll): start, its own writes done, counted in at every rank,
// every source in, its receive work done, and (the last block only) the call's end; then, within
// them, warp 0's first unit: its routing checked and sent (dispatch) or its weights in and terms
// looked up (combine), and the receive's rows found (dispatch: the list's barrier).
constexpr int kStampSteps = 9;
enum StampStep : int { kStart, kOwnWrites, kCountedIn, kSourcesIn, kReceived, kEnd, kFirstChecked, kFirstSent, kRowsFound };

struct Route {
  const void* topk_idx;
  bool idx64;
  int64_t idx_stride;
  const int32_t* num_tokens;  // device, or null: all T rows
  int64_t tokens;             // T
  const float* weights;       // [T, K] the combine's weights, given at dispatch, or null
  int64_t weight_stride;
  int64_t experts;            // E, the router's: ids in [0, E) (fewer than Ctx::experts with EPLB)
  ReplicaTable replicas;      // EPLB: each slot goes to the replica chosen (kernels/replicas.cuh)
  // The weights were given (a [0, K] tensor of a rank without tokens may have no data: given all
  // the same, as on the CPU backend). What every rank's combine reads in weights_from.
  bool has_weights = false;
};

struct Rows {
  const uint16_t* x;
  int64_t x_stride;  // elements
  float nvfp4_global_scale;
  bool check_finite = false;  // LowLatencyConfig::check_finite: the send half scans the rows that count
  const float* shared_gate = nullptr;  // [T] shared expert: the tokens' shared-row weights, or null (1)
  float* shared_weight = nullptr;      // [M] shared expert: where they go for combine (the set's; 1 without a gate)
};

// Combine's weights (this rank's tokens', sent to the expert ranks by the send half, unless this
// rank's dispatch sent them already: at_dispatch) and where its sums go: out[t] for t < tokens (T
// of the dispatch). Every rank must pass `weighted` alike. shared_y: the shared expert's rows
// of y (segment 0, [R*M][H]), added after the ranks' partials (times shared_weight when weighted).
struct Sums {
  const float* weights;
  int64_t weight_stride;
  bool weighted;
  int64_t tokens;
  uint16_t* out;
  bool at_dispatch;
  const uint16_t* shared_y = nullptr;
  const float* shared_weight = nullptr;  // [M] the dispatch's Rows::shared_weight
};

// The phases of one launch: the send half, the receive half, or both (the fused call: one
// launch instead of two).
enum Phase : int { kSendPhase = 1, kRecvPhase = 2 };

// A rank whose host rejected its input: its arrival of this call carries the error, no rows.
void reject(const Ctx& c, Kind kind, int set, int32_t code);
void dispatch(const Ctx& c, int phases, int set, const Route& route, const Rows& rows, const Set& s);
// `dispatch_set`: the set of the dispatch whose handle this is (its routing in the windows).
void combine(const Ctx& c, int phases, int set, int dispatch_set, const Set& dispatched, const uint16_t* y,
             const Sums& sums);
void preload_dispatch_kernels();  // ll_dispatch.cu's kernels (the rejection's too)
void preload_combine_kernels();   // ll_combine.cu's

}  // namespace epx::detail::ll
