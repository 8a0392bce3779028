#include "core/wire.hpp"

#include <cstring>

#include "core/check.hpp"
#include "core/reduce.hpp"
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

void validate_combine_wire(WireFormat w, int64_t hidden, const char* what) {
  const auto code = static_cast<int32_t>(w);
  require(code >= 0 && code <= 3, what, ": combine_wire: unknown wire format code ", code,
          "; use 0 bf16, 1 fp8 or 2 fp8_ue8m0");
  require(w != WireFormat::nvfp4, what,
          ": combine_wire nvfp4 is not supported (its 16-channel e4m3 scales and 4-bit codes are too coarse for the "
          "partial sums); use bf16, fp8 or fp8_ue8m0");
  if (w != WireFormat::bf16)
    require(hidden % kFp8Block == 0, what, ": combine_wire ", wire_name(w), " needs hidden to be a multiple of ",
            kFp8Block, " (one scale per 128 channels), got hidden=", hidden, "; use combine_wire bf16 for this shape");
}

void encode_partial(const WireRow& w, const uint16_t* partial, uint8_t* dst) {
  if (w.format == WireFormat::bf16) {
    std::memcpy(dst, partial, w.x_bytes);
    return;
  }
  // The scales follow H codes, H % 128 == 0: float-aligned in any 4-aligned payload.
  quantize_fp8_row(partial, w.hidden, w.format == WireFormat::fp8_ue8m0, dst, reinterpret_cast<float*>(dst + w.x_bytes));
}

void add_partial(const WireRow& w, const uint8_t* payload, float* acc) {
  if (w.format == WireFormat::bf16) {
    add_row(acc, reinterpret_cast<const uint16_t*>(payload), w.hidden);
    return;
  }
  const auto* scales = reinterpret_cast<const float*>(payload + w.x_bytes);
  for (int64_t h = 0; h < w.hidden; ++h) {
    const float value = e4m3_to_float(payload[h]) * scales[h / kFp8Block];  // rounded here, once
    acc[h] = acc[h] + value;
  }
}

}  // namespace epx::detail
