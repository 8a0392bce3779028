// Names and descriptions of the public value types.
#include <cstdlib>
#include <cstring>

#include "core/check.hpp"
#include "core/replicas.hpp"
#include "epx/config.hpp"
#include "epx/dtype.hpp"
#include "epx/ops.hpp"
#include "epx/tensor.hpp"

namespace epx {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::e2m1x2: return "e2m1x2";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::boolean: return "bool";
  }
  return "?";
}

std::string_view wire_name(WireFormat w) {
  switch (w) {
    case WireFormat::bf16: return "bf16";
    case WireFormat::fp8: return "fp8";
    case WireFormat::fp8_ue8m0: return "fp8_ue8m0";
    case WireFormat::nvfp4: return "nvfp4";
  }
  return "?";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::dispatch: return "dispatch";
    case Op::combine: return "combine";
    case Op::dispatch_backward: return "dispatch_backward";
    case Op::combine_backward: return "combine_backward";
    case Op::cached_dispatch: return "cached_dispatch";
  }
  return "an unknown operation";
}

std::string_view layout_name(Layout l) { return l == Layout::expert_major ? "expert_major" : "rank_major"; }

std::string describe(const BufferConfig& c) {
  return detail::cat("hidden=", c.hidden, " max_tokens_per_rank=", c.max_tokens_per_rank,
                     " num_experts=", c.num_experts, " topk=", c.topk, " wire=", wire_name(c.wire),
                     " expert_alignment=", c.expert_alignment,
                     " mode=", c.mode == CapacityMode::blocking ? "blocking" : "capacity",
                     " capacity_rows=", c.capacity_rows, " capacity_factor=", c.capacity_factor,
                     " timeout_ms=", c.timeout_ms, " num_sms=", c.num_sms, " check_finite=", c.check_finite ? 1 : 0,
                     " send_blocks=", c.send_blocks, " shared_expert=", c.shared_expert ? 1 : 0,
                     " combine_wire=", wire_name(c.combine_wire), " num_physical_experts=", c.num_physical_experts,
                     " max_replicas=", detail::resolved_max_replicas(c.num_experts, c.num_physical_experts,
                                                                     c.max_replicas));
}

TensorView TensorView::of(void* data, DType dtype, std::initializer_list<int64_t> shape, DeviceKind device,
                          int32_t device_index) {
  detail::require(shape.size() >= 1 && shape.size() <= kMaxDims, "TensorView::of: 1 to ", kMaxDims,
                  " dimensions supported, got ", shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int32_t>(shape.size());
  v.device = device;
  v.device_index = device_index;
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

int64_t TensorView::numel() const {
  if (ndim == 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  if (ndim == 0) return "(none)";
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] " << dtype_name(dtype) << (device == DeviceKind::host ? " on host" : " on cuda:") ;
  if (device == DeviceKind::cuda) os << device_index;
  return os.str();
}

Tensor Tensor::zeros_host(DType dtype, std::initializer_list<int64_t> shape) {
  TensorView v = TensorView::of(nullptr, dtype, shape);
  const size_t bytes = static_cast<size_t>(v.numel() * dtype_size(dtype));
  std::shared_ptr<void> storage(std::calloc(bytes ? bytes : 1, 1), std::free);
  if (!storage) detail::fail(ErrorCode::internal, "out of host memory allocating ", v.describe());
  v.data = storage.get();
  return Tensor(std::move(storage), v);
}

}  // namespace epx
