// Host-side launchers of the CUDA backend's kernels. Each returns after enqueueing on ctx.stream.
#pragma once
#include <cuda_runtime.h>

#include <vector>

#include "cuda/kernels/device_types.hpp"
#include "epx/config.hpp"

namespace epx::detail::kernels {

struct Ctx {
  PeerWindows peers;
  WindowMap map;
  Shape shape;
  DeviceStatus* status;  // device memory
  CallState* state;      // device memory
  uint64_t timeout_ns;
  int blocks;            // grid of the data-moving kernels (the SM budget)
  cudaStream_t stream;
};

// Routing input as the kernels read it: top-k (i32 or i64) or a dense bool map.
struct RoutingInput {
  const void* topk_idx = nullptr;  // [T, K], row stride idx_stride elements
  bool idx64 = false;
  int64_t idx_stride = 0;
  const float* topk_weights = nullptr;  // [T, K] or null
  int64_t weight_stride = 0;
  const uint8_t* routing_map = nullptr;  // [T, E] or null
  int64_t map_stride = 0;
  const float* probs = nullptr;  // [T, E] or null
  int64_t probs_stride = 0;
  int64_t experts = 0;  // E, the router's experts (ids in [0, E), map columns); with EPLB fewer than Shape::experts
};

// BufferConfig::check_finite: arrays the routing kernel scans for a NaN or an infinity, the one it
// finds reported as kStatusNonFinite (which one, when there are several, is unspecified). parts 0:
// off, nothing is scanned.
struct FiniteScan {
  const char* data = nullptr;  // [rows, cols], rows stride_bytes apart
  int64_t stride_bytes = 0;
  int64_t cols = 0;
  int32_t elem_bytes = 0;  // 2: bf16, 1: e4m3 (its NaN codes), 4: f32
  int32_t tensor = 0;      // for the message: 0 x, 1 x_scales
};
struct FiniteCheck {
  FiniteScan part[2];  // x, then (pre-quantized input) x_scales
  int parts = 0;
};

// Loads every kernel of the backend. CUDA loads kernels lazily, at their first launch, and a
// load may wait for all kernels running on the device; on a GPU shared by ranks that includes
// a peer's kernel waiting for this rank: a deadlock. Buffers call this before their collective setup.
void preload_kernels();
void preload_plan_kernels();
void preload_route_kernels();
void preload_dispatch_kernels();
void preload_combine_kernels();
void preload_combine_backward_kernels();
void preload_broadcast_kernels();

// Starts a call on the device: the call number advances, the status is cleared. A call may also
// begin in its first plan exchange (ExchangeJob::begins_call) or its rejection's post.
void begin_call(const Ctx& ctx);
// Posts this rank's rejection (its plan header and message, no counts) into every rank's plan
// slot of this call's `phase` and signals it. The call number and the error fields of the header
// come from the device (ctx.state, ctx.status). begins_call: the call begins here first.
void post_plan(const Ctx& ctx, const PlanHeader& header, const PlanMessage& message, int phase,
               bool begins_call = false);
// Advances the target of signal `kind` by `increment` and (when `wait`) waits for every rank's
// counter to reach it.
void wait_signals(const Ctx& ctx, int kind, uint64_t increment, bool wait = true);
// Blocking mode's report of a call's last plan exchange (ExchangeJob).
struct ReportJob {
  PlanReport* to = nullptr;         // host-mapped; null: no report
  const int64_t* dropped = nullptr;  // the dispatch's dropped count, or null (none)
};
// The drop rule on this rank's slots; adds the dropped count to *dropped.
void drop_slots(const Ctx& ctx, int64_t tokens, int32_t* slot_expert, float* slot_weight, const int64_t* expert_prefix,
                const int64_t* drop_capacity, int64_t* dropped);

// The sender's half of the layout, per chunk of kChunkTokens tokens. Columns: E experts, then R
// ranks. The plan kernel's blocks each own chunks_per_block consecutive chunks: a chunk's place
// among the rank's rows of a column is its block's base plus its place among the block's chunks
// (chunk_bases, chunk_bases.cuh).
struct ChunkPositions {
  int32_t* chunk_count;  // [C, E+R] pairs of each expert / tokens to each rank in the chunk
  int32_t* chunk_base;   // [C, E+R] exclusive scan over the chunks of the chunk's block
  int32_t* block_base;   // [G, E+R] exclusive scan over the plan kernel's G blocks
  int64_t chunks_per_block;
  int64_t* totals;       // [E+R] this rank's pairs per expert, then tokens per destination rank
  int32_t* send_pos;     // [T, R] place in the chunk (plan kernel), the stream position (send), or -1
  int32_t* slot_pos;     // [T, K] the pair's place among the chunk's pairs of its expert (0: no expert)
};
// The plan kernel's split of `tokens` tokens over at most `blocks` blocks: its grid and each
// block's consecutive chunks.
struct PlanSplit {
  int grid;
  int64_t chunks_per_block;
};
PlanSplit plan_split(int blocks, int64_t tokens);

// A rank's placing data in its own arrays: slot_expert (global ids or -1) [T*K], slot weights
// [T*K], stream positions at each rank (or -1) [T*R], each pair's index among the rank's pairs of
// its expert [T*K].
struct Placing {
  const int32_t* expert;
  const float* weight;
  const int32_t* pos;
  const int32_t* index;
};
// Copy-engine dispatch: send_pos and slot_pos made final in place (what the SM sender does as it
// sends), so they form this rank's Placing with slot_expert and slot_weight.
void finalize_positions(const Ctx& ctx, int64_t tokens, const int32_t* slot_expert, const ChunkPositions& p);
// Copy-engine dispatch, on ctx.stream after begin_broadcast: this rank's placing data into every
// other rank's meta_* arrays (SM stores: ~400 KB at V3), then its meta_flag there.
void broadcast_placing(const Ctx& ctx, const Placing& mine, int64_t tokens);

// The token rows a forward transfer sends.
struct SendRows {
  const char* x = nullptr;  // bf16 rows, or fp8 codes when prequantized
  int64_t x_stride_bytes = 0;
  const float* x_scales = nullptr;  // prequantized fp8 only
  int64_t scales_stride = 0;
  WireFormat wire = WireFormat::bf16;
  float nvfp4_global_scale = 0.0f;
};

// Whether a rank's own rows reach its outputs straight from x (their wire row is a plain copy of
// the input: bf16, or fp8 given pre-quantized) rather than through its window.
__host__ __device__ inline bool own_rows_from_input(const SendRows& rows) {
  return rows.x_scales || rows.wire == WireFormat::bf16;
}

// Copy-engine dispatch, on stream `copies`: begin_broadcast waits until every rank has read this
// rank's previous broadcast; then rows [0, tokens) of x go into every other rank's bcast_rows,
// piece by piece, each piece flagged in bcast_flag (broadcast_pieces: a dispatch can enqueue the
// first pieces, launch its routing and then enqueue the rest; one stream keeps them in order).
void begin_broadcast(const Ctx& ctx, cudaStream_t copies);
// Copy-engine dispatch of a quantized wire, on ctx.stream after begin_broadcast: this rank's wire
// rows [0, tokens) into its own part of bcast_rows (the broadcast then sends them from there).
void encode_rows(const Ctx& ctx, const SendRows& rows, int64_t tokens);
// One piece of a copy-engine transfer to a peer's window: its parts (rows of row_bytes from src to
// dst, each its stride apart: a piece's rows, then its slot values if any), then the call's epoch
// (the 4 bytes at `epoch`) into the piece's flag there, which says the parts have landed.
struct FlaggedPiece {
  struct Part {
    char* dst;
    int64_t dst_stride;
    const char* src;
    int64_t src_stride, row_bytes, rows;
  };
  Part part[2];
  int parts;
  char* flag;
  const char* epoch;
};
// A broadcast's pieces [first_piece, end_piece) of rows [0, tokens) of x (row_bytes each), in the
// order they go: piece by piece, each to every other rank (after begin_broadcast).
std::vector<FlaggedPiece> broadcast_pieces(const Ctx& ctx, const char* x, int64_t x_stride_bytes, int64_t row_bytes,
                                           int64_t tokens, int64_t first_piece, int64_t end_piece);
// By copy calls on stream `copies`, in order (the engine queue keeps each flag after its parts).
void copy_pieces(const std::vector<FlaggedPiece>& pieces, cudaStream_t copies);
// Tells every rank that this rank read their broadcasts of this call (a dispatch whose receiver
// does not run: its input was rejected on the host).
void release_broadcast(const Ctx& ctx);

// Cached dispatch (cached_dispatch.cu). scan_x_finite: check_finite's scan of x alone, before
// the call's plan exchange carries what it found to the peers. encode_to_rows: each token's wire
// row at the start of its row of `staging` (rows `stride` bytes apart), for expand_transfer to move.
// split_wire_rows: rows of wire bytes into recv_x / recv_scales / recv_global_scale.
struct WireSplit {
  char* x;
  char* scales;  // or null
  char* global;  // or null
  int64_t x_bytes, scale_bytes, global_bytes;
};
void scan_x_finite(const Ctx& ctx, const FiniteCheck& check, int64_t tokens);
void encode_to_rows(const Ctx& ctx, const SendRows& rows, int64_t tokens, char* staging, int64_t stride);
void split_wire_rows(const Ctx& ctx, const char* from, int64_t stride, int64_t rows, const WireSplit& to);
void preload_cached_dispatch_kernels();

// Receive side of dispatch, in the handle.
struct RecvArrays {
  int64_t* info;            // [0] rows received M, [1] num_rows, [2] capacity, [3] overflow
  int64_t* rank_offsets;    // [R+1]
  // The routed experts' segments: [L] and [L+1]. With the fused shared expert the shared
  // segment's count and offset sit just before them, at [-1] (the outputs start there).
  int64_t* tokens_per_expert;  // [L]
  int64_t* expert_offsets;  // [L+1]
  int64_t* expert_base;     // [R, L]: rows of expert l from lower ranks
  int32_t* chunks_from;     // [R]: chunks each source sent
  ChunkRange* chunk_range;  // [R, max_chunks]: rows of each source chunk (for the reverse transfer)
  int32_t* src_rank;        // [R*max_tokens] per received row (rank-major order)
  int32_t* src_token;
  int32_t* slot_expert;     // [R*max_tokens*K] local expert or -1
  float* slot_weight;
  int64_t* slot_row;        // output row of the pair (expert-major), the row itself (rank-major), or -1
};
// From the dispatch plans (of this call's `phase`): offsets, counts and sizes of this rank's
// receive layout (receive_layout.cuh), computed by the plan exchange's kernel (exchange_plan).
// capacity_rows > 0: capacity mode's fixed output rows.
struct LayoutJob {
  RecvArrays r;
  Layout layout;
  int64_t alignment;
  int64_t capacity_rows;
  int64_t* load = nullptr;  // [L] the buffer's load counters: += each local expert's (token, slot) pairs
  // BufferConfig::shared_expert: this rank's tokens, the shared segment's rows before the routed
  // ones (expert-major); -1 without it.
  int64_t shared_tokens = -1;
};

// The fused shared expert (BufferConfig::shared_expert, expert-major): segment 0 of this rank's
// own receive layout holds its `tokens` tokens, token t at row t; rows [tokens, padded) are zero.
// A dispatch's receivers write them (wire row, recv_src = (rank, t), recv_weights = weight[t]).
struct SharedRows {
  int64_t tokens = -1;           // -1: no shared expert
  const float* gate = nullptr;   // dispatch's shared_gate [T] (gate_stride apart), or null: weight 1
  int64_t gate_stride = 0;
  float* weight = nullptr;       // the handle's [T]: each shared row's weight, for combine and the backward passes
  __host__ __device__ bool on() const { return tokens >= 0; }
};
// The shared expert's term of a token's combine sum: row t of `rows` (y, or grad_recv_x) times
// weight[t] (null: 1), after the ranks' partials and before shared_out.
struct SharedTerm {
  const uint16_t* rows = nullptr;  // null: no shared expert
  int64_t stride = 0;
  const float* weight = nullptr;
};

// A plan exchange of this call's `phase` (exchange.cuh): this rank's header (+ count_len int64
// counts, or none) into every rank's plan slot, the wait for every rank's, then the checks of
// every rank's plan: same call, no rejected input. Fills *drop_capacity (capacity_factor > 0, else
// -1) and, with_counts, the per-expert prefix counts of lower ranks [E]. With a layout the same
// block then computes the receiver's layout (receive_layout.cuh); with a report (blocking mode's
// last exchange of a call) it ends by writing the status and the layout's sizes into report.to
// (host-mapped). The call number and the error fields of the header come from the device.
struct ExchangeJob {
  bool begins_call = false;  // the call begins here (as begin_call's kernel would), before the exchange
  PlanHeader header;
  const int64_t* counts = nullptr;
  int64_t count_len = 0;
  int phase = 0;
  bool with_counts = false;
  double capacity_factor = 0.0;
  int64_t* expert_prefix = nullptr;
  int64_t* drop_capacity = nullptr;
  bool with_layout = false;
  LayoutJob layout{};
  ReportJob report{};
};
// The exchange alone, in one single-block launch (the calls on a handle).
void exchange_plan(const Ctx& ctx, const ExchangeJob& job);

// A dispatch's plan in one launch (route.cu), then its plan exchange `x`. Each block reads and
// checks its tokens' routing (canonicalize: into slot_expert / slot_weight, with counts [E] +=
// per expert when not null, zeroed before; check_finite's scan of `finite` beside it) and counts
// its chunks (positions); the last block to finish scans the blocks' counts and runs the
// exchange. The drop rule's dispatch runs it twice: routing and the exchange of the counts, then
// (after drop_slots) positions and the exchange with the layout. begins_call: the call begins in
// the kernel's first block to start (the others wait for it), which also zeroes `sums` (the drop
// rule's counts) before any block adds to them; every block zeroes its part of `zeroed` (the
// handle's receive arrays) before the last block writes the layout.
struct ZeroBytes {
  char* from = nullptr;
  int64_t bytes = 0;
};
struct RouteJob {
  bool begins_call = false;
  ZeroBytes sums, zeroed;
  RoutingInput in;
  FiniteCheck finite;
  int32_t* slot_expert = nullptr;
  float* slot_weight = nullptr;
  int64_t* counts = nullptr;
  bool canonicalize = true;
  bool positions = true;
  ChunkPositions pos{};
  // EPLB (canonicalize only): each slot's logical expert is mapped to the replica chosen, which
  // goes into slot_expert and into `chosen` ([T, K], DispatchResult::topk_physical).
  ReplicaTable replicas;
  int32_t* chosen = nullptr;
  int chunk_warps = 0;  // plan_chunk_warps of the buffer's shape (found at its creation)
};
void plan_dispatch(const Ctx& ctx, int64_t tokens, const RouteJob& route, const ExchangeJob& x);
// How many of the plan kernel's warps count chunks on the current device with K = topk and
// width = E + R: as many as their shares (16 K + width counts each) fit in a block's shared
// memory, at most 16 (0: not one; the buffer refuses such a shape at creation).
int plan_chunk_warps(int64_t topk, int64_t width);

// The dispatch's transfer (dispatch.cu): this rank's routing and positions (the plan kernel's)
// for its senders, and its receive layout and outputs for its receivers.
struct SendPlan {
  const int32_t* slot_expert;
  const float* slot_weight;
  ChunkPositions pos;
};

struct RecvOutputs {
  char* x;          // [capacity, x_bytes]
  char* scales;     // [capacity, scale_bytes] or null
  char* global;     // [capacity] f32 or null
  int64_t x_bytes, scale_bytes, global_bytes;
  int32_t* src;     // [capacity, 2]
  float* weights;   // expert-major [capacity]
  int32_t* topk_idx;  // rank-major [capacity, K]
  float* topk_weights;
  bool bulk = false;  // set by the launchers: rows' codes go by bulk copy (bulk_copy.cuh)
  SharedRows shared{};  // the fused shared expert's rows, which the receivers write
};
// What the last block of a dispatch's transfer does for the call's end: the handle's layout
// words (RecvArrays::info onward, word_count of them) copied to words_out, and the status
// published to the host's mapped copy.
struct CallEnd {
  const int64_t* words = nullptr;
  int64_t* words_out = nullptr;
  int64_t word_count = 0;
  DeviceStatus* host_status = nullptr;
};
// SM engine: the dispatch's transfer in one launch of ctx.blocks blocks, `senders` of them
// sending (0: nothing to send, as at one rank when `rows` need no quantizing) and the others
// receiving: each token once to every other rank holding one of its experts (and to this rank
// when quantized), each received row into the outputs. `rows` are this rank's input rows, which
// the receivers place themselves when they need no quantizing.
// Whether this rank's own rows go through its window (a quantized wire row too long for a warp's
// stage), not from x to the outputs by the receivers: then a dispatch at one rank needs senders.
bool own_rows_sent(const SendRows& rows, int64_t wire_row_bytes);
void dispatch_transfer(const Ctx& ctx, int senders, const SendRows& rows, int64_t tokens, const SendPlan& plan,
                       const RecvArrays& r, const RecvOutputs& out, Layout layout, const CallEnd& end);
// Copy-engine dispatch's receiver (ctx.blocks blocks): every row's place comes from its source's
// Placing (this rank's: `mine`) and the plans of this call's `phase` give each source's token
// count; `own` are this rank's input rows.
void dispatch_receive(const Ctx& ctx, const RecvArrays& r, const RecvOutputs& out, Layout layout, const SendRows& own,
                      const Placing& mine, int phase, const CallEnd& end);

// Combine and dispatch_backward in one kernel: `send_blocks` blocks return each received chunk
// (partial sums of y in slot order; per-slot values from slot_values when not null: expert-major
// [N], rank-major [N, K]) to its source and flag it; the others reduce this rank's tokens once
// every rank's chunk is back (ranks in order, then shared; per-slot values into slot_out [T*K]).
struct CombineArgs {
  const uint16_t* y;
  int64_t y_stride;
  bool weighted;
  const float* slot_values;
  int64_t slot_values_stride;
  const uint16_t* shared_out;  // combine's shared_out [T, H] (added last), or null
  int64_t shared_out_stride;
  uint16_t* out;
  float* slot_out;
  SharedTerm shared{};  // the fused shared expert's rows (from the expert side's y: never by copy)
  // dispatch_backward with the fused shared expert: grad_shared_gate [T] = grad_recv_weights' row
  // t (the shared row's weight's gradient), gate_grads_stride apart.
  const float* gate_grads = nullptr;
  int64_t gate_grads_stride = 0;
  float* shared_gate_out = nullptr;
  // Copy-engine return: the expert ranks' copy engines return their rows and slot values (the
  // partials, expert-major), flagged per piece (rev_piece_flag), and this rank's own tokens' are
  // read where they start in y and slot_values, or in the partials (own_*: row
  // rank_offsets[rank], then by stream position, y_stride / slot_values_stride apart). No block
  // returns rows.
  bool by_copy = false;
  const uint16_t* own_rows = nullptr;
  const float* own_slot_values = nullptr;
  // SM engine, rank-major, bf16 wire: this rank's own tokens' rows (and slot values) are read in
  // place, where they start in y (row rank_offsets[rank], from the device's layout), none
  // through the window: a row's one term is y's row, which the reducers add as the window's copy
  // (bf16(0 + y)) would be added. No block returns this rank's own chunks.
  bool own_in_place = false;
  // Host-mapped: the kernel's last block publishes the call's status there (the call's end).
  DeviceStatus* host_status = nullptr;
  // combine's BufferConfig::combine_wire: fp8 partials cross back (fp8_partials.cuh; y 16-byte
  // aligned, its rows too); the SM engine only (by_copy false). dispatch_backward: bf16.
  WireFormat wire = WireFormat::bf16;
};
void combine(const Ctx& ctx, int send_blocks, const RecvArrays& r, Layout layout, int64_t tokens,
             const int32_t* send_pos, const int32_t* slot_expert, const CombineArgs& a);
// Copy-engine return of the expert-major layout: the partials of received rows (rank-major order
// i = first + j + (j >= gap_at ? gap : 0) for j < count) summed as the SM path returns them
// (docs/semantics.md), into rows [i] (bf16 [M, H]) and, when a.slot_values is given, slots [i]
// (f32 [M, K]); return_pieces then move them as a rank-major y.
struct PartialRows {
  uint16_t* rows;
  float* slots;  // or null
  int64_t first, count, gap_at, gap;
};
void reduce_partials(const Ctx& ctx, const RecvArrays& r, const CombineArgs& a, const PartialRows& p);
// n rows of row_bytes from src to dst (each its stride apart) by copy engine on stream `copies`:
// one plain copy when both are packed, else a 2D copy.
void copy_rows(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t row_bytes, int64_t n,
               cudaStream_t copies);
struct ReturnRows {
  const char* y;
  int64_t y_stride_bytes;
  const char* slot_values;  // or null
  int64_t slot_stride_bytes;
};
// Copy-engine return (combine, dispatch_backward): y's rows of each other rank (rows
// [rank_offsets[d], rank_offsets[d+1]) of y, in its stream order) to that rank's rev_rows, and their
// K slot values (f32, when slot_values is given) to its rev_slots, in the return's pieces, each
// flagged with the call's epoch (read from `epoch`, the low half of CallState::call), in the order
// they go. rank_offsets: the host's copy.
std::vector<FlaggedPiece> return_pieces(const Ctx& ctx, const ReturnRows& rows, const std::vector<int64_t>& rank_offsets,
                                        const void* epoch);
// combine_backward's and cached_dispatch's transfer (combine_backward.cu) in one launch of
// ctx.blocks blocks: the first `senders` to start (0 at one rank) move each token's row of `rows`
// (2H bytes: grad_out, or a cached dispatch's encoded wire rows) once to every other rank holding
// one of its slots, at its dispatch stream position send_pos, flagging each chunk; the others
// expand every received row into its output rows (this rank's own straight from `rows`), zero
// the empty ones and, weighted (expert-major), return each slot's weight gradient, then gather
// this rank's tokens' gradients into slot_out [T, K].
struct Expansion {
  Layout layout;
  bool weighted;
  const uint16_t* y;  // weighted: combine's y rows, y_stride elements apart
  int64_t y_stride;
  uint16_t* out;      // [capacity, H]: grad_y, or a cached dispatch's rows
  float* slot_out;    // weighted: [T, K]
  DeviceStatus* host_status;  // host-mapped, or null: the last block publishes the call's status there
  // The fused shared expert: out rows [0, T) from this rank's own input rows (times weight[t]
  // when weighted; with shared_gate_out, its dot with y row t goes there), zeros to the padding.
  SharedRows shared{};
  float* shared_gate_out = nullptr;
};
void expand_transfer(const Ctx& ctx, int senders, const SendRows& rows, int64_t tokens, const int32_t* send_pos,
                     const int32_t* slot_expert, const RecvArrays& r, const Expansion& e);

// Copies the device status to host-mapped memory (no atomics on host memory).
void publish_status(const Ctx& ctx, DeviceStatus* host_status);
void publish_status(const DeviceStatus* status, DeviceStatus* host_status, cudaStream_t stream);

}  // namespace epx::detail::kernels
