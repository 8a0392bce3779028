// Tensors across the Python boundary, as DLPack capsules: inputs are read in place (the caller
// keeps them alive for the call), outputs are exported without a copy and own their epx memory.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>

#include "epx/tensor.hpp"

namespace epx::python {

namespace py = pybind11;

// A refusal by the binding's own checks, before epx sees the call. The call sites turn it into
// a collective rejection (Buffer::reject), so the peers' same call fails too.
class BindingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An input: None (not given), or a tuple (capsule, dtype): a "dltensor" capsule, which is read but
// not consumed, and the epx DType the Python layer chose for it (fp8 codes travel as uint8, because
// not every torch version exports float8). Throws BindingError naming `what`.
TensorView input_view(py::handle arg, const char* what);

// An output as a "dltensor" capsule; None when `t` is not defined. The capsule holds `keep` (the
// call's release guard, cuda_support.hpp) when given, else the tensor's own storage.
py::object export_tensor(const Tensor& t, const std::shared_ptr<void>& keep = nullptr);

}  // namespace epx::python
