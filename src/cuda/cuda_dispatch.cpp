// Host side of the CUDA backend: dispatch (its request, the plan, the handle's memory, the
// transfer and its outputs).
#include "cuda/cuda_backend.hpp"

#include <chrono>

#include "core/replicas.hpp"
#include "core/routing.hpp"
#include "core/validate.hpp"
#include "core/validate_ops.hpp"
#include "cuda/copy_cuts.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_handle.hpp"
#include "cuda/dispatch_input.hpp"
#include "cuda/replica_errors.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

namespace {

// Carves typed arrays out of one block: first pass measures, second assigns.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  // `count` Ts; returns where the first `skip` of them end.
  template <typename T>
  T* take(int64_t count, int64_t skip = 0) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) + skip : nullptr;
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
  const int64_t shared = cfg.shared_expert ? 1 : 0;  // the shared segment, before the routed ones
  h.slot_expert = c.take<int32_t>(tokens * k);
  h.slot_weight = c.take<float>(tokens * k);
  h.shared_weight = shared ? c.take<float>(tokens) : nullptr;
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
  // The routed segments' arrays, one entry into the layout's (RecvArrays).
  h.recv.tokens_per_expert = c.take<int64_t>(shared + l_count, shared);
  h.recv.expert_offsets = c.take<int64_t>(shared + l_count + 1, shared);
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

}  // namespace

CudaBackend::DispatchRequest CudaBackend::read_dispatch(const DispatchInput& in, const DispatchOptions& opt) const {
  const BufferConfig& c = config();
  DispatchRequest rq;
  try {
    validate_dispatch_options(opt);
    validate_dispatch_x(in, c, DeviceKind::cuda);
    check_device_tensor(in.x, "dispatch: x");
    rq.tokens = in.x.shape[0];
    validate_routing_tensors(in, c, rq.tokens, DeviceKind::cuda);
    validate_shared_expert(in, c, opt, rq.tokens, DeviceKind::cuda);
    check_device_tensor(in.shared_gate, "dispatch: shared_gate");
    rq.has_shared_gate = in.shared_gate.defined();
    if (rq.has_shared_gate) rq.shared_gate = {in.shared_gate.ptr<const float>(), in.shared_gate.strides[0]};
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
  job.chunk_warps = plan_warps_;
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
  exchanged(last);  // blocking: the host reads the sizes after this event (expert-major before the transfer)
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
  const int64_t shared = config().shared_expert ? 1 : 0;  // the shared segment's entries come first
  if (layout == Layout::expert_major)
    out.expert_offsets = view(dh->recv.expert_offsets - shared, shared + local_experts_ + 1);
  out.tokens_per_expert = view(dh->recv.tokens_per_expert - shared, shared + local_experts_);
  out.rank_offsets = view(dh->recv.rank_offsets, ranks_ + 1);
  out.recv_info = view(dh->recv.info, 4);
  h->device = dh;
  h->recv.shared_expert = shared != 0;
  h->recv.shared_tokens = h->tokens;
  if (config().mode == CapacityMode::capacity) {
    out.num_rows = -1;
    h->recv.num_rows = -1;
    h->recv.capacity = capacity;
    out.handle = Handle(std::move(h));
    return out;
  }
  // Blocking: the sizes, read already (with the plan's check; what the transfer finds is raised
  // by the next call), or, where the plan found an error, the call's sync and the error raised
  // (the transfer's last block published the status).
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
  const int64_t signature = call_signature({static_cast<int64_t>(opt.layout), broadcast_ ? 1 : 0});
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
  const kernels::LayoutJob layout{dh->recv, opt.layout, c.expert_alignment, capacity_mode ? c.capacity_rows : 0, load_,
                                  c.shared_expert ? tokens : -1};
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
  // max_tokens, no larger than the window's staging, so the outputs are allocated at that bound,
  // the transfer is launched, and then the sizes are read (the call's one host read, once the
  // plan kernel is done: the transfer runs on meanwhile) and the outputs cut to num_rows.
  // Blocking, expert-major: the bound would be min(K, L) times larger, so the sizes are read
  // before the outputs are allocated. Either read comes with what the device found up to the
  // plan (a finding makes the call run on and raise at its end); what the transfer finds is
  // raised by the next call.
  int64_t capacity = capacity_mode ? c.capacity_rows : ranks_ * c.max_tokens_per_rank;
  bool sizes_read = false;
  if (!capacity_mode && opt.layout == Layout::expert_major) {
    sizes_read = plan_ok();
    capacity = plan_report_->info[2];
    host_steps_.mark("sizes read");
  }
  kernels::RecvOutputs outputs = allocate_outputs(out, *dh, opt.layout, capacity);
  if (c.shared_expert)
    outputs.shared = {tokens, rq.shared_gate.first, rq.shared_gate.second, dh->shared_weight};
  transfer(rq, *dh, outputs, opt.layout, phase, out.recv_info);
  if (!capacity_mode && opt.layout == Layout::rank_major) {
    sizes_read = plan_ok();
    host_steps_.mark("sizes read");
  }
  auto state = new_handle_state(this, call.index, opt.layout, rank_, ranks_, tokens, c, rq.has_weights);
  state->has_shared_gate = rq.has_shared_gate;
  return finish_dispatch(call, std::move(out), dh, std::move(state), opt.layout, capacity, sizes_read, host_call);
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

}  // namespace epx::detail
