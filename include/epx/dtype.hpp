// Element types that cross the epx API.
#pragma once
#include <cstdint>
#include <string_view>

namespace epx {

enum class DType : int32_t {
  bf16 = 0,      // bfloat16, stored as uint16_t bit patterns
  f32 = 1,       // IEEE float
  fp8_e4m3 = 2,  // OCP FP8 E4M3 ("fn": no infinities, max 448)
  e2m1x2 = 3,    // NVFP4 values, two E2M1 codes per byte (low nibble = even channel)
  i32 = 4,
  i64 = 5,
  boolean = 6,   // one byte per element, 0 or 1
};

// Bytes per stored element (e2m1x2: one byte holds two values).
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::bf16: return 2;
    case DType::f32: return 4;
    case DType::fp8_e4m3: return 1;
    case DType::e2m1x2: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::boolean: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t);

}  // namespace epx
