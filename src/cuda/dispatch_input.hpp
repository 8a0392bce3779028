// A validated dispatch input as the CUDA kernels read it.
#pragma once
#include <cstdint>

#include "cuda/kernels/launch.hpp"
#include "epx/ops.hpp"

namespace epx::detail {

// Top-k ids and weights, or a dense map and probabilities.
kernels::RoutingInput routing_input(const DispatchInput& in);
// The rows (bf16, or pre-quantized fp8 codes and scales) and how they go on the wire.
kernels::SendRows send_rows(const DispatchInput& in, WireFormat wire, float nvfp4_global_scale);
// check_finite's scan of x (bf16, or e4m3 codes and their f32 scales).
kernels::FiniteCheck finite_check(const DispatchInput& in, int64_t hidden);

}  // namespace epx::detail
