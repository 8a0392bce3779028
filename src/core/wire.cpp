#include "core/wire.hpp"

#include <cstring>

#include "core/validate.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

WireRow wire_row(WireFormat format, int64_t hidden) {
  WireRow w{format, hidden, 0, 0, 0};
  switch (format) {
    case WireFormat::bf16: w.x_bytes = 2 * hidden; break;
    case WireFormat::fp8:
    case WireFormat::fp8_ue8m0:
      w.x_bytes = hidden;
      w.scale_bytes = 4 * (hidden / kFp8Block);
      break;
    case WireFormat::nvfp4:
      w.x_bytes = hidden / 2;
      w.scale_bytes = hidden / kNvfp4Block;
      w.global_bytes = 4;
      break;
  }
  return w;
}

void encode_row(const DispatchInput& in, int64_t t, const WireRow& w, float nvfp4_global_scale, uint8_t* dst) {
  uint8_t* scales = dst + w.x_bytes;
  if (in.x.dtype == DType::fp8_e4m3) {  // pre-quantized: codes and scales travel as given
    std::memcpy(dst, row_ptr<uint8_t>(in.x, t), w.x_bytes);
    std::memcpy(scales, row_ptr<float>(in.x_scales, t), w.scale_bytes);
    return;
  }
  const uint16_t* x = row_ptr<uint16_t>(in.x, t);
  switch (w.format) {
    case WireFormat::bf16: std::memcpy(dst, x, w.x_bytes); break;
    case WireFormat::fp8:
    case WireFormat::fp8_ue8m0:
      // H % 128 == 0 and payload rows are multiples of 4 bytes, so the scales are float-aligned.
      quantize_fp8_row(x, w.hidden, w.format == WireFormat::fp8_ue8m0, dst, reinterpret_cast<float*>(scales));
      break;
    case WireFormat::nvfp4: {
      const float inv_global = quantize_nvfp4_row(x, w.hidden, nvfp4_global_scale, dst, scales);
      std::memcpy(scales + w.scale_bytes, &inv_global, 4);
      break;
    }
  }
}

void allocate_recv(DispatchResult& out, const WireRow& w, int64_t rows) {
  switch (w.format) {
    case WireFormat::bf16: out.recv_x = Tensor::zeros_host(DType::bf16, {rows, w.hidden}); break;
    case WireFormat::fp8:
    case WireFormat::fp8_ue8m0:
      out.recv_x = Tensor::zeros_host(DType::fp8_e4m3, {rows, w.hidden});
      out.recv_scales = Tensor::zeros_host(DType::f32, {rows, w.hidden / kFp8Block});
      break;
    case WireFormat::nvfp4:
      out.recv_x = Tensor::zeros_host(DType::e2m1x2, {rows, w.hidden / 2});
      out.recv_scales = Tensor::zeros_host(DType::fp8_e4m3, {rows, w.hidden / kNvfp4Block});
      out.recv_global_scale = Tensor::zeros_host(DType::f32, {rows});
      break;
  }
}

void store_row(DispatchResult& out, const WireRow& w, int64_t row, const uint8_t* payload) {
  std::memcpy(out.recv_x.data<uint8_t>() + row * w.x_bytes, payload, w.x_bytes);
  if (w.scale_bytes) std::memcpy(out.recv_scales.data<uint8_t>() + row * w.scale_bytes, payload + w.x_bytes, w.scale_bytes);
  if (w.global_bytes)
    std::memcpy(out.recv_global_scale.data<uint8_t>() + row * w.global_bytes, payload + w.x_bytes + w.scale_bytes,
                w.global_bytes);
}

}  // namespace epx::detail
