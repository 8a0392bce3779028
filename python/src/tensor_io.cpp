#include "tensor_io.hpp"

#include <string>

#include "dlpack.hpp"

namespace epx::python {

namespace {

// Whether a DLPack element type can carry an epx dtype (same width; the code may be a plain
// integer where torch has no such type: fp8 and NVFP4 codes as uint8, bool as uint8).
bool carries(const dlpack::DataType& t, DType want) {
  if (t.lanes != 1 || t.bits != 8 * dtype_size(want)) return false;
  switch (want) {
    case DType::bf16: return t.code == dlpack::kBfloat;
    case DType::f32: return t.code == dlpack::kFloat;
    case DType::i32:
    case DType::i64: return t.code == dlpack::kInt;
    case DType::fp8_e4m3: return t.code == dlpack::kUInt || t.code == dlpack::kFloat8_e4m3fn;
    case DType::e2m1x2: return t.code == dlpack::kUInt;
    case DType::boolean: return t.code == dlpack::kBool || t.code == dlpack::kUInt;
  }
  return false;
}

// What a consumer sees for an epx dtype: fp8 and NVFP4 codes as uint8 (the Python layer views
// them as torch.float8_e4m3fn where that exists).
dlpack::DataType exported_type(DType t) {
  const auto bits = static_cast<uint8_t>(8 * dtype_size(t));
  switch (t) {
    case DType::bf16: return {dlpack::kBfloat, bits, 1};
    case DType::f32: return {dlpack::kFloat, bits, 1};
    case DType::i32:
    case DType::i64: return {dlpack::kInt, bits, 1};
    case DType::boolean: return {dlpack::kBool, bits, 1};
    case DType::fp8_e4m3:
    case DType::e2m1x2: return {dlpack::kUInt, bits, 1};
  }
  return {dlpack::kUInt, bits, 1};
}

// An exported tensor: the DLPack struct, its shape and strides, and what keeps its memory alive.
struct Exported {
  dlpack::ManagedTensor managed{};
  int64_t shape[TensorView::kMaxDims]{};
  int64_t strides[TensorView::kMaxDims]{};
  std::shared_ptr<void> keep;
};

void delete_exported(dlpack::ManagedTensor* m) { delete static_cast<Exported*>(m->manager_ctx); }

// A capsule nobody consumed still owns its tensor.
void destroy_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) return;  // consumed: the consumer owns it
  auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
  if (m && m->deleter) m->deleter(m);
}

}  // namespace

TensorView input_view(py::handle arg, const char* what) {
  if (arg.is_none()) return {};
  auto fail = [what](const std::string& why) { throw BindingError(std::string(what) + ": " + why); };
  if (!py::isinstance<py::tuple>(arg) || py::len(arg) != 2) fail("internal: expected (capsule, dtype)");
  py::tuple pair = py::reinterpret_borrow<py::tuple>(arg);
  PyObject* capsule = pair[0].ptr();
  const int code = pair[1].cast<int>();
  if (code < 0 || code > static_cast<int>(DType::boolean)) fail("internal: unknown dtype code " + std::to_string(code));
  const auto dtype = static_cast<DType>(code);
  if (!PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) fail("expected an unconsumed DLPack capsule");
  const auto* m = static_cast<const dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
  const dlpack::Tensor& t = m->dl_tensor;
  if (t.ndim < 1 || t.ndim > TensorView::kMaxDims)
    fail("must have 1 to " + std::to_string(TensorView::kMaxDims) + " dimensions, got " + std::to_string(t.ndim));
  if (!carries(t.dtype, dtype)) fail("its element type does not match " + std::string(dtype_name(dtype)));
  TensorView v;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.dtype = dtype;
  v.ndim = t.ndim;
  int64_t step = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    v.shape[d] = t.shape[d];
    v.strides[d] = t.strides ? t.strides[d] : step;
    step *= t.shape[d];
  }
  switch (t.device.device_type) {
    case dlpack::kCPU:
    case dlpack::kCUDAHost: v.device = DeviceKind::host; break;
    case dlpack::kCUDA:
      v.device = DeviceKind::cuda;
      v.device_index = t.device.device_id;
      break;
    default: fail("must be on the CPU or a CUDA device (DLPack device type " + std::to_string(t.device.device_type) + ")");
  }
  return v;
}

py::object export_tensor(const Tensor& t, const std::shared_ptr<void>& keep) {
  if (!t.defined()) return py::none();
  const TensorView& v = t.view();
  auto* e = new Exported;
  e->keep = keep ? keep : t.storage();
  for (int d = 0; d < v.ndim; ++d) {
    e->shape[d] = v.shape[d];
    e->strides[d] = v.strides[d];
  }
  dlpack::Tensor& dl = e->managed.dl_tensor;
  dl.data = v.data;
  dl.device = v.device == DeviceKind::cuda ? dlpack::Device{dlpack::kCUDA, v.device_index} : dlpack::Device{dlpack::kCPU, 0};
  dl.ndim = v.ndim;
  dl.dtype = exported_type(v.dtype);
  dl.shape = e->shape;
  dl.strides = e->strides;
  dl.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = delete_exported;
  PyObject* capsule = PyCapsule_New(&e->managed, dlpack::kCapsuleName, destroy_capsule);
  if (!capsule) {
    delete e;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace epx::python
