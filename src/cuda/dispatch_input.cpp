#include "cuda/dispatch_input.hpp"

#include "epx/codec.hpp"

namespace epx::detail {

kernels::RoutingInput routing_input(const DispatchInput& in) {
  kernels::RoutingInput routing;
  if (in.topk_idx.defined()) {
    routing.topk_idx = in.topk_idx.data;
    routing.idx64 = in.topk_idx.dtype == DType::i64;
    routing.idx_stride = in.topk_idx.strides[0];
    if (in.topk_weights.defined()) {
      routing.topk_weights = in.topk_weights.ptr<const float>();
      routing.weight_stride = in.topk_weights.strides[0];
    }
  } else {
    routing.routing_map = in.routing_map.ptr<const uint8_t>();
    routing.map_stride = in.routing_map.strides[0];
    if (in.probs.defined()) {
      routing.probs = in.probs.ptr<const float>();
      routing.probs_stride = in.probs.strides[0];
    }
  }
  return routing;
}

kernels::SendRows send_rows(const DispatchInput& in, WireFormat wire, float nvfp4_global_scale) {
  kernels::SendRows rows;
  rows.x = static_cast<const char*>(in.x.data);
  rows.x_stride_bytes = in.x.strides[0] * dtype_size(in.x.dtype);
  if (in.x.dtype == DType::fp8_e4m3) {
    rows.x_scales = in.x_scales.ptr<const float>();
    rows.scales_stride = in.x_scales.strides[0];
  }
  rows.wire = wire;
  rows.nvfp4_global_scale = nvfp4_global_scale;
  return rows;
}

kernels::FiniteCheck finite_check(const DispatchInput& in, int64_t hidden) {
  kernels::FiniteCheck f;
  const bool fp8 = in.x.dtype == DType::fp8_e4m3;
  f.part[f.parts++] = {static_cast<const char*>(in.x.data), in.x.strides[0] * dtype_size(in.x.dtype), hidden, fp8 ? 1 : 2, 0};
  if (fp8)
    f.part[f.parts++] = {reinterpret_cast<const char*>(in.x_scales.ptr<const float>()), in.x_scales.strides[0] * 4,
                         hidden / kFp8Block, 4, 1};
  return f;
}

}  // namespace epx::detail
