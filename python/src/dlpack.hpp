// The DLPack ABI (legacy, unversioned form: the "dltensor" capsule every torch version
// produces and accepts), written from the DLPack specification. Only what epx exchanges.
#pragma once
#include <cstdint>

namespace epx::python::dlpack {

// DLDeviceType values.
enum DeviceType : int32_t {
  kCPU = 1,
  kCUDA = 2,
  kCUDAHost = 3,      // pinned host memory: a host pointer for epx
  kCUDAManaged = 13,  // managed memory: refused (epx needs host or device memory)
};

// DLDataTypeCode values.
enum TypeCode : uint8_t {
  kInt = 0,
  kUInt = 1,
  kFloat = 2,
  kBfloat = 4,
  kBool = 6,
  kFloat8_e4m3fn = 10,  // DLPack 1.1; torch versions that export fp8 at all use it
};

struct Device {
  int32_t device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

// Capsule names: a producer's capsule is "dltensor"; a consumer that takes ownership renames it.
inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";

}  // namespace epx::python::dlpack
