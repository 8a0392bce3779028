// What one token row looks like on the wire: payload = [x bytes][scale bytes][global scale].
#pragma once
#include <cstdint>

#include "epx/config.hpp"
#include "epx/ops.hpp"

namespace epx::detail {

struct WireRow {
  WireFormat format = WireFormat::bf16;
  int64_t hidden = 0;
  int64_t x_bytes = 0;       // bf16: 2H, fp8: H, nvfp4: H/2
  int64_t scale_bytes = 0;   // fp8: 4 * H/128, nvfp4: H/16
  int64_t global_bytes = 0;  // nvfp4: 4
  int64_t bytes() const { return x_bytes + scale_bytes + global_bytes; }
};

WireRow wire_row(WireFormat format, int64_t hidden);

// Writes token t of the dispatch input into `dst` in wire format (quantizing bf16 on send).
void encode_row(const DispatchInput& in, int64_t t, const WireRow& w, float nvfp4_global_scale, uint8_t* dst);

// Output tensors of dispatch for `rows` rows of this wire format (zero-filled).
void allocate_recv(DispatchResult& out, const WireRow& w, int64_t rows);

// Copies a wire payload into row `row` of recv_x / recv_scales / recv_global_scale.
void store_row(DispatchResult& out, const WireRow& w, int64_t row, const uint8_t* payload);

// ---- the combine wire (BufferConfig::combine_wire, docs/semantics.md "Combine wire") ----
// What one (token, rank) partial looks like on its way back: the partial already rounded to a
// bf16 row, as the bf16 combine sends it, and then (fp8, fp8_ue8m0) quantized by the dispatch
// wire's own quantizer. wire_row(format, hidden) gives its bytes: never more than 2H.

// Refuses a combine wire the library does not have: an unknown code, nvfp4, or fp8 with
// hidden % 128 != 0. `what` names the buffer kind in the message ("buffer").
void validate_combine_wire(WireFormat w, int64_t hidden, const char* what);

// Writes the bf16 partial row in the combine wire's form to dst (wire_row(w.format).bytes()).
void encode_partial(const WireRow& w, const uint16_t* partial, uint8_t* dst);

// acc[h] = acc[h] + value[h], value the payload's: bf16 -> float, fp8 -> e4m3_to_float(q) * scale
// (an fp32 product, then an fp32 add: no fma, so every backend can repeat it bit for bit).
void add_partial(const WireRow& w, const uint8_t* payload, float* acc);

}  // namespace epx::detail
