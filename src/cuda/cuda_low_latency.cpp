// Low-latency mode on the CUDA backend: host side of src/cuda/kernels/ll_dispatch.cu and
// ll_combine.cu. The buffer owns every array (window, two sets of outputs); results are views
// into the set of their call, valid until the receive half of the call after next
// (docs/low-latency.md).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/creation.hpp"
#include "core/check.hpp"
#include "core/env.hpp"
#include "core/low_latency_backend.hpp"
#include "core/timeout.hpp"
#include "core/validate.hpp"
#include "core/wire.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/stream_pool.hpp"
#include "cuda/cuda_group.hpp"
#include "cuda/kernels/launch.hpp"
#include "cuda/kernels/ll_launch.hpp"
#include "cuda/replica_errors.hpp"
#include "cuda/stream_switch.hpp"
#include "cuda/phase_timer.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

namespace {

constexpr int64_t kMaxLlExperts = 4096;  // the layout kernel's shared-memory counts

class CudaLowLatency final : public LowLatencyBackend {
 public:
  CudaLowLatency(const Group& group, const LowLatencyConfig& c)
      : LowLatencyBackend(group, c), chunks_((c.max_tokens_per_rank + ll::kChunk - 1) / ll::kChunk) {
    // This backend's own checks, then the creation's agreement (core/creation.hpp).
    CudaGroupState* state = nullptr;
    bool stamped = false;  // EPX_PROFILE=ll
    agree_after_checks(group, "low-latency buffer", describe(c), c.timeout_ms, [&] {
      resolve_timeout(c.timeout_ms);  // EPX_TIMEOUT_MS may be bad on one rank's host: refused by every rank
      state = dynamic_cast<CudaGroupState*>(group.state().get());
      require(state != nullptr, "low-latency buffer: group is not a CUDA group");
      require(ranks_ <= kMaxRanks, "low-latency buffer: at most ", kMaxRanks, " ranks, got ", ranks_);
      require(replicas_.physical <= kMaxLlExperts, "low-latency buffer: at most ", kMaxLlExperts,
              replicas_.enabled() ? " physical experts (num_physical_experts)" : " experts", ", got ", replicas_.physical);
      device_ = state->device(rank_);
      EPX_CUDA(cudaSetDevice(device_));
      int sms = 0;
      EPX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
      // Receive kernels wait for every peer's send kernel: all blocks of all ranks on a GPU must fit.
      // On a GPU of its own a call takes every SM for its few microseconds (as DeepEP's
      // low-latency kernels do): latency falls with the warps moving rows.
      blocks_ = std::string(state->transport_name()) == "shared-gpu" ? std::max(1, std::min(16, sms / (2 * ranks_))) : sms;
      state->check_streams(1);  // each call runs on one stream (the caller's, or the buffer's own)
      // EPX_PROFILE read before the agreement, so that a bad value fails every rank.
      const Profile profile = env_profile();
      timer_.start(profile);
      stamped = profile == Profile::ll;
    });
    kernels::preload_kernels();  // every kernel of the backend (docs/cuda.md: lazy loading)

    const int64_t m = c.max_tokens_per_rank, rows = 2 * slots_;  // one per (set, source, token)
    int64_t at = 0;
    auto take = [&](int64_t bytes) {
      const int64_t here = at;
      at += round16(bytes);
      return here;
    };
    map_.arrivals = take(8 * 2 * 2 * ranks_);
    map_.errors = take(4 * 2 * 2 * ranks_);
    map_.counts = take(4 * 2 * ranks_ * local_ * chunks_);
    map_.ntok = take(4 * 2 * ranks_);
    map_.routes = take(4 * 2 * ranks_ * m * c.topk);
    map_.payload_stride = round16(wire_.bytes());
    map_.rows = take(rows * map_.payload_stride);
    map_.ret = take(2 * 2 * m * ranks_ * c.hidden);
    map_.weights = take(4 * 2 * ranks_ * m * c.topk);
    map_.weights_in = take(4 * 2 * ranks_);
    map_.route_weights = take(4 * 2 * ranks_ * m * c.topk);
    map_.weights_from = take(4 * 2 * ranks_);
    map_.table_hash = take(8 * 2 * ranks_);
    map_.total = at;

    // This rank's arrays: both sets in one allocation, zeroed (outputs start empty).
    int64_t bytes = 0;
    for (int s = 0; s < 2; ++s) carve(sets_[s], shared_weight_[s], nullptr, bytes);
    char* base = nullptr;
    EPX_CUDA(cudaMalloc(&base, static_cast<size_t>(bytes)));
    EPX_CUDA(cudaMemset(base, 0, static_cast<size_t>(bytes)));
    memory_ = std::shared_ptr<void>(base, [](void* p) { cudaFree(p); });
    bytes = 0;
    for (int s = 0; s < 2; ++s) carve(sets_[s], shared_weight_[s], base, bytes);
    for (int s = 0; s < 2; ++s) EPX_CUDA(cudaMemset(segment0(sets_[s].recv_src, 2 * slots_), 0xff, static_cast<size_t>(8 * segments_ * slots_)));
    EPX_CUDA(cudaMalloc(&status_, sizeof(DeviceStatus)));
    EPX_CUDA(cudaMemset(status_, 0, sizeof(DeviceStatus)));
    EPX_CUDA(cudaMalloc(&done_, 2 * sizeof(uint32_t)));
    EPX_CUDA(cudaMemset(done_, 0, 2 * sizeof(uint32_t)));
    EPX_CUDA(cudaMalloc(&load_, static_cast<size_t>(local_) * sizeof(int64_t)));
    EPX_CUDA(cudaMemset(load_, 0, static_cast<size_t>(local_) * sizeof(int64_t)));
    if (replicas_.enabled())  // the table check's scratch (ReplicaTable::seen)
      EPX_CUDA(cudaMalloc(&replica_seen_, static_cast<size_t>(replicas_.physical) * sizeof(int32_t)));
    if (stamped) {
      EPX_CUDA(cudaMalloc(&stamps_, stamp_bytes()));
      EPX_CUDA(cudaMemset(stamps_, 0, stamp_bytes()));
    }
    EPX_CUDA(cudaHostAlloc(&host_status_, sizeof(DeviceStatus), cudaHostAllocMapped));
    std::memset(host_status_, 0, sizeof(DeviceStatus));
    EPX_CUDA(cudaHostAlloc(&host_started_, 4 * sizeof(uint64_t), cudaHostAllocMapped));
    std::memset(host_started_, 0, 4 * sizeof(uint64_t));
    own_stream_ = take_stream(device_);  // stream_pool.hpp: why pooled
    EPX_CUDA(cudaEventCreateWithFlags(&stream_switch_, cudaEventDisableTiming));
    stream_ = own_stream_;
    EPX_CUDA(cudaDeviceSynchronize());
    window_ = state->allocate(rank_, static_cast<size_t>(map_.total), timeout_);  // collective, zero-filled
    last_begin_ = std::chrono::steady_clock::now();
  }

  ~CudaLowLatency() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamSynchronize(own_stream_);
    window_->await_peers_release(timeout_);  // before any cudaFree (a shared GPU: cuda_group.hpp)
    if (stamps_) print_timeline();
    cudaFree(stamps_);
    window_.reset();
    cudaFree(status_);
    cudaFree(done_);
    cudaFree(load_);
    cudaFree(replica_seen_);
    cudaFreeHost(host_status_);
    cudaFreeHost(host_started_);
    give_back_stream(device_, own_stream_);
    cudaEventDestroy(stream_switch_);
  }

  void set_stream(void* stream) override {
    cudaStream_t next = stream ? static_cast<cudaStream_t>(stream) : own_stream_;
    order_after(stream_, next, stream_switch_);  // earlier calls finish before later ones start, no host wait
    stream_ = next;
  }

  void synchronize() override { EPX_CUDA(cudaStreamSynchronize(stream_)); }
  // As the high-throughput buffer's: a view of the device counters the dispatch's receive adds to.
  Tensor expert_load() const override {
    return Tensor(std::shared_ptr<void>(load_, [](void*) {}),
                  TensorView::of(load_, DType::i64, {local_}, DeviceKind::cuda, device_));
  }
  void reset_expert_load() override {  // stream-ordered
    EPX_CUDA(cudaSetDevice(device_));
    EPX_CUDA(cudaMemsetAsync(load_, 0, static_cast<size_t>(local_) * sizeof(int64_t), stream_));
  }

  void dispatch_send(const LowLatencyDispatchInput& in) override {
    require(!dispatch_pending_, "ll dispatch_send: the previous dispatch_send has no dispatch_recv yet");
    begin("ll_dispatch", dispatch_calls_);
    const int set = static_cast<int>(dispatch_calls_++ % 2);
    const LowLatencyConfig& c = config();
    ll::Route route{};
    ll::Rows rows{};
    std::string error;
    try {
      take_rejection();
      check_tensor(in.x, "ll_dispatch: x", words("[T, ", c.hidden, "] with T <= max_tokens_per_rank=", c.max_tokens_per_rank),
                   DType::bf16, {kAnyDim, c.hidden}, DeviceKind::cuda);
      on_device(in.x, "ll_dispatch: x");
      const int64_t tokens = in.x.shape[0];
      require(tokens <= c.max_tokens_per_rank, "ll_dispatch: x has ", tokens,
              " tokens but the buffer was sized for max_tokens_per_rank=", c.max_tokens_per_rank);
      require(std::isfinite(in.nvfp4_global_scale) && in.nvfp4_global_scale >= 0.0f,
              "ll_dispatch: nvfp4_global_scale must be 0 (per token) or a positive finite number");
      check_tensor2(in.topk_idx, "ll_dispatch: topk_idx", words("[T=", tokens, ", K=", c.topk, "]"), DType::i32, DType::i64,
                    {tokens, c.topk}, DeviceKind::cuda);
      on_device(in.topk_idx, "ll_dispatch: topk_idx");
      if (in.num_tokens.defined()) {
        check_tensor(in.num_tokens, "ll_dispatch: num_tokens", "[1]", DType::i32, {1}, DeviceKind::cuda);
        on_device(in.num_tokens, "ll_dispatch: num_tokens");
      }
      check_dispatch_weights(in, tokens, DeviceKind::cuda);
      validate_replica_tensor(in.expert_replicas, replicas_, "ll_dispatch", DeviceKind::cuda);
      if (in.expert_replicas.defined()) on_device(in.expert_replicas, "ll_dispatch: expert_replicas");
      if (in.topk_weights.defined()) on_device(in.topk_weights, "ll_dispatch: topk_weights");
      if (in.shared_gate.defined()) on_device(in.shared_gate, "ll_dispatch: shared_gate");
      route = {in.topk_idx.data, in.topk_idx.dtype == DType::i64, in.topk_idx.strides[0],
               in.num_tokens.defined() ? in.num_tokens.ptr<const int32_t>() : nullptr, tokens,
               in.topk_weights.defined() ? in.topk_weights.ptr<const float>() : nullptr,
               in.topk_weights.defined() ? in.topk_weights.strides[0] : 0, c.num_experts, {},
               in.topk_weights.defined()};
      if (replicas_.enabled())  // its values are checked by the send half's block 0
        route.replicas = {in.expert_replicas.ptr<const int32_t>(), replica_seen_, replicas_.logical, replicas_.width,
                          replicas_.physical, in.expert_replicas.strides[0]};
      rows = {in.x.ptr<const uint16_t>(), in.x.strides[0], in.nvfp4_global_scale, c.check_finite,
              in.shared_gate.defined() ? in.shared_gate.ptr<const float>() : nullptr, shared_weight_[set]};
    } catch (const Error& e) {
      error = e.what();
    }
    if (!error.empty()) {
      // The peers' receive half stops with this rank's rejection; this rank's receive half still
      // runs, so the set's arrival words are consumed (and reset) like those of any call.
      ll::reject(ctx(ll::kDispatch), ll::kDispatch, set, kStatusHostRejected);
      ll::dispatch(ctx(ll::kDispatch), ll::kRecvPhase, set, {}, {}, sets_[set]);
      own_rejection_ = error;
      throw Error(ErrorCode::invalid_argument, error);
    }
    mark(0);
    if (!fusing_) ll::dispatch(ctx(ll::kDispatch), ll::kSendPhase, set, route, rows, sets_[set]);
    if (!fusing_) launched();
    dispatch_pending_ = true;
    pending_route_ = route;
    pending_rows_ = rows;
    pending_gate_ = in.shared_gate.defined();
  }

  LowLatencyDispatchResult dispatch_recv() override {
    require(dispatch_pending_, "ll dispatch_recv: no dispatch_send before it");
    dispatch_pending_ = false;
    const int set = static_cast<int>((dispatch_calls_ - 1) % 2);
    const ll::Set& s = sets_[set];
    ll::dispatch(ctx(ll::kDispatch), fusing_ ? ll::kSendPhase | ll::kRecvPhase : ll::kRecvPhase, set, pending_route_, pending_rows_, s);
    if (fusing_) launched();
    if (mark(1)) timer_.add(fusing_ ? "ll dispatch (one launch)" : "ll dispatch: send half to end", 0, 1);
    const LowLatencyConfig& c = config();
    LowLatencyDispatchResult out;
    auto view = [&](void* p, DType t, std::initializer_list<int64_t> shape) {
      return Tensor(memory_, TensorView::of(p, t, shape, DeviceKind::cuda, device_));
    };
    // Every output from its segment 0 (the shared expert's, when there is one).
    char* x = segment0(s.recv_x, slots_ * wire_.x_bytes);
    if (wire_.format == WireFormat::bf16) out.recv_x = view(x, DType::bf16, {segments_, slots_, c.hidden});
    else if (wire_.format == WireFormat::nvfp4) out.recv_x = view(x, DType::e2m1x2, {segments_, slots_, c.hidden / 2});
    else out.recv_x = view(x, DType::fp8_e4m3, {segments_, slots_, c.hidden});
    char* scales = s.recv_scales ? segment0(s.recv_scales, slots_ * wire_.scale_bytes) : nullptr;
    if (wire_.format == WireFormat::nvfp4) {
      out.recv_scales = view(scales, DType::fp8_e4m3, {segments_, slots_, c.hidden / kNvfp4Block});
      out.recv_global_scale = view(segment0(s.recv_global, slots_ * 4), DType::f32, {segments_, slots_});
    } else if (wire_.scale_bytes) {
      out.recv_scales = view(scales, DType::f32, {segments_, slots_, c.hidden / kFp8Block});
    }
    out.recv_count = view(segment0(s.recv_count, 1), DType::i32, {segments_});
    out.recv_src = view(segment0(s.recv_src, 2 * slots_), DType::i32, {segments_, slots_, 2});
    out.recv_layout = view(segment0(s.recv_layout, 2 * ranks_), DType::i32, {segments_, ranks_, 2});
    // EPLB: the send half's routing of this set, in physical ids (-1 unused or past num_tokens).
    if (replicas_.enabled()) out.topk_physical = view(s.slot_expert, DType::i32, {pending_route_.tokens, c.topk});
    auto h = std::make_shared<LowLatencyHandleState>();
    h->owner = this;
    h->tokens = pending_route_.tokens;
    h->num_tokens = -1;  // on the device
    h->set = set;
    h->weights_at_dispatch = pending_route_.has_weights;
    h->has_shared_gate = pending_gate_;  // given (a [0] gate of a rank without tokens has no data)
    out.handle = LowLatencyHandle(std::move(h));
    return out;
  }

  // The fused forms: both halves' checks, then one launch for the whole call (docs/low-latency.md).
  LowLatencyDispatchResult dispatch(const LowLatencyDispatchInput& in) override {
    Fusing on(fusing_);
    dispatch_send(in);
    return dispatch_recv();
  }

  Tensor combine(const LowLatencyCombineInput& in, const LowLatencyHandle& handle) override {
    Fusing on(fusing_);
    combine_send(in, handle);
    return combine_recv();
  }

  void combine_send(const LowLatencyCombineInput& in, const LowLatencyHandle& handle) override {
    require(!combine_pending_, "ll combine_send: the previous combine_send has no combine_recv yet");
    begin("ll_combine", combine_calls_);
    const int set = static_cast<int>(combine_calls_++ % 2);
    const LowLatencyConfig& c = config();
    std::string error;
    try {
      take_rejection();
      require(handle.valid(), "ll_combine: the handle is empty; pass the handle ll_dispatch returned");
      require(handle.state().owner == this, "ll_combine: the handle belongs to another buffer or rank");
      check_tensor(in.y, "ll_combine: y",
                   words("[", c.shared_expert ? "1 + L=" : "L=", segments_, ", R*M=", slots_, ", H=", c.hidden, "]"),
                   DType::bf16, {segments_, slots_, c.hidden}, DeviceKind::cuda);
      require(in.y.is_contiguous(), "ll_combine: y must be contiguous");
      require(c.combine_wire == WireFormat::bf16 || reinterpret_cast<uintptr_t>(in.y.data) % 16 == 0,
              "ll_combine: y must be 16-byte aligned with combine_wire ", wire_name(c.combine_wire),
              " (its partials are quantized from 16-byte loads)");
      on_device(in.y, "ll_combine: y");
      check_combine_weights(in, handle.state(), DeviceKind::cuda);
      if (in.topk_weights.defined()) on_device(in.topk_weights, "ll_combine: topk_weights");
    } catch (const Error& e) {
      error = e.what();
    }
    if (!error.empty()) {  // as in dispatch_send: reject, then consume this call's arrival words
      ll::reject(ctx(ll::kCombine), ll::kCombine, set, kStatusHostRejected);
      ll::combine(ctx(ll::kCombine), ll::kRecvPhase, set, 0, sets_[0], nullptr, ll::Sums{nullptr, 0, false, 0, sets_[set].out, false});
      own_rejection_ = error;
      throw Error(ErrorCode::invalid_argument, error);
    }
    const LowLatencyHandleState& h = handle.state();
    mark(2);
    combine_pending_ = true;
    pending_combine_ = {handle.state_ptr(), in.weighted, in.topk_weights, in.y.ptr<const uint16_t>()};
    if (!fusing_) ll::combine(ctx(ll::kCombine), ll::kSendPhase, set, h.set, sets_[h.set], routed_y(), sums(set));
    if (!fusing_) launched();
  }

  Tensor combine_recv() override {
    require(combine_pending_, "ll combine_recv: no combine_send before it");
    combine_pending_ = false;
    const int set = static_cast<int>((combine_calls_ - 1) % 2);
    const LowLatencyHandleState& h = *pending_combine_.handle;
    uint16_t* out = sets_[set].out;
    ll::combine(ctx(ll::kCombine), fusing_ ? ll::kSendPhase | ll::kRecvPhase : ll::kRecvPhase, set, h.set, sets_[h.set],
                routed_y(), sums(set));
    if (fusing_) launched();
    if (mark(3)) timer_.add(fusing_ ? "ll combine (one launch)" : "ll combine: send half to end", 2, 3);
    pending_combine_ = {};
    return Tensor(memory_, TensorView::of(out, DType::bf16, {h.tokens, config().hidden}, DeviceKind::cuda, device_));
  }

 private:
  // The pending combine's weights (both halves: the send half sends them to the expert ranks) and
  // where its sums go.
  ll::Sums sums(int set) const {
    const PendingCombine& p = pending_combine_;
    const bool given = p.weighted && !p.handle->weights_at_dispatch;  // else the dispatch sent them
    const bool shared = config().shared_expert;
    return {given ? p.weights.ptr<const float>() : nullptr, given ? p.weights.strides[0] : 0, p.weighted,
            p.handle->tokens, sets_[set].out, p.handle->weights_at_dispatch, shared ? p.y : nullptr,
            shared ? shared_weight_[p.handle->set] : nullptr};
  }
  // The pending combine's y from its first routed expert (the send half's rows).
  const uint16_t* routed_y() const { return pending_combine_.y + first_routed_ * slots_ * config().hidden; }
  // A routed array's segment 0 (the shared expert's, one segment of `per_segment` elements before).
  template <typename T>
  T* segment0(T* routed, int64_t per_segment) const { return routed - first_routed_ * per_segment; }

  struct PendingCombine {
    std::shared_ptr<const LowLatencyHandleState> handle;
    bool weighted = false;
    TensorView weights;
    const uint16_t* y = nullptr;
  };
  // Set while a fused call runs: its send half defers its launch to the receive half's.
  struct Fusing {
    explicit Fusing(bool& flag) : flag_(flag) { flag_ = true; }
    ~Fusing() { flag_ = false; }
    bool& flag_;
  };

  // One set's arrays from `base` on (null: only count their bytes); the outputs' routed arrays
  // begin one segment in with the shared expert (ll_launch.hpp, Set).
  void carve(ll::Set& s, float*& shared_weight, char* base, int64_t& used) const {
    const LowLatencyConfig& c = config();
    const int64_t m = c.max_tokens_per_rank;
    auto take = [&](int64_t bytes) {
      char* p = base ? base + used : nullptr;
      used += (bytes + 255) / 256 * 256;
      return p;
    };
    s.slot_expert = reinterpret_cast<int32_t*>(take(4 * m * c.topk));
    s.num_tokens = reinterpret_cast<int32_t*>(take(4));
    // An output of `segments_` segments of `segment_bytes` each, from its first routed one.
    auto routed = [&](int64_t segment_bytes) {
      char* p = take(segments_ * segment_bytes);
      return p ? p + first_routed_ * segment_bytes : p;
    };
    s.recv_x = routed(slots_ * wire_.x_bytes);
    s.recv_scales = wire_.scale_bytes ? routed(slots_ * wire_.scale_bytes) : nullptr;
    s.recv_global = wire_.global_bytes ? routed(slots_ * 4) : nullptr;
    s.recv_src = reinterpret_cast<int32_t*>(routed(slots_ * 8));
    s.recv_count = reinterpret_cast<int32_t*>(routed(4));
    s.recv_layout = reinterpret_cast<int32_t*>(routed(ranks_ * 8));
    s.prev_count = reinterpret_cast<int32_t*>(take(2 * 4 * (local_ + first_routed_)));
    s.count_half = reinterpret_cast<int32_t*>(take(4));
    s.row_of = reinterpret_cast<int32_t*>(take(4 * slots_ * c.topk));
    s.out = reinterpret_cast<uint16_t*>(take(2 * m * c.hidden));
    shared_weight = c.shared_expert ? reinterpret_cast<float*>(take(4 * m)) : nullptr;
  }

  // EPX_PROFILE: records mark i, except in a graph capture (no timing there); true if recorded.
  bool mark(int i) {
    if (!timer_.on()) return false;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    EPX_CUDA(cudaStreamIsCapturing(stream_, &capture));
    if (capture != cudaStreamCaptureStatusNone) return false;
    timer_.mark(i, stream_);
    return true;
  }

  // The kernels' view of the current call of `kind` (its number names it in a timeout's words).
  ll::Ctx ctx(ll::Kind kind) const {
    const int64_t call = (kind == ll::kDispatch ? dispatch_calls_ : combine_calls_) - 1;
    const LowLatencyConfig& c = config();
    return ll::Ctx{window_->peers(), map_, c.hidden, c.topk, replicas_.physical, local_, c.max_tokens_per_rank, c.wire,
                   wire_.x_bytes, wire_.scale_bytes, wire_.global_bytes, status_, host_status_, host_started_, done_,
                   static_cast<uint64_t>(timeout_.count()) * 1000000ull, blocks_, stream_, stamps_, call, load_,
                   c.combine_wire, c.shared_expert};
  }

  size_t stamp_bytes() const { return static_cast<size_t>(2 * blocks_ * ll::kStampSteps) * sizeof(uint64_t); }

  // EPX_PROFILE=ll: the last dispatch's and combine's steps, each as min / median / max over the
  // blocks that stamped it, in us from the call's first block start (docs/low-latency.md).
  void print_timeline() const {
    std::vector<uint64_t> stamps(stamp_bytes() / sizeof(uint64_t));
    if (cudaMemcpy(stamps.data(), stamps_, stamp_bytes(), cudaMemcpyDeviceToHost) != cudaSuccess) return;
    // Each kind's step names, and the order a call passes them.
    static const char* const kSteps[2][ll::kStampSteps] = {
        {"start", "own writes", "counted in", "sources in", "received", "end", "routing checked", "routing sent",
         "rows found"},
        {"start", "own writes", "counted in", "sources in", "received", "end", "weights in", "terms looked up", ""}};
    static const int kOrder[ll::kStampSteps] = {ll::kStart,     ll::kFirstChecked, ll::kFirstSent,
                                                ll::kOwnWrites, ll::kCountedIn,    ll::kSourcesIn,
                                                ll::kRowsFound, ll::kReceived,     ll::kEnd};
    for (int kind = 0; kind < 2; ++kind) {
      const uint64_t* k = stamps.data() + static_cast<size_t>(kind) * blocks_ * ll::kStampSteps;
      uint64_t t0 = UINT64_MAX;
      for (int b = 0; b < blocks_; ++b)
        if (k[b * ll::kStampSteps] != 0) t0 = std::min(t0, k[b * ll::kStampSteps]);
      if (t0 == UINT64_MAX) continue;
      std::string line = cat("epx ll timeline rank ", rank_, kind == ll::kDispatch ? " dispatch:" : " combine:");
      for (int step : kOrder) {
        std::vector<double> us;
        for (int b = 0; b < blocks_; ++b)
          if (k[b * ll::kStampSteps + step] >= t0) us.push_back(static_cast<double>(k[b * ll::kStampSteps + step] - t0) / 1000.0);
        if (us.empty()) continue;
        std::sort(us.begin(), us.end());
        char part[96];
        std::snprintf(part, sizeof(part), " %s %.1f/%.1f/%.1f", kSteps[kind][step], us.front(), us[us.size() / 2], us.back());
        line += part;
      }
      std::fprintf(stderr, "%s us (min/median/max over blocks)\n", line.c_str());
    }
  }

  void on_device(const TensorView& t, std::string_view what) const {
    require(t.device_index == device_, what, ": tensor is on cuda:", t.device_index, " but this rank drives cuda:", device_);
  }

  // The call and the wait a timeout report names (ll_launch.hpp: timeout_where), in words.
  static std::string timed_out_call(int64_t where) {
    const int64_t call = where >> ll::kStepBits;
    switch (where & ((int64_t{1} << ll::kStepBits) - 1)) {
      case ll::kDispatchArrivals: return cat("ll_dispatch #", call, " (receive half: the peers' rows)");
      case ll::kCombineArrivals: return cat("ll_combine #", call, " (receive half: the peers' partial sums)");
      case ll::kCombineWeights: return cat("ll_combine #", call, " (receive half: the peers' router weights)");
    }
    return cat("a low-latency call (an unknown wait, code ", where, ")");
  }

  // Raises what an earlier call found on the device (calls never wait for the device).
  void begin(const char* kind, int64_t index) {
    const std::string name = cat(kind, " #", index);
    const auto now = std::chrono::steady_clock::now();
    std::rotate(recent_.begin(), recent_.begin() + 1, recent_.end());
    recent_.back() = {std::chrono::duration<double, std::milli>(now - last_begin_).count(), -1.0};
    last_begin_ = now;
    if (broken_) fail(ErrorCode::peer_failed, name, " (rank ", rank_, "): the low-latency buffer already failed: ", broken_reason_);
    EPX_CUDA(cudaSetDevice(device_));
    if (!own_rejection_.empty()) {
      // This rank refused its previous call's input on the host (and threw then); its peers find
      // the refusal on the device and raise it at their next call, so this call raises it too:
      // every rank skips it alike and the calls stay paired.
      const std::string reason = std::move(own_rejection_);
      own_rejection_.clear();
      fail(ErrorCode::peer_failed, "a low-latency call before ", name, " (rank ", rank_, "): rank ", rank_,
           " rejected its input, so the group stops: ", reason);
    }
    DeviceStatus st;
    std::memcpy(&st, host_status_, sizeof st);
    if (st.code == kStatusOk) return;
    std::memset(host_status_, 0, sizeof(DeviceStatus));
    EPX_CUDA(cudaMemsetAsync(status_, 0, sizeof(DeviceStatus), stream_));
    const std::string who = cat("a low-latency call before ", name, " (rank ", rank_, "): ");
    const std::string when = timing(st.d);
    switch (st.code) {
      case kStatusBadExpert:
        fail(ErrorCode::invalid_argument, who, "topk_idx[", st.a, ", ", st.b, "] = ", st.c,
             " is out of range; expert ids must be in [0, ", config().num_experts, ") or -1");
      case kStatusRepeatedExpert:
        fail(ErrorCode::invalid_argument, who, "token ", st.a, " selects expert ", st.c, " twice");
      case kStatusReplicaOutOfRange:
      case kStatusReplicaRepeated:
      case kStatusReplicaEmptyRow:
        fail(ErrorCode::invalid_argument, who, replica_error("ll_dispatch", st.code, st.a, st.b, st.c, replicas_));
      case kStatusReplicaMismatch:
        fail(ErrorCode::config_mismatch, who, "rank ", st.rank, " passes another expert_replicas table (their hashes "
             "differ); every rank must pass the same replica table at every ll_dispatch");
      case kStatusBadTokenCount:
        fail(ErrorCode::invalid_argument, who, "num_tokens = ", st.a, " must be in [0, T=", st.b, "]");
      case kStatusNonFinite:  // c: the value's fp32 bits
        fail(ErrorCode::invalid_argument, who, "ll_dispatch: x[", st.a, "][", st.b, "] is not finite (",
             nonfinite_name(bits_float(static_cast<uint32_t>(st.c))), ")");
      case kStatusPeerRejected:  // a: the code the peer raised (its own finding: block_arrived passes on no other)
        if (st.a == kStatusTimeout)
          fail(ErrorCode::peer_failed, who, "rank ", st.rank, " gave up waiting for another rank",
               " (its own error says which), so the group stops; ", when);
        fail(ErrorCode::peer_failed, who, "rank ", st.rank, " rejected its input (its own error says why), so the group stops");
      case kStatusTimeout:
        broken_ = true;
        broken_reason_ = cat(timed_out_call(st.a), " (rank ", rank_, ", raised at ", name, "): waited ", timeout_.count(),
                             " ms for rank ", st.rank,
                             ", which never arrived (crashed, hung, or called collective operations in a different order); ",
                             when);
        throw Error(ErrorCode::timeout, broken_reason_);
      default:
        fail(ErrorCode::internal, who, "device reported status ", st.code);
    }
  }

  // For timeout messages, in every rank's words (the ranks' messages side by side show whose kernel
  // started late, and whether its host launched it late): when this rank's kernels began each set
  // and when it began waiting (device global timer, ms; on the shared GPU every rank reads the same
  // timer), and how long after the call before (or the buffer's creation) its host began its last
  // calls and how long each launch took (docs/cuda.md: the shared-GPU hold-back).
  std::string timing(int64_t waited_from_ns) const {
    auto ms = [](uint64_t ns) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.3f", static_cast<double>(ns % 1000000000000ull) / 1e6);
      return std::string(text);
    };
    const uint64_t* t = host_started_;  // [kind][set]
    std::string calls;
    for (const HostCall& h : recent_) {
      char text[64];
      const char* comma = calls.empty() ? "" : ", ";
      if (h.launch_ms < 0) std::snprintf(text, sizeof(text), "%s%.1f (no launch)", comma, h.gap_ms);
      else std::snprintf(text, sizeof(text), "%s%.1f (launched in %.2f)", comma, h.gap_ms, h.launch_ms);
      calls += text;
    }
    return cat("device timer (ms): this rank's ll_dispatch kernels began at ", ms(t[0]), " / ", ms(t[1]),
               " (sets 0 / 1), its ll_combine kernels at ", ms(t[2]), " / ", ms(t[3]), ", it began waiting at ",
               waited_from_ns ? ms(static_cast<uint64_t>(waited_from_ns)) : std::string("(not noted)"),
               "; its host began its last calls ", calls, " ms after the call before or the buffer's creation");
  }

  // The host's side of the last calls, for timing(): launched() notes when a call's kernel is queued.
  struct HostCall {
    double gap_ms = 0.0, launch_ms = -1.0;
  };
  void launched() {
    recent_.back().launch_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - last_begin_).count();
  }

  int device_ = 0, blocks_ = 0;
  const int64_t chunks_;  // the kernels count rows per chunk of ll::kChunk source tokens
  // When this rank's host began its last call (or made the buffer), and its last three calls (timing()).
  std::chrono::steady_clock::time_point last_begin_;
  std::array<HostCall, 3> recent_{};
  ll::Map map_{};
  ll::Set sets_[2]{};
  float* shared_weight_[2]{};  // shared expert: each set's [M] shared-row weights (ll::Rows::shared_weight)
  std::shared_ptr<void> memory_;  // both sets' arrays; results keep it alive
  std::unique_ptr<SymmetricWindow> window_;
  DeviceStatus* status_ = nullptr;
  DeviceStatus* host_status_ = nullptr;
  uint64_t* host_started_ = nullptr;  // ll::Ctx::host_started
  uint32_t* done_ = nullptr;
  int64_t* load_ = nullptr;     // [L] expert_load's counters (ll::Ctx::load)
  int32_t* replica_seen_ = nullptr;  // [P] with EPLB: the table check's scratch
  uint64_t* stamps_ = nullptr;  // EPX_PROFILE=ll (ll::Ctx::stamps)
  cudaStream_t own_stream_ = nullptr;
  cudaEvent_t stream_switch_ = nullptr;  // set_stream's order between the old and the new stream
  std::string own_rejection_;  // this rank's last host-side refusal, raised again by its next call (begin())
  cudaStream_t stream_ = nullptr;  // the calls' stream: own_stream_ or the caller's
  bool dispatch_pending_ = false, combine_pending_ = false;
  bool fusing_ = false;
  ll::Route pending_route_{};
  ll::Rows pending_rows_{};
  bool pending_gate_ = false;  // the pending dispatch was given a shared_gate
  PendingCombine pending_combine_;
  PhaseTimer timer_;
  bool broken_ = false;
  std::string broken_reason_;
};

}  // namespace

std::unique_ptr<LowLatencyBackend> make_cuda_low_latency(const Group& group, const LowLatencyConfig& config) {
  return std::make_unique<CudaLowLatency>(group, config);
}

}  // namespace epx::detail
