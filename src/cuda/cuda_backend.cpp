// Host side of the CUDA backend: checks, the kernel sequence of each call, outputs, errors.
#include "cuda/cuda_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <functional>
#include <iterator>

#include "core/creation.hpp"
#include "core/env.hpp"
#include "core/replicas.hpp"
#include "core/routing.hpp"
#include "core/timeout.hpp"
#include "core/validate.hpp"
#include "core/validate_ops.hpp"
#include "cuda/copy_cuts.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_handle.hpp"
#include "cuda/dispatch_input.hpp"
#include "cuda/replica_errors.hpp"
#include "cuda/stream_switch.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

namespace {

constexpr int kDefaultBlocks = 24;
// Pieces per broadcast. Each piece costs the host two copy calls before anything else of the call
// is enqueued (docs/lab/2026-12-01-performance-diary.md).
constexpr int64_t kBroadcastPieces = 4;

// Copy-engine dispatch (kernels/broadcast.cu). EPX_DISPATCH_ENGINE=copy or sm forces an engine;
// unset (auto), quantized wires at one rank and bf16 and fp8 wires at two ranks use the copy
// engines; everything else the SM engine. At two ranks nearly every token goes to the other rank
// and the copy engines were measured faster (docs/lab/2026-12-01-performance-diary.md); nvfp4 by
// copy engine was not measured against the SM engine there. At one rank a bf16 wire has nothing
// to send and every SM block receives, faster than the copy-engine path; a quantized wire's
// encode takes the SM engine's senders ~3x as long as the copy-engine path's encode and placing
// (docs/lab/2026-12-02-one-transfer-kernel.md).
bool use_broadcast(const BufferConfig& c, int ranks) {
  const Engine engine = env_dispatch_engine();
  return engine == Engine::copy ||
         (engine == Engine::automatic && ((ranks == 1 && c.wire != WireFormat::bf16) ||
                                          (ranks == 2 && c.wire != WireFormat::nvfp4)));
}

// Copy-engine combine and dispatch_backward (blocking calls): EPX_COMBINE_ENGINE=copy or sm forces
// an engine; unset (auto), one and two ranks return their rows by copy engine (measured as above).
bool use_copy_combine(int ranks) {
  const Engine engine = env_combine_engine();
  return engine == Engine::copy || (engine == Engine::automatic && ranks <= 2);
}

WindowMap make_window_map(const BufferConfig& c, int64_t experts, int ranks, const WireRow& wire, bool broadcast) {
  WindowMap m{};
  const int64_t rows = ranks * c.max_tokens_per_rank;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += round16(bytes);
    return here;
  };
  m.signals = take(8 * kSignalKinds * ranks);
  m.plan_stride = round16(static_cast<int64_t>(sizeof(PlanHeader)) + 8 * (experts + ranks));
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
  const int64_t piece = (c.max_tokens_per_rank + kBroadcastPieces - 1) / kBroadcastPieces;
  m.piece_tokens = std::max<int64_t>(1, (piece + kChunkTokens - 1) / kChunkTokens * kChunkTokens);
  return_piece_starts(c.max_tokens_per_rank, m.piece_tokens, m.return_start);  // the copy-engine return's: the same
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

// `experts`: the physical ones (P with EPLB), whose counts the plan keeps.
void carve_handle(DeviceHandle& h, Carver& c, int64_t tokens, const BufferConfig& cfg, int64_t experts, int ranks,
                  int64_t max_chunks, const kernels::PlanSplit& split) {
  const int64_t k = cfg.topk, rows = ranks * cfg.max_tokens_per_rank, l_count = experts / ranks;
  const int64_t chunks = (tokens + kChunkTokens - 1) / kChunkTokens, width = experts + ranks;
  h.slot_expert = c.take<int32_t>(tokens * k);
  h.slot_weight = c.take<float>(tokens * k);
  h.pos.chunk_count = c.take<int32_t>(chunks * width);
  h.pos.chunk_base = c.take<int32_t>(chunks * width);
  h.pos.block_base = c.take<int32_t>(split.grid * width);
  h.pos.chunks_per_block = split.chunks_per_block;
  h.pos.totals = c.take<int64_t>(width);
  h.pos.send_pos = c.take<int32_t>(tokens * ranks);
  h.pos.slot_pos = c.take<int32_t>(tokens * k);
  h.counts = c.take<int64_t>(experts);
  h.expert_prefix = c.take<int64_t>(experts);
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

// The int64 words from the handle's recv.info to the end of its expert_offsets: the layout arrays
// a dispatch returns (carve_handle puts them one after the other).
int64_t layout_words(const DeviceHandle& h, int64_t local_experts) {
  return h.recv.expert_offsets + local_experts + 1 - h.recv.info;
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
  const ReplicaShape shape{cfg.num_experts, physical_experts(cfg.num_experts, cfg.num_physical_experts),
                           resolved_max_replicas(cfg.num_experts, cfg.num_physical_experts, cfg.max_replicas)};
  const std::string table = replica_error("dispatch", code, a, b, c, shape);
  return table.empty() ? cat("error code ", code) : table;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const Group& group, const BufferConfig& config) {
  return std::make_unique<CudaBackend>(group, config);
}

// The engines this buffer moves rows with (EPX_DISPATCH_ENGINE, EPX_COMBINE_ENGINE or the measured
// defaults), the streams they keep busy checked against the transport's limits, and the measuring
// and test switches. Read before the creation's agreement, so a bad value fails every rank
// (core/creation.hpp).
void CudaBackend::choose_paths(const CudaGroupState& state) {
  poison_outputs_ = env_poison_outputs();
  timer_.start(env_profile());
  broadcast_ = use_broadcast(config(), ranks_);
  copy_combine_ = use_copy_combine(ranks_);
  // The call's stream and the copy engines' stream.
  state.check_streams(1 + (broadcast_ || copy_combine_ ? 1 : 0));
}

CudaBackend::CudaBackend(const Group& group, const BufferConfig& config)
    : Backend(group, config),
      rank_(group.rank()),
      ranks_(group.size()),
      replicas_(replica_shape(config.num_experts, config.num_physical_experts, config.max_replicas, group.size(),
                              "buffer")),
      local_experts_(replicas_.physical / group.size()),
      wire_(wire_row(config.wire, config.hidden)) {
  // This backend's own checks of the config and the environment, then the creation's agreement
  // (core/creation.hpp): a rank refusing fails every rank at once, before anything collective.
  CudaGroupState* state = nullptr;
  agree_after_checks(group, "buffer", describe(config), config.timeout_ms, [&] {
    state = dynamic_cast<CudaGroupState*>(group.state().get());
    require(state != nullptr, "buffer: group is not a CUDA group");
    require(ranks_ <= kMaxRanks, "buffer: the CUDA backend supports at most ", kMaxRanks, " ranks, got ", ranks_);
    require(replicas_.logical * replicas_.width < (int64_t{1} << 31), "buffer: the CUDA backend supports replica ",
            "tables of fewer than 2^31 entries (num_experts x max_replicas), got ", replicas_.logical * replicas_.width);
    refuse_shared_expert(config.shared_expert, "buffer");
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
    require(config.send_blocks < blocks_, "buffer: send_blocks must be in [0, ", blocks_ - 1,
            "] (0 = the measured split; at least one of the ", blocks_, " blocks receives), got ", config.send_blocks);
    timeout_ = resolve_timeout(config.timeout_ms);  // EPX_TIMEOUT_MS may be bad on one rank's host
    choose_paths(*state);
    map_ = make_window_map(config, replicas_.physical, ranks_, wire_, broadcast_);
  });
  // Everything that may synchronize the device comes before the collective window allocation:
  // once a rank returns from it, peers may already wait inside a call, and on a GPU shared by
  // several ranks a device-synchronizing call would wait for them (and they for us).
  kernels::preload_kernels();
  EPX_CUDA(cudaMalloc(&call_state_, sizeof(CallState)));
  EPX_CUDA(cudaMemset(call_state_, 0, sizeof(CallState)));
  EPX_CUDA(cudaMalloc(&status_, sizeof(DeviceStatus)));
  EPX_CUDA(cudaMalloc(&scratch_, sizeof(int64_t)));
  EPX_CUDA(cudaMalloc(&load_, static_cast<size_t>(local_experts_) * sizeof(int64_t)));
  EPX_CUDA(cudaMemset(load_, 0, static_cast<size_t>(local_experts_) * sizeof(int64_t)));
  if (replicas_.enabled()) EPX_CUDA(cudaMalloc(&replica_seen_, static_cast<size_t>(replicas_.physical) * sizeof(int32_t)));
  EPX_CUDA(cudaMemset(status_, 0, sizeof(DeviceStatus)));
  EPX_CUDA(cudaHostAlloc(&host_status_, sizeof(DeviceStatus), cudaHostAllocMapped));
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  EPX_CUDA(cudaHostAlloc(&plan_report_, sizeof(PlanReport), cudaHostAllocMapped));
  std::memset(plan_report_, 0, sizeof(PlanReport));
  cudaStream_t own = nullptr;
  EPX_CUDA(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  owned_stream_ = std::shared_ptr<CUstream_st>(own, [](cudaStream_t st) { cudaStreamDestroy(st); });
  stream_ = own;
  if (broadcast_ || copy_combine_) EPX_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  if (broadcast_) EPX_CUDA(cudaEventCreateWithFlags(&broadcast_begun_, cudaEventDisableTiming));
  EPX_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  EPX_CUDA(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
  EPX_CUDA(cudaEventCreateWithFlags(&plan_done_, cudaEventDisableTiming));
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
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  window_->await_peers_release(timeout_);  // before any cudaFree (a shared GPU: cuda_group.hpp)
  {
    std::lock_guard<std::mutex> lock(block_cache_->mutex);
    for (const auto& block : block_cache_->blocks) cudaFreeAsync(block.first, owned_stream_.get());
    block_cache_->blocks.clear();
  }
  block_cache_.reset();  // blocks released later go back to the pool
  cudaStreamSynchronize(owned_stream_.get());
  window_.reset();
  cudaFree(status_);
  cudaFree(call_state_);
  cudaFree(scratch_);
  cudaFree(load_);
  cudaFree(replica_seen_);
  cudaFreeHost(host_status_);
  cudaFreeHost(plan_report_);
  cudaEventDestroy(fork_);
  cudaEventDestroy(plan_done_);
  cudaEventDestroy(copies_done_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (broadcast_begun_) cudaEventDestroy(broadcast_begun_);
}

int CudaBackend::send_blocks(bool dispatch, Layout layout) const {
  // The split of the SM budget measured best on 2x H200 at the V3 shape
  // (docs/lab/2026-12-01-performance-diary.md, "SM split"): expert-major receivers write each
  // token ~4 times, so a dispatch gives them two thirds; expert-major combine senders sum ~4 rows
  // per token, so they get two thirds there.
  int send = blocks_ / 2;
  if (layout == Layout::expert_major) send = dispatch ? blocks_ / 3 : blocks_ * 2 / 3;
  if (config().send_blocks > 0) send = static_cast<int>(config().send_blocks);  // BufferConfig::send_blocks
  return std::clamp(send, 1, blocks_ - 1);
}

int CudaBackend::expand_senders(Layout layout) const { return ranks_ == 1 ? 0 : send_blocks(true, layout); }

kernels::Ctx CudaBackend::ctx(cudaStream_t stream) const {
  const BufferConfig& c = config();
  kernels::Ctx x{window_->peers(), map_, {}, status_, call_state_, static_cast<uint64_t>(timeout_.count()) * 1000000ull,
                 blocks_, stream ? stream : stream_};
  x.shape = {rank_, ranks_, c.hidden, c.topk, replicas_.physical, local_experts_, c.max_tokens_per_rank};
  return x;
}

std::string CudaBackend::Call::name() const {
  const std::string own = cat(call_kind_name(kind), " #", unsynced_before ? index + 1 : index);
  return unsynced_before ? cat("the call before ", own, " (it ran without a host sync)") : own;
}

CudaBackend::Call CudaBackend::begin_call(CallKind kind) {
  Call call{kind, calls_, kind == kCachedDispatch};
  if (broken_) fail(ErrorCode::peer_failed, call.name(), " (rank ", rank_, "): the group already failed: ", broken_reason_);
  EPX_CUDA(cudaSetDevice(device_));
  // A blocking call reads the device on the host, which a CUDA graph capture cannot hold: refused
  // before the call counts, so the host's and the device's call numbers stay together.
  if (config().mode == CapacityMode::blocking && capturing(stream_))
    fail(ErrorCode::invalid_argument, call.name(), " (rank ", rank_, "): a blocking-mode call cannot be captured in a ",
         "CUDA graph (it reads the device on the host); capture capacity-mode calls (BufferConfig::mode = "
         "CapacityMode::capacity)");
  check_earlier_calls(call);  // its timeout message tells the earlier call's host steps
  host_steps_.begin();
  // The host's call count and the device's advance together (plan slots are found from either).
  ++calls_;
  if (call.begun_on_device) kernels::begin_call(ctx());
  host_steps_.mark("call begun");
  return call;
}

void CudaBackend::begin_on_device(Call& call) {
  if (call.begun_on_device) return;
  kernels::begin_call(ctx());
  call.begun_on_device = true;
}

// The host-mapped status is the previous call's (published at its end, cleared by this call's
// begin kernel); a failure there was not raised yet when that call ran without a host sync.
void CudaBackend::check_earlier_calls(const Call& call) {
  if (!own_rejection_.empty()) {
    const std::string reason = std::move(own_rejection_);
    own_rejection_.clear();
    fail(ErrorCode::peer_failed, "the call before ", call.name(), " (rank ", rank_, ", it ran without a host sync): rank ",
         rank_, " rejected its input, so the group stops: ", reason);
  }
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  if (st.code == kStatusOk) return;
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  raise(st, Call{call.kind, call.index - 1, true, true});
}

void CudaBackend::raise(const DeviceStatus& st, const Call& call) {
  const std::string who = cat(call.name(), " (rank ", rank_, "): ");
  switch (st.code) {
    case kStatusBadExpert:
    case kStatusRepeatedExpert:
    case kStatusNonFinite:
    case kStatusReplicaOutOfRange:
    case kStatusReplicaRepeated:
    case kStatusReplicaEmptyRow:
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
      } else if (st.a == kStatusTimeout || st.a == kStatusPeerRejected || st.a == kStatusCallMismatch ||
                 st.a == kStatusReplicaMismatch) {
        // The peer failed for a reason of the group's, not of its input: its own error says which.
        fail(ErrorCode::peer_failed, who, "rank ", st.rank,
             st.a == kStatusTimeout ? " gave up waiting for another rank" : " stopped after another rank failed",
             " (its own error says which), so the group stops");
      } else {
        reason = input_error(static_cast<int32_t>(st.a), st.b, st.c, st.d, config());
      }
      fail(ErrorCode::peer_failed, who, "rank ", st.rank, " rejected its input, so the group stops: ", reason);
    }
    case kStatusCallMismatch:
      fail(ErrorCode::config_mismatch, who, "rank ", st.rank, " is in '", call_kind_name(static_cast<int32_t>(st.a)), " #",
           st.b, "' or uses other options; every rank must make the same collective calls in the same order, with "
           "the same options and handles of the same dispatch");
    case kStatusReplicaMismatch:
      fail(ErrorCode::config_mismatch, who, "rank ", st.rank, " passes another expert_replicas table (their hashes "
           "differ); every rank must pass the same replica table at every dispatch");
    case kStatusTimeout: {
      static const char* steps[] = {"plan exchange", "transfer", "return transfer"};
      broken_ = true;
      broken_reason_ = cat(call.name(), " (", steps[st.a % 3], "): rank ", rank_, " waited ", timeout_.count(),
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
  sync_and_raise(call);
}

void CudaBackend::sync_and_raise(const Call& call) {
  EPX_CUDA(cudaStreamSynchronize(stream_));
  DeviceStatus st;
  std::memcpy(&st, host_status_, sizeof st);
  if (st.code == kStatusOk) return;
  std::memset(host_status_, 0, sizeof(DeviceStatus));
  raise(st, call);
}

bool CudaBackend::plan_ok() {
  EPX_CUDA(cudaEventSynchronize(plan_done_));
  // Also what an earlier call published after it returned (its transfer's findings: the stream
  // is past it now): the call then runs on and raises it at its end, with its own.
  return reinterpret_cast<volatile PlanReport*>(plan_report_)->status.code == kStatusOk &&
         reinterpret_cast<volatile DeviceStatus*>(host_status_)->code == kStatusOk;
}

bool CudaBackend::copies_wait_for_plan() const {
  return config().mode == CapacityMode::blocking && copy_combine_ && ranks_ > 1;
}

void CudaBackend::end_call(const Call& call, bool plan_failed, bool published) {
  if (published) {
    if (plan_failed) sync_and_raise(call);
  } else if (plan_failed) {
    sync_and_check(call);
  } else {
    kernels::publish_status(ctx(), host_status_);
  }
}

PlanHeader CudaBackend::plan_header(const Call& call, const std::string& error, int64_t tokens, int64_t signature) const {
  PlanHeader h;
  std::memset(&h, 0, sizeof h);
  h.call_kind = call.kind;
  h.error = error.empty() ? kStatusOk : kStatusHostRejected;
  h.call_index = call.index;
  h.tokens = tokens;
  h.signature = signature;
  // The peers quote it: a reason longer than the slot ends in "..." (this rank throws it whole).
  std::strncpy(h.message, error.c_str(), sizeof h.message - 1);
  if (error.size() > sizeof h.message - 1) std::memcpy(h.message + sizeof h.message - 4, "...", 3);
  return h;
}

void CudaBackend::reject(const Call& call, int phases, const std::string& error, int64_t tokens, int64_t signature) {
  const PlanHeader h = plan_header(call, error, tokens, signature);
  for (int phase = 0; phase < phases; ++phase) {  // peers wait for every exchange of the call
    kernels::post_plan(ctx(), h, nullptr, 0, phase, phase == 0 && !call.begun_on_device);
    kernels::wait_signals(ctx(), kSignalPlan, 1, /*wait=*/false);  // keeps this rank's targets in step
  }
  // In capacity mode the peers find the rejection on the device and raise it at their next call
  // (no host sync): this rank's next call raises it too, so that every rank skips that call alike.
  if (config().mode == CapacityMode::capacity) own_rejection_ = error;
  throw Error(ErrorCode::invalid_argument, error);
}

void CudaBackend::reject(Op op, const std::string& reason) {
  static_assert(static_cast<int>(Op::dispatch) == kDispatch && static_cast<int>(Op::combine) == kCombine &&
                static_cast<int>(Op::dispatch_backward) == kDispatchBackward &&
                static_cast<int>(Op::combine_backward) == kCombineBackward &&
                static_cast<int>(Op::cached_dispatch) == kCachedDispatch);
  Call call = begin_call(static_cast<CallKind>(op));
  // A dispatch with dropping has two plan exchanges; peers wait for both (dispatch()).
  const int phases = op == Op::dispatch && config().capacity_factor > 0.0 ? 2 : 1;
  if (op == Op::dispatch && broadcast_) {  // as dispatch() does
    begin_on_device(call);
    kernels::release_broadcast(ctx());
  }
  reject(call, phases, reason, 0, signature_of({-1}));
}

kernels::ExchangeJob CudaBackend::exchange_job(const Call& call, int phase, int64_t tokens, int64_t signature,
                                               const int64_t* counts, int64_t count_len, int64_t* expert_prefix,
                                               int64_t* drop_capacity, const kernels::LayoutJob* layout,
                                               const int64_t* dropped) const {
  kernels::ExchangeJob j;
  j.header = plan_header(call, "", tokens, signature);
  j.counts = counts;
  j.count_len = counts ? count_len : 0;
  j.phase = phase;
  j.begins_call = phase == 0 && !call.begun_on_device;
  j.with_counts = expert_prefix != nullptr;
  j.capacity_factor = expert_prefix ? config().capacity_factor : 0.0;
  j.expert_prefix = expert_prefix;
  j.drop_capacity = drop_capacity ? drop_capacity : scratch_;
  if (layout) {
    j.with_layout = true;
    j.layout = *layout;
  }
  // The drop rule's exchange (expert_prefix) is not the call's last. The kernel writes every field of
  // the report's status (plan_ok reads it after plan_done_, recorded behind this launch); the clear
  // is only a belt, harmless even while an earlier call's kernel still runs (it writes before this one).
  if (config().mode == CapacityMode::blocking && expert_prefix == nullptr) {
    std::memset(&plan_report_->status, 0, sizeof(DeviceStatus));
    j.report = {plan_report_, dropped};
  }
  return j;
}

void CudaBackend::exchanged(const kernels::ExchangeJob& job) {
  if (job.report.to) EPX_CUDA(cudaEventRecord(plan_done_, stream_));
}

void CudaBackend::exchange_plan(const Call& call, int64_t tokens, int64_t signature) {
  const kernels::ExchangeJob job = exchange_job(call, 0, tokens, signature, nullptr, 0);
  kernels::exchange_plan(ctx(), job);
  exchanged(job);
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
  // stream waits for (set_stream's fork_), so reusing it is ordered after that use.
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

// The counters themselves (device memory the buffer owns; dispatches add to them on its stream):
// a view, as the CPU backend's, valid while the buffer is.
Tensor CudaBackend::expert_load() const {
  return Tensor(std::shared_ptr<void>(load_, [](void*) {}),
                TensorView::of(load_, DType::i64, {local_experts_}, DeviceKind::cuda, device_));
}

// Stream-ordered: after every dispatch enqueued before it, before every one after.
void CudaBackend::reset_expert_load() {
  EPX_CUDA(cudaSetDevice(device_));
  EPX_CUDA(cudaMemsetAsync(load_, 0, static_cast<size_t>(local_experts_) * sizeof(int64_t), stream_));
}

void CudaBackend::check_device_tensor(const TensorView& t, std::string_view what) const {
  if (t.defined())
    require(t.device_index == device_, what, ": tensor is on cuda:", t.device_index, " but this rank drives cuda:", device_);
}

const HandleState& CudaBackend::state_of(const Handle& h, const Call& call) const {
  require(h.valid(), call.name(), ": the handle is empty; pass the handle returned by dispatch");
  require(h.state().owner == this, call.name(),
          ": the handle belongs to another buffer or rank; pass the handle this buffer's dispatch returned");
  return h.state();
}

CudaBackend::DispatchRequest CudaBackend::read_dispatch(const DispatchInput& in, const DispatchOptions& opt) const {
  const BufferConfig& c = config();
  DispatchRequest rq;
  try {
    validate_dispatch_options(opt);
    validate_dispatch_x(in, c, DeviceKind::cuda);
    check_device_tensor(in.x, "dispatch: x");
    rq.tokens = in.x.shape[0];
    validate_routing_tensors(in, c, rq.tokens, DeviceKind::cuda);
    validate_shared_expert(in, c, opt, rq.tokens, DeviceKind::cuda);  // refuses a shared_gate (no shared expert here)
    validate_replica_tensor(in.expert_replicas, replicas_, "dispatch", DeviceKind::cuda);
    check_device_tensor(in.expert_replicas, "dispatch: expert_replicas");
    if (replicas_.enabled())  // its values are checked by the plan kernel
      rq.replicas = {in.expert_replicas.ptr<const int32_t>(), replica_seen_, replicas_.logical, replicas_.width,
                     replicas_.physical, in.expert_replicas.strides[0]};
    rq.routing = routing_input(in);
    rq.routing.experts = c.num_experts;
    rq.has_weights = in.topk_idx.defined() ? in.topk_weights.defined() : in.probs.defined();
    rq.rows = send_rows(in, c.wire, opt.nvfp4_global_scale);
    if (c.check_finite) rq.finite = finite_check(in, c.hidden);
  } catch (const Error& e) {
    rq.error = e.what();
  }
  return rq;
}

CudaBackend::BroadcastRows CudaBackend::start_broadcast(const kernels::SendRows& rows, int64_t tokens) {
  BroadcastRows b{rows.x, rows.x_stride_bytes, wire_.bytes()};  // bf16: x itself
  EPX_CUDA(cudaEventRecord(fork_, stream_));
  EPX_CUDA(cudaStreamWaitEvent(copy_stream_, fork_, 0));
  timer_.mark(6, copy_stream_);
  kernels::begin_broadcast(ctx(), copy_stream_);
  if (config().wire != WireFormat::bf16) {  // quantized (or given fp8) rows wait in this rank's window
    kernels::encode_rows(ctx(copy_stream_), rows, tokens);
    timer_.mark(11, copy_stream_);
    b.from = window_->local() + map_.bcast_rows + rank_ * config().max_tokens_per_rank * map_.bcast_stride;
    b.stride = b.row_bytes = map_.bcast_stride;
  }
  // The placing data and the receivers wait for this: the peers read this rank's previous
  // broadcast, and its own encoded rows are in place.
  EPX_CUDA(cudaEventRecord(broadcast_begun_, copy_stream_));
  // Two pieces keep the copy engines busy (~100 us at V3, more than the host takes to launch the
  // routing, which the receiver waits for); the other pieces follow the routing.
  enqueue_broadcast(b, tokens, 0, 2);
  host_steps_.mark("broadcast enqueued");
  return b;
}

void CudaBackend::enqueue_broadcast(const BroadcastRows& b, int64_t tokens, int64_t first, int64_t end) {
  if (first < end)
    kernels::copy_pieces(kernels::broadcast_pieces(ctx(), b.from, b.stride, b.row_bytes, tokens, first, end),
                         copy_stream_);
  if (end < kMaxPieces) return;
  timer_.mark(7, copy_stream_);
  EPX_CUDA(cudaEventRecord(copies_done_, copy_stream_));
}

std::shared_ptr<DeviceHandle> CudaBackend::make_device_handle(int64_t tokens) {
  const BufferConfig& c = config();
  auto dh = std::make_shared<DeviceHandle>();
  const kernels::PlanSplit split = kernels::plan_split(blocks_, tokens);
  Carver measure(nullptr);
  carve_handle(*dh, measure, tokens, c, replicas_.physical, ranks_, map_.max_chunks, split);
  const Tensor block = output_block(measure.used(), stream_);  // cached like the outputs
  dh->memory = block.storage();
  Carver carve(block.data<char>());
  carve_handle(*dh, carve, tokens, c, replicas_.physical, ranks_, map_.max_chunks, split);
  host_steps_.mark("handle allocated");
  return dh;
}

// The plan kernel writes every array of the sender's half before it reads it. The receive arrays
// (carved last, from recv.info to the end of recv.slot_row) start zeroed: a receiver that stops
// early in a failed call leaves zeros there, not an earlier dispatch's ranges and rows, for a later
// call on the handle (no chunk to return, no row to read). With the drop rule, its sums too
// (counts to dropped, carved just before them), which the routing adds to.
CudaBackend::ZeroedParts CudaBackend::zeroed_parts(const DeviceHandle& dh) const {
  const BufferConfig& c = config();
  const int64_t rows = ranks_ * c.max_tokens_per_rank;
  auto part = [](void* from, void* end) {
    return kernels::ZeroBytes{static_cast<char*>(from), static_cast<char*>(end) - static_cast<char*>(from)};
  };
  ZeroedParts z;
  z.receive = part(dh.recv.info, dh.recv.slot_row + rows * c.topk);
  if (c.capacity_factor > 0.0) z.sums = part(dh.counts, dh.recv.info);
  return z;
}

// The dispatch's plan: routing, positions and the plan exchange with the receiver's layout in one
// launch (kernels::plan_dispatch). With the drop rule, the routing and the exchange of its counts
// come first, then drop_slots, then the positions and the last exchange. A copy-engine dispatch
// then makes its positions final (the SM senders do it as they send).
// EPLB: the routing also maps each slot to its replica and writes it to `chosen` (topk_physical).
int CudaBackend::plan(const Call& call, int64_t signature, const DispatchRequest& rq, DeviceHandle& dh,
                      const kernels::LayoutJob& layout, int32_t* chosen) {
  const BufferConfig& c = config();
  const int64_t tokens = rq.tokens;
  timer_.mark(0, stream_);
  const kernels::Ctx x = ctx();
  kernels::RouteJob job;
  const ZeroedParts zeroed = zeroed_parts(dh);
  job.begins_call = !call.begun_on_device;  // the call's first launch (a drop rule's first run)
  job.sums = zeroed.sums;
  job.zeroed = zeroed.receive;
  job.in = rq.routing;
  job.finite = rq.finite;
  job.replicas = rq.replicas;
  job.chosen = chosen;
  job.slot_expert = dh.slot_expert;
  job.slot_weight = dh.slot_weight;
  job.pos = dh.pos;
  int phase = 0;
  const bool drop = c.capacity_factor > 0.0;
  if (drop) {  // a first exchange fixes what is kept
    kernels::RouteJob routing = job;
    routing.counts = dh.counts;
    routing.positions = false;
    kernels::plan_dispatch(x, tokens, routing,
                           exchange_job(call, phase++, tokens, signature, dh.counts, replicas_.physical,
                                        dh.expert_prefix, dh.drop_capacity));
    kernels::drop_slots(x, tokens, dh.slot_expert, dh.slot_weight, dh.expert_prefix, dh.drop_capacity, dh.dropped);
    job.canonicalize = false;
    job.begins_call = false;
    job.replicas = {};
    job.chosen = nullptr;
    job.sums = job.zeroed = kernels::ZeroBytes{};
  }
  const kernels::ExchangeJob last = exchange_job(call, phase, tokens, signature, dh.pos.totals, replicas_.physical + ranks_,
                                                 nullptr, nullptr, &layout, drop ? dh.dropped : nullptr);
  kernels::plan_dispatch(x, tokens, job, last);
  if (layout.layout == Layout::expert_major) exchanged(last);  // rank-major reads its sizes after its sync
  if (broadcast_) kernels::finalize_positions(x, tokens, dh.slot_expert, dh.pos);
  timer_.mark(1, stream_);
  host_steps_.mark("plan launched");
  return phase;
}

void CudaBackend::add_row_outputs(OutputBlock& outputs, DispatchResult& out, int64_t capacity) const {
  const int64_t hidden = config().hidden;
  if (wire_.format == WireFormat::bf16) outputs.add(&out.recv_x, DType::bf16, {capacity, hidden});
  else if (wire_.format == WireFormat::nvfp4) outputs.add(&out.recv_x, DType::e2m1x2, {capacity, hidden / 2});
  else outputs.add(&out.recv_x, DType::fp8_e4m3, {capacity, hidden});
  if (wire_.format == WireFormat::nvfp4) outputs.add(&out.recv_scales, DType::fp8_e4m3, {capacity, hidden / kNvfp4Block});
  else if (wire_.scale_bytes) outputs.add(&out.recv_scales, DType::f32, {capacity, hidden / kFp8Block});
  if (wire_.global_bytes) outputs.add(&out.recv_global_scale, DType::f32, {capacity});
}

kernels::RecvOutputs CudaBackend::allocate_outputs(DispatchResult& out, const DeviceHandle& dh, Layout layout,
                                                   int64_t capacity) {
  const BufferConfig& c = config();
  OutputBlock outputs(*this, stream_);
  add_row_outputs(outputs, out, capacity);
  outputs.add(&out.recv_src, DType::i32, {capacity, 2});
  if (layout == Layout::expert_major) {
    outputs.add(&out.recv_weights, DType::f32, {capacity});
  } else {
    outputs.add(&out.recv_topk_idx, DType::i32, {capacity, c.topk});
    outputs.add(&out.recv_topk_weights, DType::f32, {capacity, c.topk});
  }
  // Room for the copy of the handle's layout arrays, which finish_dispatch cuts the small outputs from.
  outputs.add(&out.recv_info, DType::i64, {layout_words(dh, local_experts_)});
  outputs.allocate();
  host_steps_.mark("outputs allocated");
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data<char>() : nullptr; };
  return kernels::RecvOutputs{ptr(out.recv_x), ptr(out.recv_scales), ptr(out.recv_global_scale), wire_.x_bytes,
                              wire_.scale_bytes, wire_.global_bytes, out.recv_src.data<int32_t>(),
                              reinterpret_cast<float*>(ptr(out.recv_weights)),
                              reinterpret_cast<int32_t*>(ptr(out.recv_topk_idx)),
                              reinterpret_cast<float*>(ptr(out.recv_topk_weights))};
}

void CudaBackend::transfer(const DispatchRequest& rq, const DeviceHandle& dh, const kernels::RecvOutputs& outputs,
                           Layout layout, int phase, const Tensor& layout_copy) {
  const kernels::CallEnd end{dh.recv.info, layout_copy.data<int64_t>(), layout_words(dh, local_experts_), host_status_};
  timer_.mark(4, stream_);
  if (broadcast_) {
    const kernels::Placing mine{dh.slot_expert, dh.slot_weight, dh.pos.send_pos, dh.pos.slot_pos};
    // Once the peers have read this rank's previous broadcast and its own encoded rows are in place.
    EPX_CUDA(cudaStreamWaitEvent(stream_, broadcast_begun_, 0));
    kernels::broadcast_placing(ctx(), mine, rq.tokens);
    kernels::dispatch_receive(ctx(), dh.recv, outputs, layout, rq.rows, mine, phase, end);
    EPX_CUDA(cudaStreamWaitEvent(stream_, copies_done_, 0));  // x is read until then
  } else {
    // At one rank every row goes from x to the outputs by the receivers alone (encoded there).
    const bool alone = ranks_ == 1 && !kernels::own_rows_sent(rq.rows, wire_.bytes());
    const int senders = alone ? 0 : send_blocks(true, layout);
    kernels::dispatch_transfer(ctx(), senders, rq.rows, rq.tokens,
                               kernels::SendPlan{dh.slot_expert, dh.slot_weight, dh.pos}, dh.recv, outputs, layout,
                               end);
  }
  timer_.mark(5, stream_);
  host_steps_.mark("transfer launched");
}

void CudaBackend::take_sizes(DispatchResult& out, HandleState& h) const {
  const PlanReport& r = *plan_report_;
  out.num_rows = r.info[1];
  out.overflow = r.info[3] != 0;
  out.dropped_slots = r.dropped;
  h.recv.tokens = r.info[0];
  h.recv.num_rows = r.info[1];
  h.recv.capacity = r.info[2];
  if (copy_combine_) h.recv.rank_offsets.assign(r.rank_offsets, r.rank_offsets + ranks_ + 1);  // combine copies by source
}

DispatchResult CudaBackend::finish_dispatch(const Call& call, DispatchResult out, std::shared_ptr<DeviceHandle> dh,
                                            std::shared_ptr<HandleState> h, Layout layout, int64_t capacity,
                                            bool sizes_read, std::chrono::steady_clock::time_point host_call) {
  // Small outputs: views of the transfer's copy of the handle's layout arrays (info,
  // rank_offsets, tokens_per_expert, expert_offsets, consecutive in its memory), so that no output
  // aliases what later calls on the handle read: a caller may write into its outputs, and
  // torch.compile reuses a dead output's memory.
  const Tensor words = out.recv_info;
  auto view = [&](int64_t* p, int64_t n) {
    return Tensor(words.storage(), TensorView::of(words.data<int64_t>() + (p - dh->recv.info), DType::i64, {n},
                                                  DeviceKind::cuda, device_));
  };
  if (layout == Layout::expert_major) out.expert_offsets = view(dh->recv.expert_offsets, local_experts_ + 1);
  out.tokens_per_expert = view(dh->recv.tokens_per_expert, local_experts_);
  out.rank_offsets = view(dh->recv.rank_offsets, ranks_ + 1);
  out.recv_info = view(dh->recv.info, 4);
  h->device = dh;
  if (config().mode == CapacityMode::capacity) {
    out.num_rows = -1;
    h->recv.num_rows = -1;
    h->recv.capacity = capacity;
    out.handle = Handle(std::move(h));
    return out;
  }
  // Blocking: the sizes, read already (with the plan's check; what the transfer finds is raised
  // by the next call), or read now with the call's one sync (the plan's report is in by then).
  // The transfer's last block published the status.
  if (!sizes_read) {
    sync_and_raise(call);
    host_steps_.mark("synced");
  }
  take_sizes(out, *h);
  for (Tensor* t : {&out.recv_x, &out.recv_scales, &out.recv_global_scale, &out.recv_src, &out.recv_weights,
                    &out.recv_topk_idx, &out.recv_topk_weights})
    if (t->defined()) *t = row_range(*t, 0, h->recv.capacity);
  out.handle = Handle(std::move(h));
  if (timer_.on()) report_dispatch_profile(config().wire != WireFormat::bf16, host_call);
  return out;
}

// On the call's stream: the plan kernel, then (blocking expert-major: after the host's read of
// the sizes) the outputs' allocation and the transfer, whose last block copies the small outputs
// and publishes the status. A copy-engine dispatch enqueues its broadcast's first two pieces
// before the plan and the others after it.
DispatchResult CudaBackend::dispatch(const DispatchInput& in, const DispatchOptions& opt) {
  const auto host_call = std::chrono::steady_clock::now();
  Call call = begin_call(kDispatch);
  const BufferConfig& c = config();
  const DispatchRequest rq = read_dispatch(in, opt);
  const int64_t tokens = rq.tokens;
  host_steps_.mark("validated");
  const int64_t signature = signature_of({static_cast<int64_t>(opt.layout), broadcast_ ? 1 : 0});
  if (!rq.error.empty()) {
    if (broadcast_) {  // peers' next broadcasts wait for this rank's receiver
      begin_on_device(call);
      kernels::release_broadcast(ctx());
    }
    reject(call, c.capacity_factor > 0.0 ? 2 : 1, rq.error, tokens, signature);
  }
  BroadcastRows broadcast{};
  if (broadcast_) {  // the copy engines start on the rows now, their flags carrying the call's number
    begin_on_device(call);
    broadcast = start_broadcast(rq.rows, tokens);
  }
  const std::shared_ptr<DeviceHandle> dh = make_device_handle(tokens);
  const bool capacity_mode = c.mode == CapacityMode::capacity;
  const kernels::LayoutJob layout{dh->recv, opt.layout, c.expert_alignment, capacity_mode ? c.capacity_rows : 0, load_};
  DispatchResult out;
  if (replicas_.enabled()) {  // EPLB: the replicas chosen, which the plan kernel writes
    OutputBlock chosen(*this, stream_);
    chosen.add(&out.topk_physical, DType::i32, {tokens, c.topk});
    chosen.allocate();
  }
  const int phase =
      plan(call, signature, rq, *dh, layout, out.topk_physical.defined() ? out.topk_physical.data<int32_t>() : nullptr);
  if (broadcast_) {
    enqueue_broadcast(broadcast, tokens, 2, kMaxPieces);
    host_steps_.mark("broadcast's other pieces enqueued");
  }
  // Output rows. Capacity mode: capacity_rows. Blocking, rank-major: at most every source's
  // max_tokens, no larger than the window's staging, so the outputs are allocated at that bound
  // and cut to num_rows after the call's one sync. Blocking, expert-major: the bound would be
  // min(K, L) times larger, so the sizes are read first: the call's one host read, with what the
  // device found up to the plan (a finding makes the call run on and raise at its end).
  int64_t capacity = capacity_mode ? c.capacity_rows : ranks_ * c.max_tokens_per_rank;
  bool sizes_read = false;
  if (!capacity_mode && opt.layout == Layout::expert_major) {
    sizes_read = plan_ok();
    capacity = plan_report_->info[2];
    host_steps_.mark("sizes read");
  }
  const kernels::RecvOutputs outputs = allocate_outputs(out, *dh, opt.layout, capacity);
  transfer(rq, *dh, outputs, opt.layout, phase, out.recv_info);
  return finish_dispatch(call, std::move(out), dh,
                         new_handle_state(this, call.index, opt.layout, rank_, ranks_, tokens, c, rq.has_weights),
                         opt.layout, capacity, sizes_read, host_call);
}

// EPX_PROFILE: the call's device steps (its events' marks) and host steps, added to the means
// printed when the buffer goes.
void CudaBackend::report_dispatch_profile(bool quantized, std::chrono::steady_clock::time_point host_call) {
  timer_.add("dispatch: plan", 0, 1);
  timer_.add("dispatch: sizes read+alloc", 1, 4);
  timer_.add(broadcast_ ? "dispatch: placing+receive kernels" : "dispatch: transfer kernel", 4, 5);
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
  exchange_plan(call, h->tokens, signature);
  host_steps_.mark("plan posted");
  return *h;
}

CombineResult CudaBackend::combine(const CombineInput& in, const Handle& handle, const CombineOptions& opt) {
  const Call call = begin_call(kCombine);
  const BufferConfig& c = config();
  timer_.mark(0, stream_);
  // The engine is part of the signature: ranks with different EPX_COMBINE_ENGINE would wait for
  // each other's rows on different flags, so the plan check stops them first.
  // The copies return bf16 rows only: an fp8 combine wire takes the SM engine (dispatch_backward keeps the copies).
  const bool copy_return = copy_combine_ && c.combine_wire == WireFormat::bf16;
  const bool waits = copy_return && copies_wait_for_plan();
  const int64_t options = (opt.weighted ? 1 : 0) + (copy_return ? 2 : 0);
  CombineResult out;
  std::vector<Tensor> staging;
  const HandleState* h = &start_handle_call(call, handle, options, [&](const HandleState& state) {
    validate_combine(in, state, c, opt, DeviceKind::cuda);
    check_device_tensor(in.y, "combine: y");
    require(c.combine_wire == WireFormat::bf16 || in.y.shape[0] == 0 ||
                (reinterpret_cast<uintptr_t>(in.y.data) % 16 == 0 && in.y.strides[0] % 8 == 0),
            "combine: y must be 16-byte aligned, its rows too, with combine_wire ", wire_name(c.combine_wire),
            " (its partials are quantized from 16-byte loads)");
  });
  timer_.mark(1, stream_);
  const DeviceHandle& dh = device_of(*h);
  // The output, the reducers' arguments and the copy-engine return.
  out.out = device_tensor(DType::bf16, {h->tokens, c.hidden});
  kernels::CombineArgs a{in.y.ptr<const uint16_t>(), in.y.strides[0], opt.weighted, nullptr, 0,
                         in.shared_out.defined() ? in.shared_out.ptr<const uint16_t>() : nullptr,
                         in.shared_out.defined() ? in.shared_out.strides[0] : 0, out.out.data<uint16_t>(), nullptr};
  const bool plan_failed = waits && !plan_ok();
  const bool by_copy = copy_return && !plan_failed && start_copy_return(*h, in.y, TensorView{}, a, staging);
  timer_.mark(2, stream_);
  a.host_status = host_status_;  // the kernel's last block ends the call
  a.wire = c.combine_wire;
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
  // The transfer is queued: the GPU goes on while the host reads the plan.
  end_call(call, plan_failed || (c.mode == CapacityMode::blocking && !waits && !plan_ok()), true);
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
  kernels::copy_pieces(pieces, copy_stream_);
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
  const bool plan_failed = copies_wait_for_plan() && !plan_ok();  // as combine's
  const bool by_copy = !plan_failed && start_copy_return(*h, in.grad_recv_x, gw, a, staging);
  a.host_status = host_status_;  // the kernel's last block ends the call
  kernels::combine(ctx(), by_copy ? 0 : send_blocks(false, h->layout), dh.recv, h->layout, h->tokens, dh.pos.send_pos,
                   dh.slot_expert, a);
  if (by_copy) EPX_CUDA(cudaStreamWaitEvent(stream_, copies_done_, 0));  // the inputs are read until then
  end_call(call, plan_failed || (c.mode == CapacityMode::blocking && !copies_wait_for_plan() && !plan_ok()), true);
  return out;
}

CombineBackwardResult CudaBackend::combine_backward(const CombineBackwardInput& in, const Handle& handle,
                                                    const CombineOptions& opt) {
  const Call call = begin_call(kCombineBackward);
  const BufferConfig& c = config();
  const HandleState* h = &start_handle_call(call, handle, opt.weighted, [&](const HandleState& state) {
    validate_combine_backward(in, state, c, opt, DeviceKind::cuda);
  });
  const DeviceHandle& dh = device_of(*h);
  kernels::SendRows rows;
  rows.x = static_cast<const char*>(in.grad_out.data);
  rows.x_stride_bytes = in.grad_out.strides[0] * 2;
  CombineBackwardResult out;
  out.grad_y = device_tensor(DType::bf16, {h->recv.capacity, c.hidden});
  if (opt.weighted) out.grad_topk_weights = device_tensor(DType::f32, {h->tokens, c.topk});
  const kernels::Expansion e{h->layout, opt.weighted, opt.weighted ? in.y.ptr<const uint16_t>() : nullptr,
                             opt.weighted ? in.y.strides[0] : 0, out.grad_y.data<uint16_t>(),
                             opt.weighted ? out.grad_topk_weights.data<float>() : nullptr, host_status_};
  kernels::expand_transfer(ctx(), expand_senders(h->layout), rows, h->tokens, dh.pos.send_pos, dh.slot_expert,
                           dh.recv, e);
  end_call(call, c.mode == CapacityMode::blocking && !plan_ok(), true);  // as combine's
  return out;
}

}  // namespace epx::detail
