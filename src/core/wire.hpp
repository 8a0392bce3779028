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

}  // namespace epx::detail
