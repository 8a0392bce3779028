// Cached dispatch on the CUDA backend: a dispatch's rows once more, in its handle's layout.
// No routing, positions or layout plan: the handle calls' header-only plan exchange (every rank
// agrees on the call and the handle's dispatch), then combine_backward's transfer kernel
// (unweighted): each token's row once to each rank at its dispatch stream position, copied there
// into each of its output rows, the empty ones zeroed. A quantized
// wire's rows travel encoded at the start of 2H-byte rows and are split into recv_x /
// recv_scales / recv_global_scale at the receiver. The bits are the dispatch's: the same
// encoder, the same placement.
#include "core/validate_ops.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/device_handle.hpp"
#include "cuda/dispatch_input.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

DispatchResult CudaBackend::cached_dispatch(const DispatchInput& in, const Handle& handle,
                                            const CachedDispatchOptions& opt) {
  const Call call = begin_call(kCachedDispatch);
  const BufferConfig& c = config();
  kernels::SendRows rows;
  const HandleState* h = &start_handle_call(call, handle, 0, [&](const HandleState& state) {
    validate_cached_dispatch(in, state, c, opt, DeviceKind::cuda);
    check_device_tensor(in.x, "cached_dispatch: x");
    rows = send_rows(in, c.wire, opt.nvfp4_global_scale);
    // Before the plan exchange, whose header carries what the scan finds to every peer.
    if (c.check_finite) kernels::scan_x_finite(ctx(), finite_check(in, c.hidden), state.tokens);
  });
  const kernels::Ctx x = ctx();
  const DeviceHandle& dh = device_of(*h);
  const int senders = expand_senders(h->layout);
  const int64_t row_bytes = 2 * c.hidden, capacity = h->recv.capacity;
  const bool as_given = wire_.format == WireFormat::bf16;  // bf16 rows travel as they are
  Tensor encoded, expanded;  // a quantized wire's staging rows, 2H bytes each (freed stream-ordered)
  kernels::SendRows forward = rows;
  if (!as_given) {
    encoded = device_tensor(DType::bf16, {h->tokens, c.hidden});
    kernels::encode_to_rows(x, rows, h->tokens, encoded.data<char>(), row_bytes);
    forward = kernels::SendRows{};
    forward.x = encoded.data<char>();
    forward.x_stride_bytes = row_bytes;
  }
  DispatchResult out;
  OutputBlock outputs(*this, stream_);
  add_row_outputs(outputs, out, capacity);
  outputs.allocate();
  if (!as_given) expanded = device_tensor(DType::bf16, {capacity, c.hidden});
  // bf16 rows end the call here (the kernel's last block publishes the status); encoded ones are
  // split after it.
  kernels::Expansion e{h->layout, false, nullptr, 0,
                       as_given ? out.recv_x.data<uint16_t>() : expanded.data<uint16_t>(), nullptr,
                       as_given ? host_status_ : nullptr};
  if (h->recv.shared_expert) e.shared.tokens = h->tokens;  // the shared rows: this rank's own, in place
  kernels::expand_transfer(x, senders, forward, h->tokens, dh.pos.send_pos, dh.slot_expert, dh.recv, e);
  if (!as_given) {
    auto ptr = [](const Tensor& t) { return t.defined() ? t.data<char>() : nullptr; };
    kernels::split_wire_rows(x, expanded.data<char>(), row_bytes, capacity,
                             {ptr(out.recv_x), ptr(out.recv_scales), ptr(out.recv_global_scale), wire_.x_bytes,
                              wire_.scale_bytes, wire_.global_bytes});
  }
  out.num_rows = h->recv.num_rows;
  out.overflow = h->recv.num_rows > capacity;
  out.handle = handle;
  end_call(call, c.mode == CapacityMode::blocking && !plan_ok(), as_given);  // as combine's: the transfer is queued
  return out;
}

}  // namespace epx::detail
