// Host side of the CUDA backend: checks, the kernel sequence of each call, outputs, errors.
#include "cuda/cuda_backend.hpp"
#include "cuda/env_setting.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <functional>
#include <iterator>

#include "core/creation.hpp"
#include "core/routing.hpp"
#include "core/timeout.hpp"
#include "core/validate.hpp"
#include "core/validate_ops.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_handle.hpp"
#include "cuda/dispatch_input.hpp"
#include "cuda/stream_switch.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

namespace {

constexpr int kDefaultBlocks = 24;

// An engine variable: 'auto' when unset, else 'auto', 'sm' or 'copy'.
std::string engine_setting(const char* name) { return env_choice(name, {"auto", "sm", "copy"}); }

// Copy-engine dispatch (kernels/broadcast.cu). EPX_DISPATCH_ENGINE=copy or sm forces an engine;
// unset (auto), bf16 and fp8 wires at two ranks use the copy engines, where nearly every token
// goes to the other rank and they were measured faster; everything else the SM path: a broadcast
// sends every token to every rank, and nvfp4 by copy engine was not measured against the SM
// engine (docs/performance.md). Forced, the copy engines run at one rank too (nothing crosses,
// every kernel of the path runs): what lets compute-sanitizer, which needs a single rank, check them.
bool use_broadcast(const BufferConfig& c, int ranks) {
  const std::string engine = engine_setting("EPX_DISPATCH_ENGINE");
  return engine == "copy" || (engine == "auto" && ranks == 2 && c.wire != WireFormat::nvfp4);
}

// Copy-engine combine and dispatch_backward (blocking calls): EPX_COMBINE_ENGINE=copy or sm forces
// an engine (copy at any rank count, as above); unset (auto), two ranks return their rows by copy
// engine (docs/performance.md).
bool use_copy_combine(int ranks) {
  const std::string engine = engine_setting("EPX_COMBINE_ENGINE");
  return engine == "copy" || (engine == "auto" && ranks == 2);
}

// The dispatch's order of steps. lean (the default): the receiver's layout is computed by the plan
// exchange's kernel, and a copy-engine dispatch enqueues its broadcast's first two pieces, launches its
// routing and then enqueues the other pieces. classic (for measuring one against the other): the
// layout as a kernel of its own after the plan, the whole broadcast before routing
// (docs/performance.md).
bool lean_dispatch() {
  static const bool lean = env_choice("EPX_DISPATCH_ORDER", {"lean", "classic"}) == "lean";
  return lean;
}

WindowMap make_window_map(const BufferConfig& c, int ranks, const WireRow& wire, bool broadcast) {
  WindowMap m{};
  const int64_t rows = ranks * c.max_tokens_per_rank;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += round16(bytes);
    return here;
  };
  m.signals = take(8 * kSignalKinds * ranks);
  m.plan_stride = round16(static_cast<int64_t>(sizeof(PlanHeader)) + 8 * (c.num_experts + ranks));
  m.plans = take(2 * 2 * ranks * m.plan_stride);
  m.max_chunks = (c.max_tokens_per_rank + kChunkTokens - 1) / kChunkTokens;
  m.fwd_chunk_flag = take(8 * ranks * m.max_chunks);
  m.rev_chunk_flag = take(4 * ranks * m.max_chunks);
  m.payload_stride = round16(std::max(wire.bytes(), 2 * c.hidden));
  m.fwd_payload = take(rows * m.payload_stride);
  m.fwd_token = take(4 * rows);
  m.fwd_slot_expert = take(4 * rows * c.topk);
  m.fwd_slot_weight = take(4 * rows * c.topk);
  m.fwd_slot_index = take(4 * rows * c.topk);
  m.rev_rows = take(2 * rows * c.hidden);
  m.rev_slots = take(4 * rows * c.topk);
  m.rev_piece_flag = take(4 * ranks * kMaxPieces);
  m.bcast_stride = round16(wire.bytes());
  m.bcast_rows = take(broadcast ? rows * m.bcast_stride : 0);
  // Pieces per broadcast: 4, or EPX_BCAST_PIECES (tuning experiments). Each piece costs the host
  // two copy calls before anything else of the call is enqueued (docs/performance.md).
  const int64_t pieces = env_integer("EPX_BCAST_PIECES", 4, 1, kMaxPieces);
  const int64_t piece = (c.max_tokens_per_rank + pieces - 1) / pieces;
  m.piece_tokens = std::max<int64_t>(1, (piece + kChunkTokens - 1) / kChunkTokens * kChunkTokens);
  // The copy-engine return's pieces: the broadcast's, or halving (EPX_RETURN_PIECES=halving), so
  // what the reducers still have to do once the last piece lands is a sixteenth of the rows
  // instead of a quarter, for one more copy call per rank.
  return_piece_starts(c.max_tokens_per_rank, m.piece_tokens,
                      env_choice("EPX_RETURN_PIECES", {"equal", "halving"}) == "halving", m.return_start);
  m.bcast_flag = take(4 * ranks * kMaxPieces);
  m.bcast_free = take(4 * ranks);
  m.bcast_epoch_src = take(4);
  const int64_t placing = broadcast ? rows : 0;  // rows = R * max_tokens
  m.meta_expert = take(4 * placing * c.topk);
  m.meta_weight = take(4 * placing * c.topk);
  m.meta_pos = take(4 * placing * ranks);
  m.meta_index = take(4 * placing * c.topk);
  m.meta_flag = take(4 * ranks);
  m.total = at;
  return m;
}

// Carves typed arrays out of one block: first pass measures, second assigns.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += round16(count * static_cast<int64_t>(sizeof(T)));
    return p;
  }
  int64_t used() const { return used_; }

 private:
  char* base_;
  int64_t used_ = 0;
};

void carve_handle(DeviceHandle& h, Carver& c, int64_t tokens, const BufferConfig& cfg, int ranks, int64_t max_chunks) {
  const int64_t k = cfg.topk, rows = ranks * cfg.max_tokens_per_rank, l_count = cfg.num_experts / ranks;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens, width = cfg.num_experts + ranks;
  h.slot_expert = c.take<int32_t>(tokens * k);
  h.slot_weight = c.take<float>(tokens * k);
  h.pos.chunk_count = c.take<int32_t>(chunks * width);
  h.pos.chunk_base = c.take<int32_t>(chunks * width);
  h.pos.totals = c.take<int64_t>(width);
  h.pos.send_pos = c.take<int32_t>(tokens * ranks);
  h.pos.slot_pos = c.take<int32_t>(tokens * k);
  h.counts = c.take<int64_t>(cfg.num_experts);
  h.expert_prefix = c.take<int64_t>(cfg.num_experts);
  h.drop_capacity = c.take<int64_t>(1);
  h.dropped = c.take<int64_t>(1);
  h.recv.info = c.take<int64_t>(4);
  h.recv.rank_offsets = c.take<int64_t>(ranks + 1);
  h.recv.tokens_per_expert = c.take<int64_t>(l_count);
  h.recv.expert_offsets = c.take<int64_t>(l_count + 1);
  h.recv.expert_base = c.take<int64_t>(ranks * l_count);
  h.recv.chunks_from = c.take<int32_t>(ranks);
  h.recv.chunk_range = c.take<ChunkRange>(ranks * max_chunks);
  h.recv.src_rank = c.take<int32_t>(rows);
  h.recv.src_token = c.take<int32_t>(rows);
  h.recv.slot_expert = c.take<int32_t>(rows * k);
  h.recv.slot_weight = c.take<float>(rows * k);
  h.recv.slot_row = c.take<int64_t>(rows * k);
}

// Rows [first, first + rows) of a tensor (same memory).
Tensor row_range(const Tensor& t, int64_t first, int64_t rows) {
  TensorView v = t.view();
  v.data = static_cast<char*>(v.data) + first * v.strides[0] * dtype_size(v.dtype);
  v.shape[0] = rows;
  return Tensor(t.storage(), v);
}


// Stable hash of the options that must agree across ranks.
int64_t signature_of(std::initializer_list<int64_t> values) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

const char* call_kind_name(int32_t kind) {
  switch (kind) {
    case 0: return "dispatch";
    case 1: return "combine";
    case 2: return "dispatch_backward";
    case 3: return "combine_backward";
    case 4: return "cached_dispatch";
  }
  return "an unknown call";
}

// The words for an input error found on the device (same as the CPU backend's).
std::string input_error(int32_t code, int64_t a, int64_t b, int64_t c, const BufferConfig& cfg) {
  if (code == kStatusNonFinite)  // c: tensor << 32 | the value's fp32 bits
    return cat("dispatch: ", (c >> 32) ? "x_scales[" : "x[", a, "][", b, "] is not finite (",
               nonfinite_name(bits_float(static_cast<uint32_t>(c))), ")");
  if (code == kStatusBadExpert && b == cfg.topk)
    return cat("dispatch: routing_map row ", a, " selects more than topk=", cfg.topk, " experts");
  if (code == kStatusBadExpert)
    return cat("dispatch: topk_idx[", a, ", ", b, "] = ", c, " is out of range; expert ids must be in [0, ",
               cfg.num_experts, ") or -1 for an unused slot");
  if (code == kStatusRepeatedExpert)
    return cat("dispatch: token ", a, " selects expert ", c, " twice (first in slot ", b, "); each expert at most once per token");
  return cat("error code ", code);
}

// The placing graphs' copies: own rows' runs (~17 at EP2 with top-8 of 256), and each piece's runs
// of all sources (~5 at EP2); more go by copy calls. Every slot costs a launch ~0.25 us.
constexpr int kOwnRunSlots = 32, kPeerRunSlots = 8;

// Runs of rows by copy engine, one batched copy on `stream`: run r's rows from `from` (token t's
// row at from + t * from_stride) to rows of `to` (row_bytes each). One entry per run where the
// rows are packed, else one per row.
void copy_row_runs(const std::vector<RowRun>& runs, const char* from, int64_t from_stride, char* to,
                   int64_t row_bytes, cudaStream_t stream) {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  const bool packed = from_stride == row_bytes;
  for (const RowRun& run : runs)
    for (int64_t i = 0; i < (packed ? 1 : run.count); ++i) {
      dst.push_back(to + (run.row + i) * row_bytes);
      src.push_back(from + (run.token + i) * from_stride);
      bytes.push_back(static_cast<size_t>((packed ? run.count : 1) * row_bytes));
    }
  if (dst.empty()) return;
  cudaMemcpyAttributes in_order{};  // the rows are read in stream order (after what made them)
  in_order.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attribute_of_all = 0;
  EPX_CUDA(cudaMemcpyBatchAsync(dst.data(), src.data(), bytes.data(), dst.size(), &in_order, &attribute_of_all, 1,
                                stream));
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Group& group, const BufferConfig& config) {
  return std::make_unique<CudaBackend>(group, config);
}

// The ways this buffer moves rows (env-selected experiments and their defaults), and the streams
// they keep busy checked against the transport's limits.
void CudaBackend::choose_paths(const CudaGroupState& state) {
  // Tuning experiments (docs/performance.md); unset: the measured split (send_blocks()).
  send_blocks_override_ = static_cast<int>(env_integer("EPX_SEND_BLOCKS", 0, 1, blocks_ - 1));
  poison_outputs_ = std::getenv("EPX_POISON_OUTPUTS") != nullptr;
  broadcast_ = use_broadcast(config(), ranks_);
  // EPX_RECEIVER_START=early launches a copy-engine dispatch's receiver before the plan (an
  // experiment: no gain measured at one rank nor at two, docs/performance.md; unset: after the plan).
  early_receiver_ = std::string(state.transport_name()) != "shared-gpu" &&
                    env_choice("EPX_RECEIVER_START", {"after_plan", "early"}) == "early";
  copy_combine_ = use_copy_combine(ranks_);
  own_copies_ = broadcast_ && env_choice("EPX_OWN_ROWS", {"receiver", "copies"}) == "copies";
  peer_copies_ = broadcast_ && env_choice("EPX_PEER_ROWS", {"receiver", "copies"}) == "copies";
  // An experiment, off until measured at two ranks (docs/performance.md, "The fp8 encode").
  piece_encode_ = broadcast_ && wire_.format != WireFormat::bf16 &&
                  env_choice("EPX_ENCODE", {"whole", "pieces"}) == "pieces";
  // Read here, before the creation's agreement, so a bad value fails every rank (core/creation.hpp).
  piece_graphs_ = env_choice("EPX_PIECE_COPIES", {"calls", "graph"}) == "graph";
  piece_split_ = static_cast<int>(env_integer("EPX_PIECE_SPLIT", 1, 1, 4));
  place_graphs_ = env_choice("EPX_PLACE_COPIES", {"graph", "calls"}) == "graph";
  // The call's stream, the receiver's side stream, the copy engines' and the placing copies' streams.
  state.check_streams(2 + (broadcast_ || copy_combine_ ? 1 : 0) + (own_copies_ || peer_copies_ ? 1 : 0));
}

CudaBackend::CudaBackend(const Group& group, const BufferConfig& config)
    : Backend(group, config),
      rank_(group.rank()),
      ranks_(group.size()),
      local_experts_(config.num_experts / group.size()),
      wire_(wire_row(config.wire, config.hidden)) {
  // This backend's own checks of the config and the environment, then the creation's agreement
  // (core/creation.hpp): a rank refusing fails every rank at once, before anything collective.
  CudaGroupState* state = nullptr;
  agree_after_checks(group, "buffer", describe(config), config.timeout_ms, [&] {
    state = dynamic_cast<CudaGroupState*>(group.state().get());
    require(state != nullptr, "buffer: group is not a CUDA group");
    require(ranks_ <= kMaxRanks, "buffer: the CUDA backend supports at most ", kMaxRanks, " ranks, got ", ranks_);
    require(config.max_tokens_per_rank < (int64_t{1} << (32 - kRangeCountBits)),
            "buffer: the CUDA backend supports max_tokens_per_rank < 2^27, got ", config.max_tokens_per_rank);
    device_ = state->device(rank_);
    EPX_CUDA(cudaSetDevice(device_));
    int sms = 0;
    EPX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    blocks_ = static_cast<int>(config.num_sms > 0 ? config.num_sms : kDefaultBlocks);
    // Senders and receivers run at the same time and receivers wait for peers' senders: every
    // block must be resident at once, and each role needs one.
    require(blocks_ >= 2 && blocks_ <= sms, "buffer: num_sms must be in [2, ", sms, "] on cuda:", device_,
            " (at least one block sends and one receives; all must fit on the GPU at once), got ", blocks_);
    timeout_ = resolve_timeout(config.timeout_ms);  // EPX_TIMEOUT_MS may be bad on one rank's host
    choose_paths(*state);
    map_ = make_window_map(config, ranks_, wire_, broadcast_);  // reads EPX_BCAST_PIECES, EPX_RETURN_PIECES
  });
  // Everything that may synchronize the device comes before the collective window allocation:
  // once a rank returns from it, peers may already wait inside a call, and on a GPU shared by
  // several ranks a device-synchronizing call would wait for them (and they for us).
  kernels::preload_kernels();
  EPX_CUDA(cudaMalloc(&call_state_, sizeof(CallState)));
  EPX_CUDA(cudaMemset(call_state_, 0, sizeof(CallState)));
  EPX_CUDA(cudaMalloc(&status_, sizeof(DeviceStatus)));
  EPX_CUDA(cudaMalloc(&scratch_, sizeof(int64_t)));
  EPX_CUDA(cudaMemset(status_, 0, sizeof(DeviceStatus)));
  EPX_CUDA(cudaHostAlloc(&host_status_, sizeof(DeviceStatus), cudaHostAllocMapped));
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  EPX_CUDA(cudaHostAlloc(&host_info_, (8 + kMaxRanks + 1) * sizeof(int64_t), cudaHostAllocDefault));
  cudaStream_t own = nullptr;
  EPX_CUDA(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  owned_stream_ = std::shared_ptr<CUstream_st>(own, [](cudaStream_t st) { cudaStreamDestroy(st); });
  stream_ = own;
  EPX_CUDA(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
  if (broadcast_ || copy_combine_) EPX_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  if (broadcast_) EPX_CUDA(cudaEventCreateWithFlags(&broadcast_begun_, cudaEventDisableTiming));
  if (own_copies_ || peer_copies_) {
    EPX_CUDA(cudaStreamCreateWithFlags(&place_stream_, cudaStreamNonBlocking));
    EPX_CUDA(cudaEventCreateWithFlags(&positions_ready_, cudaEventDisableTiming));
    EPX_CUDA(cudaEventCreateWithFlags(&outputs_ready_, cudaEventDisableTiming));
    EPX_CUDA(cudaEventCreateWithFlags(&own_placed_, cudaEventDisableTiming));
    EPX_CUDA(cudaEventCreateWithFlags(&layout_ready_, cudaEventDisableTiming));
    const size_t positions = static_cast<size_t>(config.max_tokens_per_rank) * ranks_;
    EPX_CUDA(cudaHostAlloc(&host_pos_, 4 * positions, cudaHostAllocDefault));
    if (peer_copies_) {
      EPX_CUDA(cudaHostAlloc(&host_peer_pos_, 4 * positions * ranks_, cudaHostAllocDefault));
      EPX_CUDA(cudaHostAlloc(&host_layout_, sizeof(int64_t) * (2 * ranks_ + 1), cudaHostAllocDefault));
    }
  }
  EPX_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  EPX_CUDA(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  EPX_CUDA(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
  // Outputs come from the buffer's own pool, which keeps its memory between calls (the default
  // pool hands it back to the driver at every synchronization).
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device_;
  cudaMemPool_t pool = nullptr;
  EPX_CUDA(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = UINT64_MAX;
  EPX_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  // The pool goes when the buffer and every tensor allocated from it are gone.
  pool_ = std::shared_ptr<CUmemPoolHandle_st>(pool, [](cudaMemPool_t p) { cudaMemPoolDestroy(p); });
  if (piece_graphs_ && ranks_ > 1) {
    const int split = piece_split_;
    int return_pieces = 0;
    while (return_pieces < kMaxPieces && map_.return_start[return_pieces] < config.max_tokens_per_rank) ++return_pieces;
    const bool window = state->window_mapped();
    for (int mapped = 0; mapped < 2; ++mapped) {  // rows from plain memory, from mapped memory
      if (broadcast_)  // the epoch from this rank's window
        broadcast_graphs_.of_kind[mapped] =
            std::make_unique<PieceGraph>(peer_pieces() * (ranks_ - 1), split, mapped == 1, window, window, pool);
      if (copy_combine_)  // the epoch from the call state (cudaMalloc)
        return_graphs_.of_kind[mapped] =
            std::make_unique<PieceGraph>(return_pieces * (ranks_ - 1), split, mapped == 1, false, window, pool);
    }
  }
  // The placing copies' graphs: outputs come from the pool; own rows from x (most often plain
  // cudaMalloc memory), peer rows from the window.
  if (place_graphs_) {
    if (own_copies_) own_graph_ = std::make_unique<PlacementGraph>(1, kOwnRunSlots, pool, false);
    if (peer_copies_)  // from this rank's window
      peer_graph_ = std::make_unique<PlacementGraph>(peer_pieces(), kPeerRunSlots, pool, state->window_mapped());
  }
  EPX_CUDA(cudaDeviceSynchronize());
  window_ = state->allocate(rank_, static_cast<size_t>(map_.total), timeout_);
}

void CudaBackend::set_stream(void* stream) {
  cudaStream_t next = stream ? static_cast<cudaStream_t>(stream) : owned_stream_.get();
  order_after(stream_, next, fork_);  // earlier calls finish before later ones start, no host wait
  stream_ = next;
}

void CudaBackend::synchronize() { EPX_CUDA(cudaStreamSynchronize(stream_)); }

void CudaBackend::wait_event(void* event) {
  require(event != nullptr, "Buffer::wait_event: the event is null");
  EPX_CUDA(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event), 0));
}

void CudaBackend::record_event(void* event) {
  require(event != nullptr, "Buffer::record_event: the event is null");
  EPX_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event), stream_));
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamSynchronize(side_stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  if (place_stream_) cudaStreamSynchronize(place_stream_);
  window_->await_peers_release(timeout_);  // before any cudaFree (a shared GPU: cuda_group.hpp)
  {
    std::lock_guard<std::mutex> lock(block_cache_->mutex);
    for (const auto& block : block_cache_->blocks) cudaFreeAsync(block.first, side_stream_);
    block_cache_->blocks.clear();
  }
  block_cache_.reset();  // blocks released later go back to the pool
  cudaStreamSynchronize(side_stream_);
  window_.reset();
  cudaFree(status_);
  cudaFree(call_state_);
  cudaFree(scratch_);
  cudaFreeHost(host_status_);
  cudaFreeHost(host_info_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(join_);
  cudaEventDestroy(copies_done_);
  cudaStreamDestroy(side_stream_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (broadcast_begun_) cudaEventDestroy(broadcast_begun_);
  if (place_stream_) {
    cudaStreamDestroy(place_stream_);
    cudaEventDestroy(positions_ready_);
    cudaEventDestroy(outputs_ready_);
    cudaEventDestroy(own_placed_);
    cudaEventDestroy(layout_ready_);
    cudaFreeHost(host_pos_);
    if (host_peer_pos_) cudaFreeHost(host_peer_pos_);
    if (host_layout_) cudaFreeHost(host_layout_);
  }
}

// Runs of rows into `to` (row_bytes each) by the copy engines, on place_stream_, stage by stage: each
// job's runs from `from` (token t's row at from + t * from_stride) in its stage, behind that stage's
// gate when gates[stage] names ranks (it waits for their flag at window offset gate_flags + stage * 4
// + d * gate_stride * 4). Through the buffer's PlacementGraph, or by copy calls for what a stage
// cannot hold and for everything with EPX_PLACE_COPIES=calls (placement_graph.hpp says why not).
void CudaBackend::place_runs(PlacementGraph* graph, const std::vector<RunJob>& jobs, const std::vector<uint32_t>& gates,
                             int64_t gate_flags, int64_t gate_stride, char* to, int64_t row_bytes) {
  const kernels::Ctx place = ctx(place_stream_);
  const int stages = static_cast<int>(std::max<size_t>(1, gates.size()));
  const int64_t flag_bytes = sizeof(uint32_t);
  std::vector<RunJob> left;  // by copy calls
  for (int q = 0; q < stages; ++q) {
    const uint32_t peers = q < static_cast<int>(gates.size()) ? gates[q] : 0u;
    if (graph && peers) graph->gate(q, gate_flags + q * flag_bytes, gate_stride, peers);
    if (!graph && peers) kernels::wait_peer_flags(place, gate_flags + q * flag_bytes, gate_stride, peers);
    for (const RunJob& job : jobs) {
      if (job.stage != q) continue;
      if (!graph) {
        copy_row_runs(job.runs, job.from, job.from_stride, to, row_bytes, place_stream_);
        continue;
      }
      RunJob rest{job.stage, job.from, job.from_stride, {}};
      for (const RowRun& run : job.runs)
        if (!graph->add(q, to + run.row * row_bytes, row_bytes, job.from + run.token * job.from_stride, job.from_stride,
                        row_bytes, run.count))
          rest.runs.push_back(run);
      if (!rest.runs.empty()) left.push_back(std::move(rest));
    }
  }
  const size_t refused = graph ? graph->launch(place) : 0;
  // EPX_PROFILE=host tells which way the copies went (a refusal is correct, only slower).
  if (graph) host_steps_.mark(refused || !left.empty() ? "placing graph launched, some copies by calls"
                                                       : "placing graph launched");
  for (const RunJob& job : left)  // after the whole graph, so after every gate
    copy_row_runs(job.runs, job.from, job.from_stride, to, row_bytes, place_stream_);
}

// EPX_OWN_ROWS=copies: this rank's own bf16 rows from x to rows anchor + pos of recv_x by the copy
// engines, on place_stream_ once the outputs exist, in runs of consecutive tokens with consecutive
// rows. The positions come to the host first (one read, once the positions kernels are done: no
// other rank is waited for).
void CudaBackend::place_own_rows(const int32_t* send_pos, int64_t tokens, int64_t anchor, int64_t capacity,
                                 const kernels::SendRows& rows, char* recv_x, int64_t row_bytes) {
  EPX_CUDA(cudaStreamWaitEvent(place_stream_, positions_ready_, 0));
  EPX_CUDA(cudaMemcpyAsync(host_pos_, send_pos, static_cast<size_t>(4 * tokens * ranks_), cudaMemcpyDeviceToHost,
                           place_stream_));
  EPX_CUDA(cudaStreamSynchronize(place_stream_));
  host_steps_.mark("own positions read");
  RunJob own{0, rows.x, rows.x_stride_bytes, {}};
  if (!cut_row_runs(host_pos_, tokens, ranks_, rank_, -1, anchor, capacity, 0, own.runs))
    fail(ErrorCode::internal, "dispatch: an own row's place is outside the outputs (rank ", rank_, ")");
  EPX_CUDA(cudaStreamWaitEvent(place_stream_, outputs_ready_, 0));
  place_runs(own_graph_.get(), {own}, {}, 0, 0, recv_x, row_bytes);
  EPX_CUDA(cudaEventRecord(own_placed_, place_stream_));
  EPX_CUDA(cudaStreamWaitEvent(stream_, own_placed_, 0));
  host_steps_.mark("own rows' copies enqueued");
}

// EPX_PEER_ROWS=copies: the other ranks' bf16 rows from this rank's bcast_rows to rows
// rank_offsets[s] + pos of recv_x by the copy engines, on place_stream_ (shifted as the receiver
// shifts them when own rows went from own_anchor >= 0: place_own_rows). The host reads the layout
// and every source's positions (its placing data, once there), cuts each source's rows into runs
// that stay within one piece of its broadcast, and places each piece's runs behind a device wait for
// that piece (place_runs). Then the sources are told their rows here were read (the receiver, which
// places none of them, does not).
void CudaBackend::place_peer_rows(const kernels::RecvArrays& layout, int64_t own_anchor, int64_t capacity,
                                  char* recv_x, int64_t row_bytes) {
  const kernels::Ctx place = ctx(place_stream_);
  const int64_t max_tokens = config().max_tokens_per_rank;
  const uint32_t peers = ((1u << ranks_) - 1) & ~(1u << rank_);
  EPX_CUDA(cudaStreamWaitEvent(place_stream_, layout_ready_, 0));
  kernels::wait_peer_flags(place, map_.meta_flag, 1, peers);
  kernels::publish_status(place, host_status_);
  int64_t* offsets = host_layout_;
  auto* chunks = reinterpret_cast<int32_t*>(host_layout_ + ranks_ + 1);
  EPX_CUDA(cudaMemcpyAsync(offsets, layout.rank_offsets, (ranks_ + 1) * sizeof(int64_t), cudaMemcpyDeviceToHost,
                           place_stream_));
  EPX_CUDA(cudaMemcpyAsync(chunks, layout.chunks_from, ranks_ * sizeof(int32_t), cudaMemcpyDeviceToHost, place_stream_));
  const int64_t positions = max_tokens * ranks_;  // a source's part of meta_pos
  EPX_CUDA(cudaMemcpyAsync(host_peer_pos_, window_->local() + map_.meta_pos, 4 * positions * ranks_,
                           cudaMemcpyDeviceToHost, place_stream_));
  EPX_CUDA(cudaStreamSynchronize(place_stream_));
  host_steps_.mark("peer positions read");
  // After a failed wait what was read is not this call's: nothing is placed, the call's sync raises.
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  const int64_t shift = own_anchor >= 0 ? own_anchor - offsets[rank_] : 0;
  std::vector<RunJob> jobs;  // a job per (source, piece)
  std::vector<uint32_t> landing(static_cast<size_t>(peer_pieces()), 0u);  // per piece: the sources with rows in it
  bool cut = true;
  for (int s = 0; s < ranks_ && st.code == kStatusOk && cut; ++s) {
    if (s == rank_) continue;
    const int64_t tokens = std::min<int64_t>(int64_t{chunks[s]} * kChunkTokens, max_tokens);
    std::vector<RowRun> runs;
    cut = cut_row_runs(host_peer_pos_ + s * positions, tokens, ranks_, rank_, offsets[s + 1] - offsets[s],
                       offsets[s] + shift, capacity, map_.piece_tokens, runs);
    const char* from = window_->local() + map_.bcast_rows + s * max_tokens * map_.bcast_stride;
    for (const RowRun& run : runs) {
      const int q = static_cast<int>(run.token / map_.piece_tokens);
      if (jobs.empty() || jobs.back().stage != q || jobs.back().from != from)
        jobs.push_back(RunJob{q, from, map_.bcast_stride, {}});
      jobs.back().runs.push_back(run);
      landing[static_cast<size_t>(q)] |= 1u << s;
    }
  }
  EPX_CUDA(cudaStreamWaitEvent(place_stream_, outputs_ready_, 0));
  if (cut && st.code == kStatusOk)
    place_runs(peer_graph_.get(), jobs, landing, map_.bcast_flag, kMaxPieces, recv_x, row_bytes);
  kernels::release_broadcast(place);  // also when nothing was copied: the sources' next broadcasts wait for it
  EPX_CUDA(cudaEventRecord(own_placed_, place_stream_));
  EPX_CUDA(cudaStreamWaitEvent(stream_, own_placed_, 0));
  host_steps_.mark("peer rows' copies enqueued");
  if (!cut) fail(ErrorCode::internal, "dispatch: the positions of rows sent to rank ", rank_, " do not fit its layout");
}

// EPX_PIECE_COPIES=graph: the pieces through the graph of their rows' memory kind (the kind that
// served last is tried first). False: by copy calls (also while the caller captures the call into a
// graph of its own).
bool CudaBackend::by_graph(PieceGraphs& graphs, const std::vector<kernels::FlaggedPiece>& pieces, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;  // a caller's graph: none launched
  EPX_CUDA(cudaStreamIsCapturing(stream, &capturing));
  if (!graphs.of_kind[0] || capturing != cudaStreamCaptureStatusNone) return false;
  for (int i = 0; i < 2; ++i) {
    const int mapped = i == 0 ? graphs.last : 1 - graphs.last;
    if (graphs.of_kind[mapped]->launch(pieces, stream)) {
      graphs.last = mapped;
      return true;
    }
  }
  return false;
}

int CudaBackend::send_blocks(bool dispatch, Layout layout) const {
  // The split of the SM budget measured best on 2x H200 at the V3 shape (docs/performance.md):
  // expert-major receivers write each token ~4 times, so a dispatch gives them two thirds;
  // expert-major combine senders sum ~4 rows per token, so they get two thirds there.
  int send = blocks_ / 2;
  if (layout == Layout::expert_major) send = dispatch ? blocks_ / 3 : blocks_ * 2 / 3;
  if (send_blocks_override_ > 0) send = send_blocks_override_;
  return std::clamp(send, 1, blocks_ - 1);
}

kernels::Ctx CudaBackend::ctx(cudaStream_t stream) const {
  const BufferConfig& c = config();
  kernels::Ctx x{window_->peers(), map_, {}, status_, call_state_, static_cast<uint64_t>(timeout_.count()) * 1000000ull,
                 blocks_, stream ? stream : stream_};
  x.shape = {rank_, ranks_, c.hidden, c.topk, c.num_experts, local_experts_, c.max_tokens_per_rank};
  return x;
}

CudaBackend::Call CudaBackend::begin_call(CallKind kind) {
  Call call{kind, calls_, cat(call_kind_name(kind), " #", calls_)};
  if (broken_) fail(ErrorCode::peer_failed, call.name, " (rank ", rank_, "): the group already failed: ", broken_reason_);
  EPX_CUDA(cudaSetDevice(device_));
  check_earlier_calls(call);  // its timeout message tells the earlier call's host steps
  host_steps_.begin();
  // The host's call count and the device's advance together (plan slots are found from either).
  ++calls_;
  kernels::begin_call(ctx());
  host_steps_.mark("call begun");
  return call;
}

// The host-mapped status is the previous call's (published at its end, cleared by this call's
// begin kernel); a failure there was not raised yet when that call ran without a host sync.
void CudaBackend::check_earlier_calls(const Call& call) {
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  if (st.code == kStatusOk) return;
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  raise(st, Call{call.kind, call.index - 1, cat("the call before ", call.name, " (it ran without a host sync)")});
}

void CudaBackend::raise(const DeviceStatus& st, const Call& call) {
  const std::string who = cat(call.name, " (rank ", rank_, "): ");
  switch (st.code) {
    case kStatusBadExpert:
    case kStatusRepeatedExpert:
    case kStatusNonFinite:
      throw Error(ErrorCode::invalid_argument, input_error(st.code, st.a, st.b, st.c, config()));
    case kStatusPeerRejected: {
      std::string reason;
      if (st.a == kStatusHostRejected) {
        // A host rejection is posted in the call's first plan exchange (phase 0).
        const char* msg = window_->local() + map_.plans + (call.plan_slot(0) * ranks_ + st.rank) * map_.plan_stride +
                          offsetof(PlanHeader, message);
        char text[sizeof(PlanHeader::message)] = {};
        EPX_CUDA(cudaMemcpy(text, msg, sizeof text - 1, cudaMemcpyDeviceToHost));
        reason = text;
      } else {
        reason = input_error(static_cast<int32_t>(st.a), st.b, st.c, st.d, config());
      }
      fail(ErrorCode::peer_failed, who, "rank ", st.rank, " rejected its input, so the group stops: ", reason);
    }
    case kStatusCallMismatch:
      fail(ErrorCode::config_mismatch, who, "rank ", st.rank, " is in '", call_kind_name(static_cast<int32_t>(st.a)), " #",
           st.b, "' or uses other options; every rank must make the same collective calls in the same order, with "
           "the same options and handles of the same dispatch");
    case kStatusTimeout: {
      static const char* steps[] = {"plan exchange", "transfer", "return transfer"};
      broken_ = true;
      broken_reason_ = cat(call.name, " (", steps[st.a % 3], "): rank ", rank_, " waited ", timeout_.count(),
                           " ms for rank(s) ", st.rank,
                           ", which never arrived (crashed, hung, or called collective operations in a different order; "
                           "its signal here read ", st.c, ", awaited ", st.b,
                           "); this rank's host reached the steps of this call at: ", host_steps_.summary(),
                           "; ", signals_now());
      throw Error(ErrorCode::timeout, broken_reason_);
    }
    default:
      fail(ErrorCode::internal, who, "device reported status ", st.code);
  }
}

// What this rank's signal counters read now, after a wait gave up: a count that arrived after
// all tells a late peer from one that never signalled.
std::string CudaBackend::signals_now() const {
  std::vector<uint64_t> counts(static_cast<size_t>(kSignalKinds) * ranks_);
  if (cudaMemcpy(counts.data(), window_->local() + map_.signals, counts.size() * sizeof(uint64_t),
                 cudaMemcpyDeviceToHost) != cudaSuccess)
    return "its signals could not be read";
  static constexpr const char* kinds[] = {"plan", "forward", "reverse"};
  static_assert(std::size(kinds) == kSignalKinds, "a name for every signal kind");
  std::string text = "its signals from ranks 0.." + std::to_string(ranks_ - 1) + " read now:";
  for (int k = 0; k < kSignalKinds; ++k) {
    text += cat(" ", kinds[k], " [");
    for (int p = 0; p < ranks_; ++p) text += cat(p ? " " : "", counts[static_cast<size_t>(k) * ranks_ + p]);
    text += "]";
  }
  return text;
}

void CudaBackend::sync_and_check(const Call& call) {
  kernels::publish_status(ctx(), host_status_);
  EPX_CUDA(cudaStreamSynchronize(stream_));
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  if (st.code == kStatusOk) return;
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  raise(st, call);
}

PlanHeader CudaBackend::plan_header(const Call& call, const std::string& error, int64_t tokens, int64_t signature) const {
  PlanHeader h;
  std::memset(&h, 0, sizeof h);
  h.call_kind = call.kind;
  h.error = error.empty() ? kStatusOk : kStatusHostRejected;
  h.call_index = call.index;
  h.tokens = tokens;
  h.signature = signature;
  std::strncpy(h.message, error.c_str(), sizeof h.message - 1);
  return h;
}

void CudaBackend::reject(const Call& call, int phases, const std::string& error, int64_t tokens, int64_t signature) {
  const PlanHeader h = plan_header(call, error, tokens, signature);
  for (int phase = 0; phase < phases; ++phase) {  // peers wait for every exchange of the call
    kernels::post_plan(ctx(), h, nullptr, 0, phase);
    kernels::wait_signals(ctx(), kSignalPlan, 1, /*wait=*/false);  // keeps this rank's targets in step
  }
  throw Error(ErrorCode::invalid_argument, error);
}

void CudaBackend::reject(Op op, const std::string& reason) {
  static_assert(static_cast<int>(Op::dispatch) == kDispatch && static_cast<int>(Op::combine) == kCombine &&
                static_cast<int>(Op::dispatch_backward) == kDispatchBackward &&
                static_cast<int>(Op::combine_backward) == kCombineBackward &&
                static_cast<int>(Op::cached_dispatch) == kCachedDispatch);
  const Call call = begin_call(static_cast<CallKind>(op));
  // A dispatch with dropping has two plan exchanges; peers wait for both (dispatch()).
  const int phases = op == Op::dispatch && config().capacity_factor > 0.0 ? 2 : 1;
  if (op == Op::dispatch && broadcast_) kernels::release_broadcast(ctx());  // as dispatch() does
  reject(call, phases, reason, 0, signature_of({-1}));
}

void CudaBackend::exchange_plan(const Call& call, int phase, int64_t tokens, int64_t signature, const int64_t* counts,
                                int64_t count_len, int64_t* expert_prefix, int64_t* drop_capacity,
                                const kernels::LayoutJob* layout) {
  const PlanHeader h = plan_header(call, "", tokens, signature);
  const kernels::Ctx c = ctx();
  kernels::exchange_plan(c, h, counts, count_len, phase, expert_prefix != nullptr,
                         expert_prefix ? config().capacity_factor : 0.0, expert_prefix,
                         drop_capacity ? drop_capacity : scratch_, layout);
}

void CudaBackend::wait(int kind) {
  const kernels::Ctx c = ctx();
  kernels::wait_signals(c, kind, static_cast<uint64_t>(c.blocks));
}

std::function<void(void*)> CudaBackend::stream_deleter() const {
  cudaStream_t s = stream_;
  std::shared_ptr<CUstream_st> keep = s == owned_stream_.get() ? owned_stream_ : nullptr;
  std::shared_ptr<CUmemPoolHandle_st> pool = pool_;
  return [s, keep, pool](void* p) { cudaFreeAsync(p, s); };
}

void* CudaBackend::allocate(size_t bytes, cudaStream_t stream, bool capturing) {
  void* p = nullptr;
  // Captured into a CUDA graph, an allocation becomes a graph memory node: the plain stream-ordered
  // form is the one graphs document; outside a capture, the buffer's pool.
  if (capturing) EPX_CUDA(cudaMallocAsync(&p, bytes, stream));
  else EPX_CUDA(cudaMallocFromPoolAsync(&p, bytes, pool_.get(), stream));
  return p;
}

bool CudaBackend::capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EPX_CUDA(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

Tensor CudaBackend::device_tensor(DType dtype, std::initializer_list<int64_t> shape, cudaStream_t stream) {
  TensorView v = TensorView::of(nullptr, dtype, shape, DeviceKind::cuda, device_);
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, v.numel() * dtype_size(dtype)));
  if (!stream) stream = stream_;
  void* p = allocate(bytes, stream, capturing(stream));
  if (poison_outputs_) EPX_CUDA(cudaMemsetAsync(p, 0xa5, bytes, stream));  // tests: unwritten bytes show
  v.data = p;
  return Tensor(std::shared_ptr<void>(p, stream_deleter()), v);
}

Tensor CudaBackend::output_block(int64_t bytes, cudaStream_t stream) {
  constexpr size_t kMaxCached = 8;  // a dispatch's outputs and its handle, for a few dispatches in flight
  const size_t need = static_cast<size_t>(bytes);
  // In a CUDA graph capture the allocation and its release must be graph nodes: no cache.
  const bool cacheable = !capturing(stream);
  void* p = nullptr;
  size_t have = 0;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(block_cache_->mutex);
    auto& blocks = block_cache_->blocks;
    for (auto it = blocks.begin(); it != blocks.end(); ++it)
      if (it->second >= need && it->second <= need + need / 4) {  // fits, wasting at most a quarter
        p = it->first;
        have = it->second;
        blocks.erase(it);
        break;
      }
  }
  // A cached block was released after its last use on the call stream, which this call's
  // stream waits for (fork_), so reusing it on either stream is ordered after that use.
  const bool cached = p != nullptr;
  if (!p) {
    p = allocate(need, stream, !cacheable);
    have = need;
  }
  // EPX_PROFILE=host tells the two apart (a pool allocation costs the host tens of us).
  host_steps_.mark(cached ? "block from the cache" : "block from the pool");
  if (poison_outputs_) EPX_CUDA(cudaMemsetAsync(p, 0xa5, have, stream));
  std::weak_ptr<BlockCache> cache = block_cache_;
  auto free_block = stream_deleter();
  std::shared_ptr<void> storage(p, [cache, free_block, have, cacheable](void* q) {
    if (auto c = cacheable ? cache.lock() : nullptr) {
      std::lock_guard<std::mutex> lock(c->mutex);
      if (c->blocks.size() < kMaxCached) {
        c->blocks.emplace_back(q, have);
        return;
      }
    }
    free_block(q);
  });
  return Tensor(std::move(storage), TensorView::of(p, DType::boolean, {bytes}, DeviceKind::cuda, device_));
}

CudaBackend::OutputBlock::OutputBlock(CudaBackend& backend, cudaStream_t stream) : backend_(backend), stream_(stream) {}

void CudaBackend::OutputBlock::add(Tensor* target, DType dtype, std::initializer_list<int64_t> shape) {
  parts_.push_back({target, TensorView::of(nullptr, dtype, shape, DeviceKind::cuda, backend_.device_), bytes_});
  bytes_ += (std::max<int64_t>(1, parts_.back().view.numel() * dtype_size(dtype)) + 255) / 256 * 256;
}

void CudaBackend::OutputBlock::allocate() {
  const Tensor block = backend_.output_block(bytes_, stream_);
  for (Part& part : parts_) {
    part.view.data = block.data<char>() + part.offset;
    *part.target = Tensor(block.storage(), part.view);
  }
}

void CudaBackend::check_device_tensor(const TensorView& t, std::string_view what) const {
  if (t.defined())
    require(t.device_index == device_, what, ": tensor is on cuda:", t.device_index, " but this rank drives cuda:", device_);
}

const HandleState& CudaBackend::state_of(const Handle& h, const Call& call) const {
  require(h.valid(), call.name, ": the handle is empty; pass the handle returned by dispatch");
  require(h.state().owner == this, call.name,
          ": the handle belongs to another buffer or rank; pass the handle this buffer's dispatch returned");
  return h.state();
}

DispatchResult CudaBackend::dispatch(const DispatchInput& in, const DispatchOptions& opt) {
  const auto host_call = std::chrono::steady_clock::now();
  const Call call = begin_call(kDispatch);
  const BufferConfig& c = config();
  std::string error;
  int64_t tokens = 0;
  kernels::RoutingInput routing;
  kernels::SendRows rows;
  kernels::FiniteCheck finite;  // check_finite: scanned beside the routing check
  bool has_weights = false;
  try {
    validate_dispatch_options(opt);
    validate_dispatch_x(in, c, DeviceKind::cuda);
    check_device_tensor(in.x, "dispatch: x");
    tokens = in.x.shape[0];
    validate_routing_tensors(in, c, tokens, DeviceKind::cuda);
    routing = routing_input(in);
    has_weights = in.topk_idx.defined() ? in.topk_weights.defined() : in.probs.defined();
    rows = send_rows(in, c.wire, opt.nvfp4_global_scale);
    if (c.check_finite) finite = finite_check(in, c.hidden);
  } catch (const Error& e) {
    error = e.what();
  }
  host_steps_.mark("validated");
  const int64_t signature = signature_of({static_cast<int64_t>(opt.layout), broadcast_ ? 1 : 0});
  if (!error.empty()) {
    if (broadcast_) kernels::release_broadcast(ctx());  // peers' next broadcasts wait for this rank's receiver
    reject(call, c.capacity_factor > 0.0 ? 2 : 1, error, tokens, signature);
  }
  const bool lean = lean_dispatch();
  // Where the copy engines may place rows: a lean, blocking, rank-major bf16 dispatch.
  const bool copies_may_place = lean && c.mode != CapacityMode::capacity && opt.layout == Layout::rank_major &&
                                wire_.format == WireFormat::bf16;
  // EPX_OWN_ROWS=copies: own rows by the copy engines (place_own_rows), from row own_anchor of the
  // outputs on; the receiver places the other ranks' rows.
  const bool own_by_copies = own_copies_ && copies_may_place;
  // EPX_PEER_ROWS=copies: the other ranks' rows too (place_peer_rows), once the plan and their
  // placing data are here; the receiver then writes only the rows' data.
  const bool peer_by_copies = peer_copies_ && ranks_ > 1 && copies_may_place;
  const int64_t own_anchor = rank_ * c.max_tokens_per_rank;
  const char* bcast_from = rows.x;  // bf16: x itself
  int64_t bcast_stride = rows.x_stride_bytes, bcast_row_bytes = wire_.bytes();
  // The rows' pieces sent as they are encoded (EPX_ENCODE=pieces; not through the broadcast's
  // graph, which sends every piece at once).
  const bool encode_by_piece = piece_encode_ && !broadcast_graphs_.of_kind[0];
  // Pieces [first, end) of the broadcast by copy calls on the copy stream (the broadcast's graph
  // is the other way), each behind a wait for its rows when they are encoded by piece; after the
  // last, copies_done_.
  auto enqueue_pieces = [&](int64_t first, int64_t end) {
    for (int64_t q = first; q < end; q = encode_by_piece ? q + 1 : end) {
      const int64_t q_end = encode_by_piece ? q + 1 : end;
      if (encode_by_piece && q * map_.piece_tokens < tokens)  // this rank's own flag of piece q
        kernels::wait_peer_flags(ctx(copy_stream_), map_.bcast_flag + q * sizeof(uint32_t), kMaxPieces, 1u << rank_);
      kernels::copy_pieces(
          kernels::broadcast_pieces(ctx(), bcast_from, bcast_stride, bcast_row_bytes, tokens, q, q_end), copy_stream_);
    }
    if (end < kMaxPieces) return;
    timer_.mark(7, copy_stream_);
    EPX_CUDA(cudaEventRecord(copies_done_, copy_stream_));
  };
  bool broadcast_graphed = false;
  if (broadcast_) {  // the copy engines start on the rows now; they need no plan
    rows.broadcast = true;
    EPX_CUDA(cudaEventRecord(fork_, stream_));
    EPX_CUDA(cudaStreamWaitEvent(copy_stream_, fork_, 0));
    timer_.mark(6, copy_stream_);
    kernels::begin_broadcast(ctx(), copy_stream_);
    if (c.wire != WireFormat::bf16) {  // quantized (or given fp8) rows wait in this rank's window
      if (!encode_by_piece) {
        kernels::encode_rows(ctx(copy_stream_), rows, tokens, false);
        timer_.mark(11, copy_stream_);
      }
      bcast_from = window_->local() + map_.bcast_rows + rank_ * c.max_tokens_per_rank * map_.bcast_stride;
      bcast_stride = bcast_row_bytes = map_.bcast_stride;
    }
    // The placing data and the receivers wait for this: the peers read this rank's previous
    // broadcast, and its own encoded rows are in place (encoded by piece: on the side stream, which
    // places and receives after them).
    EPX_CUDA(cudaEventRecord(broadcast_begun_, copy_stream_));
    if (encode_by_piece) {
      EPX_CUDA(cudaStreamWaitEvent(side_stream_, broadcast_begun_, 0));
      kernels::encode_rows(ctx(side_stream_), rows, tokens, true);
      timer_.mark(11, side_stream_);
    }
    // Lean: two pieces keep the copy engines busy (~100 us at V3, more than the host takes to
    // launch the routing, which the receiver waits for); the other pieces follow the routing.
    // With EPX_PIECE_COPIES=graph all pieces go at once, in one launch.
    broadcast_graphed = broadcast_graphs_.of_kind[0] &&
                        by_graph(broadcast_graphs_,
                                 kernels::broadcast_pieces(ctx(), bcast_from, bcast_stride, bcast_row_bytes, tokens, 0,
                                                           kMaxPieces),
                                 copy_stream_);
    if (broadcast_graphed) {
      timer_.mark(7, copy_stream_);
      EPX_CUDA(cudaEventRecord(copies_done_, copy_stream_));
    } else {
      enqueue_pieces(0, lean ? 2 : kMaxPieces);
    }
    host_steps_.mark(broadcast_graphed ? "broadcast graph launched" : "broadcast enqueued");
  }

  // The handle's arrays, sized for this call, zeroed (the chunk counts are sums).
  auto dh = std::make_shared<DeviceHandle>();
  Carver measure(nullptr);
  carve_handle(*dh, measure, tokens, c, ranks_, map_.max_chunks);
  const Tensor block = output_block(measure.used(), stream_);  // cached like the outputs
  EPX_CUDA(cudaMemsetAsync(block.data<void>(), 0, static_cast<size_t>(measure.used()), stream_));
  dh->memory = block.storage();
  Carver carve(block.data<char>());
  carve_handle(*dh, carve, tokens, c, ranks_, map_.max_chunks);
  host_steps_.mark("handle allocated");

  // Sender's half of the layout; with dropping, a first plan exchange fixes what is kept.
  timer_.mark(0, stream_);
  const kernels::Ctx x = ctx();
  const int64_t width = c.num_experts + ranks_;
  kernels::canonicalize_routing(x, routing, tokens, dh->slot_expert, dh->slot_weight,
                                c.capacity_factor > 0.0 ? dh->counts : nullptr, finite);
  int phase = 0;
  if (c.capacity_factor > 0.0) {
    exchange_plan(call, phase++, tokens, signature, dh->counts, c.num_experts, dh->expert_prefix, dh->drop_capacity);
    kernels::drop_slots(x, tokens, dh->slot_expert, dh->slot_weight, dh->expert_prefix, dh->drop_capacity, dh->dropped);
  }
  host_steps_.mark("routing launched");
  timer_.mark(8, stream_);
  kernels::chunk_positions(x, tokens, dh->slot_expert, dh->pos);
  if (broadcast_) kernels::finalize_positions(x, tokens, dh->slot_expert, dh->pos);
  if (own_by_copies) EPX_CUDA(cudaEventRecord(positions_ready_, stream_));
  timer_.mark(9, stream_);
  host_steps_.mark("positions launched");
  if (broadcast_ && lean && !broadcast_graphed) {
    enqueue_pieces(2, kMaxPieces);
    host_steps_.mark("broadcast's other pieces enqueued");
  }
  const kernels::Placing mine{dh->slot_expert, dh->slot_weight, dh->pos.send_pos, dh->pos.slot_pos};
  if (broadcast_) {  // the placing data goes out on the side stream while the plans are exchanged
    EPX_CUDA(cudaEventRecord(fork_, stream_));
    EPX_CUDA(cudaStreamWaitEvent(side_stream_, fork_, 0));
    EPX_CUDA(cudaStreamWaitEvent(side_stream_, broadcast_begun_, 0));
    kernels::broadcast_placing(ctx(side_stream_), mine, tokens);
    host_steps_.mark("placing launched");
  }
  const bool capacity_mode = c.mode == CapacityMode::capacity;
  const kernels::LayoutJob layout{dh->recv, opt.layout, c.expert_alignment, capacity_mode ? c.capacity_rows : 0};
  auto h = std::make_shared<HandleState>();
  h->owner = this;
  h->dispatch_call = call.index;
  h->layout = opt.layout;
  h->rank = rank_;
  h->ranks = ranks_;
  h->tokens = tokens;
  h->topk = c.topk;
  h->hidden = c.hidden;
  h->has_weights = has_weights;
  h->recv.layout = opt.layout;
  DispatchResult out;
  // Output rows. Capacity mode: capacity_rows. Blocking, rank-major: at most every source's
  // max_tokens, no larger than the window's staging, so the outputs are allocated at that bound
  // and cut to num_rows after the call's one sync. Blocking, expert-major: the bound would be
  // min(K, L) times larger, so the sizes are read first (one host read while the senders run).
  const bool sizes_first = !capacity_mode && opt.layout == Layout::expert_major;
  int64_t capacity = capacity_mode ? c.capacity_rows : ranks_ * c.max_tokens_per_rank;
  const int senders = broadcast_ ? 0 : send_blocks(true, opt.layout);  // a broadcast needs no sender
  const kernels::Ctx side = ctx(side_stream_);
  // The outputs (one allocation, on the side stream; the receiver writes every row, padding and
  // empty rows too) and the receiver, which waits on the device for the layout when it goes first.
  auto launch_receiver = [&](bool wait_layout) {
    OutputBlock outputs(*this, side_stream_);
    if (wire_.format == WireFormat::bf16) outputs.add(&out.recv_x, DType::bf16, {capacity, c.hidden});
    else if (wire_.format == WireFormat::nvfp4) outputs.add(&out.recv_x, DType::e2m1x2, {capacity, c.hidden / 2});
    else outputs.add(&out.recv_x, DType::fp8_e4m3, {capacity, c.hidden});
    if (wire_.format == WireFormat::nvfp4) outputs.add(&out.recv_scales, DType::fp8_e4m3, {capacity, c.hidden / kNvfp4Block});
    else if (wire_.scale_bytes) outputs.add(&out.recv_scales, DType::f32, {capacity, c.hidden / kFp8Block});
    if (wire_.global_bytes) outputs.add(&out.recv_global_scale, DType::f32, {capacity});
    outputs.add(&out.recv_src, DType::i32, {capacity, 2});
    if (opt.layout == Layout::expert_major) {
      outputs.add(&out.recv_weights, DType::f32, {capacity});
    } else {
      outputs.add(&out.recv_topk_idx, DType::i32, {capacity, c.topk});
      outputs.add(&out.recv_topk_weights, DType::f32, {capacity, c.topk});
    }
    outputs.allocate();
    host_steps_.mark("outputs allocated");
    if (own_by_copies || peer_by_copies) EPX_CUDA(cudaEventRecord(outputs_ready_, side_stream_));
    auto ptr = [](const Tensor& t) { return t.defined() ? t.data<char>() : nullptr; };
    kernels::RecvOutputs ro{ptr(out.recv_x), ptr(out.recv_scales), ptr(out.recv_global_scale), wire_.x_bytes,
                            wire_.scale_bytes, wire_.global_bytes, out.recv_src.data<int32_t>(),
                            reinterpret_cast<float*>(ptr(out.recv_weights)),
                            reinterpret_cast<int32_t*>(ptr(out.recv_topk_idx)),
                            reinterpret_cast<float*>(ptr(out.recv_topk_weights))};
    ro.own_placed = own_by_copies;
    if (own_by_copies) ro.own_anchor = own_anchor;
    ro.peer_placed = peer_by_copies;
    timer_.mark(4, side_stream_);
    kernels::dispatch_receive(side, blocks_ - senders, dh->recv, ro, opt.layout, rows, mine, phase, wait_layout);
    host_steps_.mark("receiver launched");
    timer_.mark(5, side_stream_);
  };
  // Early receiver: launched behind the placing data, before the plan, so the host's launches
  // after it (the plan) no longer hold back its start; it waits on the device for the layout.
  // Not on the shared-GPU transport (a waiting kernel there can hold back another rank's, the
  // hazard of docs/cuda.md) nor where the output sizes come from the plan.
  const bool early_receiver = broadcast_ && lean && !sizes_first && early_receiver_;
  if (early_receiver) launch_receiver(true);
  exchange_plan(call, phase, tokens, signature, dh->pos.totals, width, nullptr, nullptr, lean ? &layout : nullptr);
  if (peer_by_copies) EPX_CUDA(cudaEventRecord(layout_ready_, stream_));  // lean: the plan kernel writes it
  host_steps_.mark("plan posted");

  // Senders start now on the call's stream; the receiver's layout, the output allocation (after
  // one host read of the sizes in blocking mode) and the receiver follow on the side stream.
  timer_.mark(1, stream_);
  if (!early_receiver) {
    EPX_CUDA(cudaEventRecord(fork_, stream_));
    EPX_CUDA(cudaStreamWaitEvent(side_stream_, fork_, 0));
  }
  if (senders > 0)
    kernels::dispatch_send(x, senders, rows, tokens, kernels::SendPlan{dh->slot_expert, dh->slot_weight, dh->pos});
  host_steps_.mark("senders launched");
  timer_.mark(2, stream_);
  if (!lean) {
    kernels::receive_layout(side, phase, layout);
    host_steps_.mark("layout launched");
  }
  timer_.mark(3, side_stream_);
  if (sizes_first) {
    EPX_CUDA(cudaMemcpyAsync(host_info_, dh->recv.info, 4 * sizeof(int64_t), cudaMemcpyDeviceToHost, side_stream_));
    EPX_CUDA(cudaStreamSynchronize(side_stream_));
    capacity = host_info_[2];
    host_steps_.mark("sizes read");
  }
  if (!early_receiver) launch_receiver(false);
  // After the receiver's launch, so that the host's read of the positions does not delay it.
  if (own_by_copies)
    place_own_rows(dh->pos.send_pos, tokens, own_anchor, capacity, rows, out.recv_x.data<char>(), 2 * c.hidden);
  if (peer_by_copies)  // after the own rows' copies, which need no other rank
    place_peer_rows(dh->recv, own_by_copies ? own_anchor : -1, capacity, out.recv_x.data<char>(), 2 * c.hidden);
  EPX_CUDA(cudaEventRecord(join_, side_stream_));
  EPX_CUDA(cudaStreamWaitEvent(stream_, join_, 0));
  if (broadcast_) EPX_CUDA(cudaStreamWaitEvent(stream_, copies_done_, 0));  // x is read until then

  // Small outputs: views into the handle's arrays (they live as long as the handle's memory).
  auto view = [&](int64_t* p, int64_t n) {
    return Tensor(dh->memory, TensorView::of(p, DType::i64, {n}, DeviceKind::cuda, device_));
  };
  if (opt.layout == Layout::expert_major) out.expert_offsets = view(dh->recv.expert_offsets, local_experts_ + 1);
  out.tokens_per_expert = view(dh->recv.tokens_per_expert, local_experts_);
  out.rank_offsets = view(dh->recv.rank_offsets, ranks_ + 1);
  out.recv_info = view(dh->recv.info, 4);
  h->device = dh;
  if (capacity_mode) {
    out.num_rows = -1;
    h->recv.num_rows = -1;
    h->recv.capacity = capacity;
    out.handle = Handle(std::move(h));
    kernels::publish_status(x, host_status_);
    return out;
  }
  // Blocking: the call's sync, then the sizes.
  EPX_CUDA(cudaMemcpyAsync(host_info_, dh->recv.info, 4 * sizeof(int64_t), cudaMemcpyDeviceToHost, stream_));
  EPX_CUDA(cudaMemcpyAsync(host_info_ + 4, dh->dropped, sizeof(int64_t), cudaMemcpyDeviceToHost, stream_));
  const bool offsets_to_host = copy_combine_ || own_by_copies;  // combine copies by source; recv_x's first row
  if (offsets_to_host)
    EPX_CUDA(cudaMemcpyAsync(host_info_ + 8, dh->recv.rank_offsets, (ranks_ + 1) * sizeof(int64_t),
                             cudaMemcpyDeviceToHost, stream_));
  sync_and_check(call);
  host_steps_.mark("synced");
  out.num_rows = host_info_[1];
  out.overflow = host_info_[3] != 0;
  out.dropped_slots = host_info_[4];
  h->recv.tokens = host_info_[0];
  h->recv.num_rows = host_info_[1];
  h->recv.capacity = host_info_[2];
  if (offsets_to_host) h->recv.rank_offsets.assign(host_info_ + 8, host_info_ + 8 + ranks_ + 1);
  const int64_t x_first = own_by_copies ? own_anchor - host_info_[8 + rank_] : 0;  // recv_x's first row
  for (Tensor* t : {&out.recv_x, &out.recv_scales, &out.recv_global_scale, &out.recv_src, &out.recv_weights,
                    &out.recv_topk_idx, &out.recv_topk_weights})
    if (t->defined()) *t = row_range(*t, t == &out.recv_x ? x_first : 0, h->recv.capacity);
  out.handle = Handle(std::move(h));
  if (timer_.on()) report_dispatch_profile(c.wire != WireFormat::bf16, host_call);
  return out;
}

// EPX_PROFILE: the call's device steps (its events' marks) and host steps, added to the means
// printed when the buffer goes.
void CudaBackend::report_dispatch_profile(bool quantized, std::chrono::steady_clock::time_point host_call) {
  timer_.add("dispatch: routing+plan", 0, 1);
  timer_.add("dispatch: routing", 0, 8);
  timer_.add("dispatch: positions", 8, 9);
  timer_.add("dispatch: plan exchange", 9, 1);
  timer_.add("dispatch: send kernel", 1, 2);
  timer_.add("dispatch: layout", 1, 3);
  timer_.add("dispatch: sizes read+alloc", 3, 4);
  timer_.add("dispatch: receive kernel", 4, 5);
  timer_.add("dispatch: plan to received", 1, 5);
  timer_.add("dispatch: all", 0, 5);
  if (broadcast_) {
    timer_.add("dispatch: broadcast copies", 6, 7);
    if (quantized) timer_.add("dispatch: broadcast's encode", 6, 11);
    timer_.add("dispatch: broadcast to received", 6, 5);
  }
  host_steps_.mark("returned");
  // Each host step's time since the one before: where the host's part of a call goes.
  int step_number = 0;
  host_steps_.for_each([&](const char* step, double us) {
    ++step_number;
    timer_.add_host_us(cat("dispatch host ", step_number < 10 ? "0" : "", step_number, ": ", step), us);
  });
  timer_.add_host("dispatch host: call", host_call, std::chrono::steady_clock::now());
}

const HandleState& CudaBackend::start_handle_call(const Call& call, const Handle& handle, int64_t options,
                                                  const std::function<void(const HandleState&)>& validate) {
  std::string error;
  const HandleState* h = nullptr;
  try {
    h = &state_of(handle, call);
    validate(*h);
  } catch (const Error& e) {
    error = e.what();
  }
  // The handle's dispatch is part of what must agree (handle.hpp: dispatch_call).
  const int64_t signature =
      signature_of({options, h ? static_cast<int64_t>(h->layout) : -1, h ? h->dispatch_call : -1});
  if (!error.empty()) reject(call, 1, error, h ? h->tokens : 0, signature);
  exchange_plan(call, 0, h->tokens, signature, nullptr, 0);
  host_steps_.mark("plan posted");
  return *h;
}

CombineResult CudaBackend::combine(const CombineInput& in, const Handle& handle, const CombineOptions& opt) {
  const Call call = begin_call(kCombine);
  const BufferConfig& c = config();
  timer_.mark(0, stream_);
  // The engine is part of the signature: ranks with different EPX_COMBINE_ENGINE would wait for
  // each other's rows on different flags, so the plan check stops them first.
  const int64_t options = (opt.weighted ? 1 : 0) + (copy_combine_ ? 2 : 0);
  CombineResult out;
  std::vector<Tensor> staging;
  const HandleState* h = &start_handle_call(call, handle, options, [&](const HandleState& state) {
    validate_combine(in, state, c, opt, DeviceKind::cuda);
    check_device_tensor(in.y, "combine: y");
  });
  timer_.mark(1, stream_);
  const DeviceHandle& dh = device_of(*h);
  // The output, the reducers' arguments and the copy-engine return.
  out.out = device_tensor(DType::bf16, {h->tokens, c.hidden});
  kernels::CombineArgs a{in.y.ptr<const uint16_t>(), in.y.strides[0], opt.weighted, nullptr, 0,
                         in.shared_out.defined() ? in.shared_out.ptr<const uint16_t>() : nullptr,
                         in.shared_out.defined() ? in.shared_out.strides[0] : 0, out.out.data<uint16_t>(), nullptr};
  const bool by_copy = start_copy_return(*h, in.y, TensorView{}, a, staging);
  timer_.mark(2, stream_);
  kernels::combine(ctx(), by_copy ? 0 : send_blocks(false, h->layout), dh.recv, h->layout, h->tokens, dh.pos.send_pos,
                   dh.slot_expert, a);
  timer_.mark(3, stream_);
  if (by_copy) {
    EPX_CUDA(cudaStreamWaitEvent(stream_, copies_done_, 0));  // y is read until then
    timer_.add("combine: copies", 4, 5);
  }
  out.overflow = h->recv.num_rows > h->recv.capacity;
  if (by_copy && h->layout == Layout::expert_major) {
    timer_.add("combine: partials, other ranks'", 8, 9);
    timer_.add("combine: partials, own", 9, 10);
  }
  timer_.add("combine: plan", 0, 1);
  timer_.add("combine: kernel", 2, 3);
  timer_.add("combine: all", 0, 3);
  if (c.mode == CapacityMode::blocking) sync_and_check(call);
  else kernels::publish_status(ctx(), host_status_);
  return out;
}

// Copy-engine return (blocking calls, where the host knows where each source's rows start): the
// copies of every other rank's rows (and slot values) go on the copy stream once the plans are
// exchanged (every rank is in this call, so its previous reader of rev_rows is done), and `a`
// turns to reducing only. Rank-major returns y's rows as they are. Expert-major first sums each
// received token's rows into a partial in rank-major order (`staging`, freed stream-ordered with
// the caller's tensors): the other ranks' partials, then their copies, then this rank's own while
// the copies run. False: this call returns its rows with SM stores.
bool CudaBackend::start_copy_return(const HandleState& h, const TensorView& rows, const TensorView& slot_values,
                                    kernels::CombineArgs& a, std::vector<Tensor>& staging) {
  if (!copy_combine_ || h.recv.rank_offsets.empty()) return false;
  const int64_t own = h.recv.rank_offsets[rank_], own_rows = h.recv.rank_offsets[rank_ + 1] - own;
  TensorView from = rows, from_slots = slot_values;
  kernels::PartialRows partials{};
  if (h.layout == Layout::expert_major) {
    const int64_t received = h.recv.rank_offsets[ranks_];
    const int64_t topk = config().topk, hidden = config().hidden;
    staging.push_back(device_tensor(DType::bf16, {received, hidden}));
    from = staging.back().view();
    if (slot_values.defined()) {
      staging.push_back(device_tensor(DType::f32, {received, topk}));
      from_slots = staging.back().view();
    }
    partials = {from.ptr<uint16_t>(), from_slots.defined() ? from_slots.ptr<float>() : nullptr, 0,
                received - own_rows, own, own_rows};
    timer_.mark(8, stream_);
    kernels::reduce_partials(ctx(), device_of(h).recv, a, partials);  // the other ranks' rows
    timer_.mark(9, stream_);
  }
  a.by_copy = true;
  a.own_rows = from.ptr<const uint16_t>() + own * from.strides[0];
  if (from_slots.defined()) a.own_slot_values = from_slots.ptr<const float>() + own * from_slots.strides[0];
  EPX_CUDA(cudaEventRecord(fork_, stream_));
  EPX_CUDA(cudaStreamWaitEvent(copy_stream_, fork_, 0));
  timer_.mark(4, copy_stream_);
  const kernels::ReturnRows r{static_cast<const char*>(from.data), from.strides[0] * 2,
                              from_slots.defined() ? static_cast<const char*>(from_slots.data) : nullptr,
                              from_slots.defined() ? from_slots.strides[0] * 4 : 0};
  const auto pieces = kernels::return_pieces(ctx(), r, h.recv.rank_offsets,
                                             reinterpret_cast<const char*>(call_state_) + offsetof(CallState, call));
  if (!by_graph(return_graphs_, pieces, copy_stream_)) kernels::copy_pieces(pieces, copy_stream_);
  timer_.mark(5, copy_stream_);
  EPX_CUDA(cudaEventRecord(copies_done_, copy_stream_));
  if (h.layout == Layout::expert_major) {  // this rank's own partials, while the copies run
    kernels::reduce_partials(ctx(), device_of(h).recv, a, {partials.rows, partials.slots, own, own_rows, own_rows, 0});
    timer_.mark(10, stream_);
    a.y = from.ptr<const uint16_t>();  // the reducers read own rows (own_rows + pos * y_stride) from the partials
    a.y_stride = from.strides[0];
    a.slot_values_stride = from_slots.defined() ? from_slots.strides[0] : 0;
  }
  return true;
}

DispatchBackwardResult CudaBackend::dispatch_backward(const DispatchBackwardInput& in, const Handle& handle) {
  const Call call = begin_call(kDispatchBackward);
  const BufferConfig& c = config();
  const bool with_weights = in.grad_recv_weights.defined();
  const int64_t options = (with_weights ? 1 : 0) + (copy_combine_ ? 2 : 0);  // the engine: see combine
  DispatchBackwardResult out;
  std::vector<Tensor> staging;
  const TensorView& gw = in.grad_recv_weights;
  const HandleState* h = &start_handle_call(call, handle, options, [&](const HandleState& state) {
    validate_dispatch_backward(in, state, c, DeviceKind::cuda);
  });
  const DeviceHandle& dh = device_of(*h);
  out.grad_x = device_tensor(DType::bf16, {h->tokens, c.hidden});  // as in combine
  if (with_weights) out.grad_topk_weights = device_tensor(DType::f32, {h->tokens, c.topk});
  kernels::CombineArgs a{in.grad_recv_x.ptr<const uint16_t>(), in.grad_recv_x.strides[0], false,
                         with_weights ? gw.ptr<const float>() : nullptr, with_weights ? gw.strides[0] : 0,
                         nullptr, 0, out.grad_x.data<uint16_t>(),
                         with_weights ? out.grad_topk_weights.data<float>() : nullptr};
  const bool by_copy = start_copy_return(*h, in.grad_recv_x, gw, a, staging);
  kernels::combine(ctx(), by_copy ? 0 : send_blocks(false, h->layout), dh.recv, h->layout, h->tokens, dh.pos.send_pos,
                   dh.slot_expert, a);
  if (by_copy) EPX_CUDA(cudaStreamWaitEvent(stream_, copies_done_, 0));  // the inputs are read until then
  if (c.mode == CapacityMode::blocking) sync_and_check(call);
  else kernels::publish_status(ctx(), host_status_);
  return out;
}

CombineBackwardResult CudaBackend::combine_backward(const CombineBackwardInput& in, const Handle& handle,
                                                    const CombineOptions& opt) {
  const Call call = begin_call(kCombineBackward);
  const BufferConfig& c = config();
  const HandleState* h = &start_handle_call(call, handle, opt.weighted, [&](const HandleState& state) {
    validate_combine_backward(in, state, c, opt, DeviceKind::cuda);
  });
  const kernels::Ctx x = ctx();
  const DeviceHandle& dh = device_of(*h);
  kernels::SendRows rows;
  rows.x = static_cast<const char*>(in.grad_out.data);
  rows.x_stride_bytes = in.grad_out.strides[0] * 2;
  kernels::send_tokens(x, rows, h->tokens, dh.pos.send_pos);
  wait(kSignalForward);
  CombineBackwardResult out;
  out.grad_y = device_tensor(DType::bf16, {h->recv.capacity, c.hidden});
  kernels::expand_grad(x, dh.recv, h->layout, opt.weighted, opt.weighted ? in.y.ptr<const uint16_t>() : nullptr,
                       opt.weighted ? in.y.strides[0] : 0, out.grad_y.data<uint16_t>());
  wait(kSignalReverse);
  if (opt.weighted) {
    out.grad_topk_weights = device_tensor(DType::f32, {h->tokens, c.topk});
    kernels::gather_slot_values(x, h->tokens, dh.pos.send_pos, dh.slot_expert, out.grad_topk_weights.data<float>());
  }
  if (c.mode == CapacityMode::blocking) sync_and_check(call);
  else kernels::publish_status(x, host_status_);
  return out;
}

}  // namespace epx::detail
