// Buffer configuration: fixed per buffer, identical on every rank of the group.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace epx {

// What a token row looks like on the wire (and in recv_x).
enum class WireFormat : int32_t {
  bf16 = 0,       // the bf16 row as given
  fp8 = 1,        // e4m3 + one fp32 scale per 128 channels (scale = amax / 448)
  fp8_ue8m0 = 2,  // as fp8, scales rounded up to powers of two
  nvfp4 = 3,      // e2m1 + one e4m3 scale per 16 channels + fp32 global scale
};

// Output layout of dispatch (and input layout of combine).
enum class Layout : int32_t {
  expert_major = 0,  // rows grouped by local expert, padded to expert_alignment (grouped GEMM input)
  rank_major = 1,    // each token once per destination rank (DeepEP-compatible)
};

enum class CapacityMode : int32_t {
  blocking = 0,  // outputs sized exactly; the host learns the row count
  capacity = 1,  // outputs sized to `capacity_rows`; overflow reported, never written out of bounds
};

struct BufferConfig {
  int64_t hidden = 0;               // H
  int64_t max_tokens_per_rank = 0;  // largest T any rank passes to dispatch
  int64_t num_experts = 0;          // E, a multiple of the group size
  int64_t topk = 0;                 // K
  WireFormat wire = WireFormat::bf16;
  int64_t expert_alignment = 1;     // expert-major segments padded to a multiple of this
  CapacityMode mode = CapacityMode::blocking;
  int64_t capacity_rows = 0;        // receive rows per rank in capacity mode
  double capacity_factor = 0.0;     // > 0: drop (token, expert) pairs beyond ceil(cf * sum_r T_r * K / E) per expert
  int64_t timeout_ms = 0;           // wait on a peer at most this long; 0 = EPX_TIMEOUT_MS or 60000
  int64_t num_sms = 0;              // CUDA: thread blocks (one per SM) of the data-moving kernels; 0 = 24
  // Dispatch refuses x holding a NaN or an infinity (pre-quantized: a NaN code, or a NaN or
  // infinite x_scales): the call fails on every rank, naming one such value (the CPU backend: the
  // first in row-major order), and the buffer stays usable. The CUDA backend scans x on the device
  // beside the routing check, so no host sync; off, nothing scans. docs/semantics.md.
  bool check_finite = false;
  // CUDA: of the num_sms blocks, those that send in an SM-engine dispatch and return rows in an
  // SM-engine combine (the rest receive or reduce); 0 = the split measured best (half, and at
  // expert-major a third in dispatch, two thirds in combine; docs/cuda.md). At most num_sms - 1.
  int64_t send_blocks = 0;
  // Fused shared expert (expert-major only): dispatch also places this rank's own tokens as
  // segment 0 of its output, so one grouped GEMM covers the shared and the routed experts, and
  // combine adds those rows' outputs back after the routed partials. docs/semantics.md.
  bool shared_expert = false;
  // What crosses back in combine: each (token, rank) partial as bf16 (default), or that bf16
  // row quantized as the fp8 dispatch wire quantizes x (fp8, fp8_ue8m0; needs hidden % 128 == 0),
  // dequantized and summed in fp32 at the source. nvfp4 is refused. dispatch_backward stays bf16.
  // Both backends, both modes (the CUDA high-throughput buffer returns it with its SM engine
  // only). docs/semantics.md, "Combine wire".
  WireFormat combine_wire = WireFormat::bf16;
  // Redundant experts (EPLB): > 0 gives the group this many physical experts P (P >= num_experts,
  // a multiple of the group size); rank r holds physical experts [r*P/R, (r+1)*P/R), and each
  // dispatch takes DispatchInput::expert_replicas, the physical experts serving each logical
  // expert. The local experts of the output are then physical ones. 0: off (physical = logical).
  // docs/semantics.md, "Redundant experts (EPLB)".
  int64_t num_physical_experts = 0;
  // M, the columns of expert_replicas (the most replicas of one logical expert); 0 = P - E + 1.
  // Only with num_physical_experts > 0.
  int64_t max_replicas = 0;
};

std::string_view wire_name(WireFormat w);
std::string_view layout_name(Layout l);
// One line with every field, used to compare configs across ranks and in messages.
std::string describe(const BufferConfig& c);

}  // namespace epx
