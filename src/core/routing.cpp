#include "core/routing.hpp"

#include <algorithm>
#include <cmath>

#include "core/check.hpp"
#include "core/replicas.hpp"
#include "core/validate.hpp"
#include "core/validate_ops.hpp"
#include "core/wire.hpp"
#include "epx/codec.hpp"

namespace epx::detail {

void validate_config(const BufferConfig& c, int ranks) {
  const std::string cfg = describe(c);
  require(ranks >= 1, "buffer: the group has no ranks");
  const auto wire = static_cast<int32_t>(c.wire), mode = static_cast<int32_t>(c.mode);
  require(wire >= 0 && wire <= 3, "buffer: wire: unknown wire format code ", wire,
          "; use 0 bf16, 1 fp8, 2 fp8_ue8m0 or 3 nvfp4");
  require(mode == 0 || mode == 1, "buffer: mode: unknown capacity mode code ", mode, "; use 0 blocking or 1 capacity");
  require(c.hidden > 0, "buffer: hidden must be > 0 (", cfg, ")");
  require(c.max_tokens_per_rank >= 0, "buffer: max_tokens_per_rank must be >= 0 (", cfg, ")");
  require(c.max_tokens_per_rank <= (int64_t{1} << 30), "buffer: max_tokens_per_rank must be <= 2^30");
  require(c.num_experts > 0, "buffer: num_experts must be > 0 (", cfg, ")");
  // With redundant experts the ranks hold the P physical experts instead (checked below).
  require(c.num_physical_experts > 0 || c.num_experts % ranks == 0, "buffer: num_experts (", c.num_experts,
          ") must be a multiple of the group size (", ranks, ") so every rank holds the same number of experts");
  require(c.topk >= 1 && c.topk <= c.num_experts, "buffer: topk must be in [1, num_experts], got ", c.topk);
  require(c.topk <= 64, "buffer: topk must be <= 64, got ", c.topk);
  require(c.expert_alignment >= 1 && c.expert_alignment <= (int64_t{1} << 30),
          "buffer: expert_alignment must be in [1, 2^30], got ", c.expert_alignment);
  require(c.capacity_factor >= 0.0 && std::isfinite(c.capacity_factor),
          "buffer: capacity_factor must be >= 0 (0 disables dropping), got ", c.capacity_factor);
  require(c.timeout_ms >= 0, "buffer: timeout_ms must be >= 0, got ", c.timeout_ms);
  require(c.num_sms >= 0 && c.num_sms <= 1024, "buffer: num_sms must be in [0, 1024] (0 = default), got ", c.num_sms);
  require(c.send_blocks >= 0 && c.send_blocks < (c.num_sms > 0 ? c.num_sms : 1024),
          "buffer: send_blocks must be in [0, num_sms - 1] (0 = default), got ", c.send_blocks, " with num_sms=",
          c.num_sms);
  if (c.mode == CapacityMode::capacity)
    require(c.capacity_rows > 0, "buffer: capacity mode needs capacity_rows > 0 (receive rows per rank)");
  // The shared segment comes first; room for it whole means shared rows are never lost.
  const int64_t shared_rows = (c.max_tokens_per_rank + c.expert_alignment - 1) / c.expert_alignment * c.expert_alignment;
  if (c.shared_expert && c.mode == CapacityMode::capacity)
    require(c.capacity_rows >= shared_rows, "buffer: shared_expert in capacity mode needs capacity_rows >= ",
            shared_rows, " (the shared segment: max_tokens_per_rank padded to expert_alignment), got ",
            c.capacity_rows);
  if (c.wire == WireFormat::fp8 || c.wire == WireFormat::fp8_ue8m0)
    require(c.hidden % kFp8Block == 0, "buffer: wire ", wire_name(c.wire), " needs hidden to be a multiple of ",
            kFp8Block, " (one scale per 128 channels), got hidden=", c.hidden, "; use wire bf16 for this shape");
  if (c.wire == WireFormat::nvfp4)
    require(c.hidden % kNvfp4Block == 0, "buffer: wire nvfp4 needs hidden to be a multiple of ", kNvfp4Block,
            ", got hidden=", c.hidden);
  validate_combine_wire(c.combine_wire, c.hidden, "buffer");
  replica_shape(c.num_experts, c.num_physical_experts, c.max_replicas, ranks, "buffer");
}

void validate_dispatch_x(const DispatchInput& in, const BufferConfig& c, DeviceKind device) {
  require(in.x.defined(), "dispatch: x is missing; expected [T, ", c.hidden, "] bf16 (or fp8_e4m3 with wire fp8)");
  const int64_t tokens = in.x.ndim >= 1 ? in.x.shape[0] : 0;
  const auto spec = words("[T, ", c.hidden, "] with T <= max_tokens_per_rank=", c.max_tokens_per_rank);
  if (in.x.dtype == DType::fp8_e4m3) {
    require(c.wire == WireFormat::fp8, "dispatch: pre-quantized fp8 x needs a buffer with wire fp8, this buffer's wire is ",
            wire_name(c.wire));
    check_tensor(in.x, "dispatch: x", spec, DType::fp8_e4m3, {kAnyDim, c.hidden}, device);
    check_tensor(in.x_scales, "dispatch: x_scales",
                 words("[T, ", c.hidden / kFp8Block, "] (one fp32 scale per 128 channels)"), DType::f32,
                 {tokens, c.hidden / kFp8Block}, device);
  } else {
    check_tensor(in.x, "dispatch: x", spec, DType::bf16, {kAnyDim, c.hidden}, device);
    require(!in.x_scales.defined(), "dispatch: x_scales given with bf16 x; scales go with pre-quantized fp8 x only");
  }
  require(tokens <= c.max_tokens_per_rank, "dispatch: x has ", tokens, " tokens but the buffer was sized for max_tokens_per_rank=",
          c.max_tokens_per_rank, "; create the buffer with a larger max_tokens_per_rank");
}

namespace {

void check_no_repeats(const int32_t* e, int64_t t, int64_t k_count) {
  for (int64_t k = 0; k < k_count; ++k) {
    for (int64_t j = 0; j < k && e[k] >= 0; ++j)
      require(e[j] != e[k], "dispatch: token ", t, " selects expert ", e[k], " twice (slots ", j, " and ", k,
              "); each expert at most once per token");
  }
}

Routing from_topk(const DispatchInput& in, const BufferConfig& c, int64_t tokens) {
  Routing r{tokens, c.topk, std::vector<int32_t>(tokens * c.topk), std::vector<float>(tokens * c.topk),
            in.topk_weights.defined()};
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < c.topk; ++k) {
      const int64_t id = in.topk_idx.dtype == DType::i32 ? at<int32_t>(in.topk_idx, t, k) : at<int64_t>(in.topk_idx, t, k);
      require(id >= -1 && id < c.num_experts, "dispatch: topk_idx[", t, ", ", k, "] = ", id,
              " is out of range; expert ids must be in [0, ", c.num_experts, ") or -1 for an unused slot");
      r.expert[t * c.topk + k] = static_cast<int32_t>(id);
      r.weight[t * c.topk + k] = id < 0 ? 0.0f : r.has_weights ? at<float>(in.topk_weights, t, k) : 1.0f;
    }
    check_no_repeats(&r.expert[t * c.topk], t, c.topk);
  }
  return r;
}

Routing from_map(const DispatchInput& in, const BufferConfig& c, int64_t tokens) {
  Routing r{tokens, c.topk, std::vector<int32_t>(tokens * c.topk, -1), std::vector<float>(tokens * c.topk, 0.0f),
            in.probs.defined()};
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t k = 0;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const uint8_t sel = at<uint8_t>(in.routing_map, t, e);
      require(sel <= 1, "dispatch: routing_map[", t, ", ", e, "] = ", int(sel), "; a bool map holds 0 or 1");
      if (!sel) continue;
      require(k < c.topk, "dispatch: routing_map row ", t, " selects more than topk=", c.topk, " experts");
      r.expert[t * c.topk + k] = static_cast<int32_t>(e);
      r.weight[t * c.topk + k] = r.has_weights ? at<float>(in.probs, t, e) : 1.0f;
      ++k;
    }
  }
  return r;
}

}  // namespace

Routing routing_from_input(const DispatchInput& in, const BufferConfig& c) {
  const int64_t tokens = in.x.shape[0];
  validate_routing_tensors(in, c, tokens, DeviceKind::host);
  return in.topk_idx.defined() ? from_topk(in, c, tokens) : from_map(in, c, tokens);
}

std::vector<int64_t> count_per_expert(const Routing& r, int64_t num_experts) {
  std::vector<int64_t> counts(num_experts, 0);
  for (int32_t e : r.expert)
    if (e >= 0) ++counts[e];
  return counts;
}

int64_t expert_capacity(double capacity_factor, int64_t total_tokens, int64_t topk, int64_t num_experts) {
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(total_tokens * topk) /
                                        static_cast<double>(num_experts)));
}

int64_t drop_over_capacity(Routing& r, const std::vector<std::vector<int64_t>>& counts, int rank, int64_t capacity) {
  const size_t num_experts = counts[rank].size();
  std::vector<int64_t> used(num_experts, 0);  // slots already kept by lower ranks, then by this rank
  for (int s = 0; s < rank; ++s)
    for (size_t e = 0; e < num_experts; ++e) used[e] += counts[s][e];
  int64_t dropped = 0;
  for (size_t i = 0; i < r.expert.size(); ++i) {
    const int32_t e = r.expert[i];
    if (e < 0) continue;
    if (used[e]++ >= capacity) {
      r.expert[i] = -1;
      r.weight[i] = 0.0f;
      ++dropped;
    }
  }
  return dropped;
}

std::vector<float> shared_gate_weights(const TensorView& gate, int64_t tokens) {
  std::vector<float> w(tokens, 1.0f);
  for (int64_t t = 0; gate.defined() && t < tokens; ++t) w[t] = gate.ptr<const float>()[t * gate.strides[0]];
  return w;
}

}  // namespace epx::detail
