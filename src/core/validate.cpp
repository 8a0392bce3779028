#include "core/validate.hpp"

#include <string>

#include "core/check.hpp"

namespace epx::detail {

namespace {
// t.describe(), written only when a message is.
struct Described {
  const TensorView& t;
  friend std::ostream& operator<<(std::ostream& os, const Described& d) { return os << d.t.describe(); }
};

void check_layout(const TensorView& t, std::string_view what, const Lazy& spec,
                  std::initializer_list<int64_t> shape, DeviceKind device) {
  require(t.data != nullptr || t.numel() == 0, what, ": data pointer is null for ", Described{t});
  require(t.device == device, what, ": expected a ", device == DeviceKind::host ? "host" : "cuda",
          " tensor for this backend, got ", Described{t});
  bool shape_ok = t.ndim == static_cast<int32_t>(shape.size());
  int d = 0;
  for (int64_t want : shape) {
    if (shape_ok && want != kAnyDim && t.shape[d] != want) shape_ok = false;
    ++d;
  }
  require(shape_ok, what, ": expected shape ", spec, ", got ", Described{t});
  require(t.ndim < 1 || t.shape[t.ndim - 1] <= 1 || t.strides[t.ndim - 1] == 1, what,
          ": the last dimension must be contiguous (stride 1), got stride ", t.strides[t.ndim - 1]);
  if (t.ndim == 2) require(t.shape[0] <= 1 || t.strides[0] >= t.shape[1], what,
                           ": rows overlap (row stride ", t.strides[0], " < row length ", t.shape[1], ")");
}
}  // namespace

void check_tensor(const TensorView& t, std::string_view what, const Lazy& spec, DType dtype,
                  std::initializer_list<int64_t> shape, DeviceKind device) {
  require(t.defined(), what, ": missing; expected ", spec, " ", dtype_name(dtype));
  require(t.dtype == dtype, what, ": expected dtype ", dtype_name(dtype), ", got ", Described{t});
  check_layout(t, what, spec, shape, device);
}

void check_tensor2(const TensorView& t, std::string_view what, const Lazy& spec, DType a, DType b,
                   std::initializer_list<int64_t> shape, DeviceKind device) {
  require(t.defined(), what, ": missing; expected ", spec, " ", dtype_name(a), " or ", dtype_name(b));
  require(t.dtype == a || t.dtype == b, what, ": expected dtype ", dtype_name(a), " or ", dtype_name(b), ", got ",
          Described{t});
  check_layout(t, what, spec, shape, device);
}

}  // namespace epx::detail
