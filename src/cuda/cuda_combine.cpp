// Host side of the CUDA backend: combine and the backward passes on a dispatch's handle.
#include "cuda/cuda_backend.hpp"

#include <cstddef>

#include "core/validate.hpp"
#include "core/validate_ops.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_handle.hpp"

namespace epx::detail {

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
  // The output before the plan exchange, so that nothing is enqueued between the exchange kernel
  // and the combine kernel, which may then start as the exchange ends (launch_after_prior). Sized
  // by this buffer's handles only: another's is refused by the exchange's check, so it gets none.
  const bool ours = handle.valid() && handle.state().owner == this;
  out.out = device_tensor(DType::bf16, {ours ? handle.state().tokens : 0, c.hidden});
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
  // The reducers' arguments and the copy-engine return.
  kernels::CombineArgs a{in.y.ptr<const uint16_t>(), in.y.strides[0], opt.weighted, nullptr, 0,
                         in.shared_out.defined() ? in.shared_out.ptr<const uint16_t>() : nullptr,
                         in.shared_out.defined() ? in.shared_out.strides[0] : 0, out.out.data<uint16_t>(), nullptr};
  const bool plan_failed = waits && !plan_ok();
  if (h->recv.shared_expert)  // the shared expert's term: row t of this rank's y, weighted by its gate
    a.shared = {a.y, a.y_stride, opt.weighted ? dh.shared_weight : nullptr};
  const bool by_copy = copy_return && !plan_failed && start_copy_return(*h, in.y, TensorView{}, a, staging);
  timer_.mark(2, stream_);
  a.host_status = host_status_;  // the kernel's last block ends the call
  a.wire = c.combine_wire;
  a.own_in_place = !by_copy && c.combine_wire == WireFormat::bf16 && h->layout == Layout::rank_major;
  kernels::combine(ctx(), return_blocks(by_copy, a.own_in_place, h->layout), dh.recv, h->layout, h->tokens,
                   dh.pos.send_pos, dh.slot_expert, a);
  timer_.mark(3, stream_);
  if (by_copy && copies_in_flight_) timer_.add("combine: copies", 4, 5);
  join_copy_return();  // y is read until then
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
  const kernels::ReturnRows r{static_cast<const char*>(from.data), from.strides[0] * 2,
                              from_slots.defined() ? static_cast<const char*>(from_slots.data) : nullptr,
                              from_slots.defined() ? from_slots.strides[0] * 4 : 0};
  const auto pieces = kernels::return_pieces(ctx(), r, h.recv.rank_offsets,
                                             reinterpret_cast<const char*>(call_state_) + offsetof(CallState, call));
  // No other rank holds rows of this one (one rank): no copies, so no fork and join of the copy
  // stream either (four host calls, on the path of a short call's latency).
  copies_in_flight_ = !pieces.empty();
  if (copies_in_flight_) {
    EPX_CUDA(cudaEventRecord(fork_, stream_));
    EPX_CUDA(cudaStreamWaitEvent(copy_stream_, fork_, 0));
    timer_.mark(4, copy_stream_);
    kernels::copy_pieces(pieces, copy_stream_);
    timer_.mark(5, copy_stream_);
    EPX_CUDA(cudaEventRecord(copies_done_, copy_stream_));
  }
  if (h.layout == Layout::expert_major) {  // this rank's own partials, while the copies run
    kernels::reduce_partials(ctx(), device_of(h).recv, a, {partials.rows, partials.slots, own, own_rows, own_rows, 0});
    timer_.mark(10, stream_);
    a.y = from.ptr<const uint16_t>();  // the reducers read own rows (own_rows + pos * y_stride) from the partials
    a.y_stride = from.strides[0];
    a.slot_values_stride = from_slots.defined() ? from_slots.strides[0] : 0;
  }
  return true;
}

void CudaBackend::join_copy_return() {
  if (copies_in_flight_) EPX_CUDA(cudaStreamWaitEvent(stream_, copies_done_, 0));
  copies_in_flight_ = false;
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
  if (h->recv.shared_expert) {  // grad_x adds the shared row; its weight's gradient is grad_recv_weights' row t
    a.shared = {a.y, a.y_stride, nullptr};
    if (with_weights) {
      out.grad_shared_gate = device_tensor(DType::f32, {h->tokens});
      a.gate_grads = gw.ptr<const float>();
      a.gate_grads_stride = gw.strides[0];
      a.shared_gate_out = out.grad_shared_gate.data<float>();
    }
  }
  const bool plan_failed = copies_wait_for_plan() && !plan_ok();  // as combine's
  const bool by_copy = !plan_failed && start_copy_return(*h, in.grad_recv_x, gw, a, staging);
  a.host_status = host_status_;  // the kernel's last block ends the call
  a.own_in_place = !by_copy && h->layout == Layout::rank_major;
  kernels::combine(ctx(), return_blocks(by_copy, a.own_in_place, h->layout), dh.recv, h->layout, h->tokens,
                   dh.pos.send_pos, dh.slot_expert, a);
  join_copy_return();  // the inputs are read until then
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
  kernels::Expansion e{h->layout, opt.weighted, opt.weighted ? in.y.ptr<const uint16_t>() : nullptr,
                       opt.weighted ? in.y.strides[0] : 0, out.grad_y.data<uint16_t>(),
                       opt.weighted ? out.grad_topk_weights.data<float>() : nullptr, host_status_};
  if (h->recv.shared_expert) {  // the shared rows of grad_y from grad_out; the gate's gradient, a dot with y
    e.shared = {h->tokens, nullptr, 0, dh.shared_weight};
    if (opt.weighted && h->has_shared_gate) {
      out.grad_shared_gate = device_tensor(DType::f32, {h->tokens});
      e.shared_gate_out = out.grad_shared_gate.data<float>();
    }
  }
  kernels::expand_transfer(ctx(), expand_senders(h->layout), rows, h->tokens, dh.pos.send_pos, dh.slot_expert,
                           dh.recv, e);
  end_call(call, c.mode == CapacityMode::blocking && !plan_ok(), true);  // as combine's
  return out;
}

}  // namespace epx::detail
