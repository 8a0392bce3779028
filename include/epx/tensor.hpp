// TensorView: a non-owning view of caller memory. Tensor: an owning one, used for outputs.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "epx/dtype.hpp"

namespace epx {

enum class DeviceKind : int32_t { host = 0, cuda = 1 };

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::f32;
  int32_t ndim = 0;                     // 0 means "not given" for optional inputs
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements, not bytes
  DeviceKind device = DeviceKind::host;
  int32_t device_index = 0;

  // A contiguous (row-major) view.
  static TensorView of(void* data, DType dtype, std::initializer_list<int64_t> shape,
                       DeviceKind device = DeviceKind::host, int32_t device_index = 0);

  bool defined() const { return ndim > 0; }
  int64_t size(int dim) const { return shape[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  // "[4096, 7168] bf16 on host", for error messages.
  std::string describe() const;

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Owning tensor: memory released when the last copy goes away.
class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<void> storage, TensorView view) : storage_(std::move(storage)), view_(view) {}

  // Zero-filled host tensor.
  static Tensor zeros_host(DType dtype, std::initializer_list<int64_t> shape);

  const TensorView& view() const { return view_; }
  const std::shared_ptr<void>& storage() const { return storage_; }  // what keeps the memory alive
  bool defined() const { return view_.defined(); }
  int64_t size(int dim) const { return view_.shape[dim]; }
  int64_t numel() const { return view_.numel(); }
  DType dtype() const { return view_.dtype; }
  template <typename T>
  T* data() const { return view_.ptr<T>(); }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

}  // namespace epx
