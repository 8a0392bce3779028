// Host-side checks of each operation's arguments, shared by every backend so the messages
// are the same everywhere. Each throws invalid_argument.
#pragma once
#include "core/handle.hpp"
#include "epx/ops.hpp"

namespace epx::detail {

void validate_dispatch_options(const DispatchOptions& opt);
// topk_idx/topk_weights or routing_map/probs: presence, shapes and dtypes (not the values).
void validate_routing_tensors(const DispatchInput& in, const BufferConfig& c, int64_t tokens, DeviceKind device);
// BufferConfig::shared_expert: the layout it needs, and shared_gate [T] f32 only with it.
void validate_shared_expert(const DispatchInput& in, const BufferConfig& c, const DispatchOptions& opt, int64_t tokens,
                            DeviceKind device);
// Cached dispatch: x (and x_scales) as dispatch takes them, with the handle's T; no routing.
void validate_cached_dispatch(const DispatchInput& in, const HandleState& h, const BufferConfig& c,
                              const CachedDispatchOptions& opt, DeviceKind device);
void validate_combine(const CombineInput& in, const HandleState& h, const BufferConfig& c, const CombineOptions& opt,
                      DeviceKind device);
void validate_dispatch_backward(const DispatchBackwardInput& in, const HandleState& h, const BufferConfig& c,
                                DeviceKind device);
void validate_combine_backward(const CombineBackwardInput& in, const HandleState& h, const BufferConfig& c,
                               const CombineOptions& opt, DeviceKind device);

}  // namespace epx::detail
