// Plain structs shared by the CUDA backend's host code and its kernels.
#pragma once
#include <cstdint>

#include "cuda/transport/window.hpp"

namespace epx::detail {

// Signals a rank receives: counters in its window that peers add to; never reset, so a
// wait compares with a target that grows with every call (the same on every rank).
enum SignalKind : int { kSignalPlan = 0, kSignalForward = 1, kSignalReverse = 2, kSignalKinds = 3 };

// What went wrong, as kernels report it in DeviceStatus::code.
enum StatusCode : int32_t {
  kStatusOk = 0,
  kStatusBadExpert = 1,        // a = token, b = slot, c = value
  kStatusRepeatedExpert = 2,   // a = token, b = first slot, c = expert
  kStatusHostRejected = 3,     // this rank's host code rejected the input (message kept on the host)
  kStatusPeerRejected = 4,     // rank = peer; a, b, c = the peer's code, first detail, ...
  kStatusCallMismatch = 5,     // rank = peer; a = its call kind, b = its call number
  kStatusTimeout = 6,          // rank = the first missing peer; a = signal kind
  kStatusBadTokenCount = 7,    // low-latency num_tokens: a = its value, b = T
  kStatusNonFinite = 8,        // check_finite: a = token, b = channel (x_scales: block), c = tensor << 32 | the
                               // value's fp32 bits (tensor 0: x, 1: x_scales)
  // expert_replicas (EPLB); an entry is named by its index e * W + j in the [E, W] table
  kStatusReplicaOutOfRange = 9,   // a = entry, b = value
  kStatusReplicaRepeated = 10,    // a = entry, b = value, c = the earlier entry with that value
  kStatusReplicaEmptyRow = 11,    // a = row (logical expert)
  kStatusReplicaMismatch = 12,    // rank = peer whose table differs (its hash)
};

// Written by kernels into host-mapped memory; the first error wins.
struct DeviceStatus {
  int32_t code;
  int32_t rank;
  int64_t a, b, c, d;
};

// What a blocking call's last plan exchange writes into host-mapped memory for the call's one
// host read (CudaBackend::plan_ok): the device's status so far and, after a dispatch's layout,
// the sizes its outputs are cut to. No copy call and no status kernel stand between the plan and
// the host.
struct PlanReport {
  DeviceStatus status;
  int64_t info[4];  // the layout's info words: rows received, num_rows, capacity, overflow
  int64_t dropped;  // (token, slot) pairs the drop rule dropped (0 without capacity_factor)
  int64_t rank_offsets[kMaxRanks + 1];
};

// The message every rank posts at the start of every call. A plan slot holds it, then a host
// rejection's words (PlanMessage), then the counts (int64 [E + R]).
struct PlanHeader {
  int32_t call_kind;  // 0 dispatch, 1 combine, 2 dispatch_backward, 3 combine_backward
  int32_t error;      // StatusCode of this rank's own input check
  int64_t call_index;
  int64_t tokens;
  int64_t signature;  // hash of the options that must agree
  int64_t detail[3];  // error details
  int64_t replica_hash;  // a dispatch with EPLB: a hash of this rank's replica table (0 otherwise)
};
// A host-side rejection, in words. Only a rejecting rank posts it (post_plan), and peers read it
// only for that error (kStatusHostRejected), so a good call's exchange neither carries it in its
// kernel's parameters nor writes it.
struct alignas(16) PlanMessage {  // aligned: its copy into a peer's slot is 16 vector stores
  char text[256];
};
constexpr int64_t kPlanMessageAt = sizeof(PlanHeader);                      // in a plan slot
constexpr int64_t kPlanCountsAt = sizeof(PlanHeader) + sizeof(PlanMessage);  // in a plan slot

// Dispatch moves tokens in chunks of this many consecutive source tokens: the unit of the
// positions scan, of the per-chunk ready flags, and of the receivers' and reducers' work.
constexpr int kChunkTokens = 16;

// Where a chunk's rows sit in the stream from one source to one destination.
struct ChunkRange {
  int32_t start;  // first position in the stream
  int32_t count;  // rows
};
// A range packed into the low 32 bits of a forward chunk flag (start < 2^27: max_tokens_per_rank
// is checked against it).
constexpr int kRangeCountBits = 5;
static_assert(kChunkTokens < (1 << kRangeCountBits), "a chunk's row count must fit its bits");

// Pieces a broadcast (and a copy-engine return) is cut into: the receivers start on a piece as soon as it is in.
constexpr int kMaxPieces = 16;

// Byte offsets inside every rank's window (the same on all ranks).
struct WindowMap {
  int64_t signals;       // uint64 [kSignalKinds][R]
  int64_t plans;         // [2 parities][2 phases][R] plan_stride bytes: header, message, int64 [E + R]
  int64_t plan_stride;
  int64_t max_chunks;    // chunks of max_tokens
  int64_t fwd_chunk_flag;   // uint64 [R][max_chunks]: chunk c from source s is here: epoch << 32 | its range
                            // (start << kRangeCountBits | count)
  int64_t rev_chunk_flag;   // uint32 [R][max_chunks]: call epoch once rank d returned chunk c
  int64_t fwd_payload;   // [R * max_tokens] rows of payload_stride bytes
  int64_t payload_stride;
  int64_t fwd_token;     // int32 [R * max_tokens]
  int64_t fwd_slot_expert;  // int32 [R * max_tokens * K]
  int64_t fwd_slot_weight;  // f32 [R * max_tokens * K]
  int64_t fwd_slot_index;   // int32 [R * max_tokens * K]: the pair's index among the source's pairs of that expert
  int64_t rev_rows;      // bf16 [R * max_tokens * H]
  int64_t rev_slots;     // f32 [R * max_tokens * K]
  int64_t rev_piece_flag;   // uint32 [R][kMaxPieces]: copy-engine combine: the call epoch once rank d's
                            // rows of stream positions [return_start[p], return_start[p + 1]) are in rev_rows
  int32_t return_start[kMaxPieces + 1];  // the copy-engine return's pieces; entries past the last piece
                                         // are max_tokens
  // Copy-engine dispatch (docs/lab/2026-12-01-performance-diary.md): every source's whole
  // input, copied here by its copy engines in pieces of piece_tokens tokens, each piece flagged
  // after it (copy-engine combine cuts its rows by stream position the same way).
  int64_t bcast_rows;       // [R][max_tokens] rows of bcast_stride bytes (none when the buffer does not broadcast)
  int64_t bcast_stride;
  int64_t piece_tokens;
  int64_t bcast_flag;       // uint32 [R][kMaxPieces]: the call epoch once source s's piece p is here
  int64_t bcast_free;       // uint32 [R]: the epoch of the last dispatch whose rows rank d has read from this rank
  int64_t bcast_epoch_src;  // uint32: this rank's current epoch, the value its flag copies carry
  // ... and each source's placing data, copied after its positions (global expert ids; stream
  // positions at every rank; each pair's index among the source's pairs of its expert).
  int64_t meta_expert;      // int32 [R][max_tokens * K] (none when the buffer does not broadcast)
  int64_t meta_weight;      // f32 [R][max_tokens * K]
  int64_t meta_pos;         // int32 [R][max_tokens * R]
  int64_t meta_index;       // int32 [R][max_tokens * K]
  int64_t meta_flag;        // uint32 [R]: the call epoch once source s's placing data is here
  int64_t total;
};

// Per buffer, in device memory: the number of the current call and what each signal counter
// reaches after its current step. Kernels advance them, so a captured CUDA graph replays with
// fresh values; the host counts calls only for its messages.
struct CallState {
  uint64_t call;                   // calls begun; the current call's epoch is this value (call index + 1)
  uint64_t targets[kSignalKinds];  // per signal kind
  uint32_t bcast_epoch;            // the epoch of this rank's last broadcast (copy-engine dispatch)
  // Blocks of the call's transfer kernel (dispatch, combine, combine_backward: one a call) started
  // (arrival_order) and finished (last_block); the last block of each resets its count.
  uint32_t transfer_arrivals;
  uint32_t transfer_blocks_done;
  uint32_t placing_blocks_done;    // copy-engine dispatch: placing blocks finished (the last resets it)
  uint32_t plan_blocks_done;       // dispatch plan kernel blocks finished (the last resets it)
  uint32_t plan_arrivals;          // dispatch plan kernel blocks started (arrival_order)
  uint32_t plan_begun;             // 1 once the plan kernel's first block began the call (the last block resets it)
  uint64_t replica_hash;           // EPLB: the hash of this call's replica table (the plan's first block)
};

// Redundant experts (EPLB): one dispatch's replica table [logical, width] i32 (a null table: off),
// on the device, and P words of scratch for its check (kernels/replicas.cuh).
struct ReplicaTable {
  const int32_t* table = nullptr;
  int32_t* seen = nullptr;
  int64_t logical = 0, width = 0, physical = 0;
  int64_t stride = 0;  // between rows, in entries (>= width)
};

// Sizes every kernel needs.
struct Shape {
  int32_t rank, ranks;
  int64_t hidden, topk, experts, local_experts, max_tokens;
  bool shared_expert;  // BufferConfig::shared_expert: expert-major layouts start with the shared segment
};

}  // namespace epx::detail
