// Host side of the CUDA backend: creation (paths, window, memory), streams, the SM split,
// outputs' memory. The calls: cuda_calls.cpp (their protocol and errors), cuda_dispatch.cpp,
// cuda_combine.cpp (combine and the backward passes), cached_dispatch.cpp.
#include "cuda/cuda_backend.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>

#include "core/creation.hpp"
#include "core/env.hpp"
#include "core/replicas.hpp"
#include "core/timeout.hpp"
#include "core/validate.hpp"
#include "cuda/copy_cuts.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/stream_pool.hpp"
#include "cuda/device_handle.hpp"
#include "cuda/stream_switch.hpp"

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
  m.plan_stride = round16(kPlanCountsAt + 8 * (experts + ranks));
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
    // The receivers encode the shared rows in their warp's stage (kernels/dispatch.cu).
    kernels::SendRows quantized;
    quantized.wire = config.wire;
    if (config.shared_expert && kernels::own_rows_sent(quantized, wire_.bytes()))
      fail(ErrorCode::unsupported, "buffer: the CUDA backend's fused shared expert needs a wire row of at most 14336 ",
           "bytes with wire ", wire_name(config.wire), ", got ", wire_.bytes(), " (hidden=", config.hidden, ")");
    require(config.max_tokens_per_rank < (int64_t{1} << (32 - kRangeCountBits)),
            "buffer: the CUDA backend supports max_tokens_per_rank < 2^27, got ", config.max_tokens_per_rank);
    device_ = state->device(rank_);
    EPX_CUDA(cudaSetDevice(device_));
    plan_warps_ = kernels::plan_chunk_warps(config.topk, replicas_.physical + ranks_);
    require(plan_warps_ >= 1, "buffer: the CUDA backend's ",
            "plan counts each chunk of 16 tokens in shared memory: 16 x topk + num_physical_experts + ranks = ",
            16 * config.topk + replicas_.physical + ranks_, " counts do not fit on cuda:", device_);
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
  cudaStream_t own = take_stream(device_);  // stream_pool.hpp: why pooled
  owned_stream_ = std::shared_ptr<CUstream_st>(own, [dev = device_](cudaStream_t st) { give_back_stream(dev, st); });
  stream_ = own;
  if (broadcast_ || copy_combine_) copy_stream_ = take_stream(device_);
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
  give_back_stream(device_, copy_stream_);
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

int CudaBackend::return_blocks(bool by_copy, bool own_in_place, Layout layout) const {
  // Nothing to return: the copy engines return the rows, or at one rank every row is read in place.
  if (by_copy || (own_in_place && ranks_ == 1)) return 0;
  return send_blocks(false, layout);
}

int CudaBackend::expand_senders(Layout layout) const { return ranks_ == 1 ? 0 : send_blocks(true, layout); }

kernels::Ctx CudaBackend::ctx(cudaStream_t stream) const {
  const BufferConfig& c = config();
  kernels::Ctx x{window_->peers(), map_, {}, status_, call_state_, static_cast<uint64_t>(timeout_.count()) * 1000000ull,
                 blocks_, stream ? stream : stream_};
  x.shape = {rank_, ranks_, c.hidden, c.topk, replicas_.physical, local_experts_, c.max_tokens_per_rank, c.shared_expert};
  return x;
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

}  // namespace epx::detail
