// Host-side checks of tensors handed to an operation.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string_view>

#include "core/check.hpp"
#include "epx/dtype.hpp"
#include "epx/tensor.hpp"

namespace epx::detail {

constexpr int64_t kAnyDim = -1;

// Throws invalid_argument unless t is defined, on `device`, of dtype `dtype`, with the
// given shape (kAnyDim matches any extent) and a contiguous last dimension.
// `what` names the operation and argument ("dispatch: x"), `spec` the expected shape in words
// (written only into a failure's message: pass words(...), not cat(...), on a call's path).
void check_tensor(const TensorView& t, std::string_view what, const Lazy& spec, DType dtype,
                  std::initializer_list<int64_t> shape, DeviceKind device);

// Same, for an argument whose dtype may be one of two.
void check_tensor2(const TensorView& t, std::string_view what, const Lazy& spec, DType a, DType b,
                   std::initializer_list<int64_t> shape, DeviceKind device);

// Element (row, col) of a 2-D view, with strides.
template <typename T>
const T& at(const TensorView& t, int64_t row, int64_t col) {
  return static_cast<const T*>(t.data)[row * t.strides[0] + col * t.strides[1]];
}
template <typename T>
const T* row_ptr(const TensorView& t, int64_t row) {
  return static_cast<const T*>(t.data) + row * t.strides[0];
}

}  // namespace epx::detail
