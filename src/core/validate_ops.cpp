#include "core/validate_ops.hpp"

#include <cmath>

#include "core/check.hpp"
#include "core/routing.hpp"
#include "core/validate.hpp"

namespace epx::detail {

void validate_dispatch_options(const DispatchOptions& opt) {
  require(opt.layout == Layout::expert_major || opt.layout == Layout::rank_major, "dispatch: unknown layout ",
          static_cast<int>(opt.layout));
  require(std::isfinite(opt.nvfp4_global_scale) && opt.nvfp4_global_scale >= 0.0f,
          "dispatch: nvfp4_global_scale must be 0 (per token) or a positive finite number, got ", opt.nvfp4_global_scale);
}

void validate_routing_tensors(const DispatchInput& in, const BufferConfig& c, int64_t tokens, DeviceKind device) {
  require(in.topk_idx.defined() != in.routing_map.defined(),
          "dispatch: give exactly one of topk_idx and routing_map (got ", in.topk_idx.defined() ? "both" : "neither", ")");
  const auto tk = words("[T=", tokens, ", K=", c.topk, "]");
  const auto te = words("[T=", tokens, ", E=", c.num_experts, "]");
  if (in.topk_idx.defined()) {
    require(!in.probs.defined(), "dispatch: probs goes with routing_map; with topk_idx pass topk_weights");
    check_tensor2(in.topk_idx, "dispatch: topk_idx", tk, DType::i32, DType::i64, {tokens, c.topk}, device);
    if (in.topk_weights.defined())
      check_tensor(in.topk_weights, "dispatch: topk_weights", tk, DType::f32, {tokens, c.topk}, device);
    return;
  }
  require(!in.topk_weights.defined(), "dispatch: topk_weights goes with topk_idx; with routing_map pass probs");
  check_tensor(in.routing_map, "dispatch: routing_map", te, DType::boolean, {tokens, c.num_experts}, device);
  if (in.probs.defined()) check_tensor(in.probs, "dispatch: probs", te, DType::f32, {tokens, c.num_experts}, device);
}

void validate_shared_expert(const DispatchInput& in, const BufferConfig& c, const DispatchOptions& opt, int64_t tokens,
                            DeviceKind device) {
  if (!c.shared_expert) {
    require(!in.shared_gate.defined(), "dispatch: shared_gate given but the buffer has no shared expert; create it "
            "with shared_expert=true or drop shared_gate");
    return;
  }
  require(opt.layout == Layout::expert_major,
          "dispatch: shared_expert needs the expert-major layout (its rows are a segment of it); in the rank-major "
          "layout compute the shared expert on x and pass it to combine as shared_out");
  if (!in.shared_gate.defined()) return;
  // The gate is applied by the weighted combine only, which needs router weights: a gate without
  // them would be dropped without a word.
  require(in.topk_idx.defined() ? in.topk_weights.defined() : in.probs.defined(),
          "dispatch: shared_gate needs router weights (topk_weights or probs): the gate is applied by the weighted "
          "combine only");
  check_tensor(in.shared_gate, "dispatch: shared_gate", words("[T=", tokens, "]"), DType::f32, {tokens}, device);
}

namespace {
void require_weighted_ok(const char* op, const HandleState& h, bool weighted) {
  require(!weighted || h.layout == Layout::expert_major, op,
          ": weighted combine needs the expert-major layout; in the rank-major layout apply recv_topk_weights "
          "in the expert computation and combine with weighted=false");
  require(!weighted || h.has_weights, op,
          ": weighted combine needs router weights, but dispatch got no topk_weights/probs; pass them to "
          "dispatch or combine with weighted=false");
}
}  // namespace

void validate_combine(const CombineInput& in, const HandleState& h, const BufferConfig& c, const CombineOptions& opt,
                      DeviceKind device) {
  check_tensor(in.y, "combine: y", words("[", h.recv.capacity, ", ", c.hidden, "] (the rows of the dispatch output)"),
               DType::bf16, {h.recv.capacity, c.hidden}, device);
  if (in.shared_out.defined())
    check_tensor(in.shared_out, "combine: shared_out", words("[", h.tokens, ", ", c.hidden, "]"), DType::bf16,
                 {h.tokens, c.hidden}, device);
  require_weighted_ok("combine", h, opt.weighted);
}

void validate_dispatch_backward(const DispatchBackwardInput& in, const HandleState& h, const BufferConfig& c,
                                DeviceKind device) {
  const int64_t n = h.recv.capacity;
  check_tensor(in.grad_recv_x, "dispatch_backward: grad_recv_x", words("[", n, ", ", c.hidden, "]"), DType::bf16,
               {n, c.hidden}, device);
  if (!in.grad_recv_weights.defined()) return;
  if (h.layout == Layout::expert_major)
    check_tensor(in.grad_recv_weights, "dispatch_backward: grad_recv_weights", words("[", n, "] (one per row)"),
                 DType::f32, {n}, device);
  else
    check_tensor(in.grad_recv_weights, "dispatch_backward: grad_recv_weights",
                 words("[", n, ", ", c.topk, "] (as recv_topk_weights)"), DType::f32, {n, c.topk}, device);
}

void validate_cached_dispatch(const DispatchInput& in, const HandleState& h, const BufferConfig& c,
                              const CachedDispatchOptions& opt, DeviceKind device) {
  require(!in.topk_idx.defined() && !in.topk_weights.defined() && !in.routing_map.defined() && !in.probs.defined() &&
              !in.shared_gate.defined() && !in.expert_replicas.defined(),
          "cached_dispatch: routing given; a cached dispatch takes the routing of its handle's dispatch (its "
          "shared_gate and replica choice too): pass x (and x_scales) only");
  validate_dispatch_x(in, c, device);
  require(in.x.shape[0] == h.tokens, "cached_dispatch: x has ", in.x.shape[0], " tokens but the handle's dispatch had ",
          h.tokens, "; pass x of the same tokens");
  validate_dispatch_options({h.layout, opt.nvfp4_global_scale});
}

void validate_combine_backward(const CombineBackwardInput& in, const HandleState& h, const BufferConfig& c,
                               const CombineOptions& opt, DeviceKind device) {
  check_tensor(in.grad_out, "combine_backward: grad_out", words("[", h.tokens, ", ", c.hidden, "]"), DType::bf16,
               {h.tokens, c.hidden}, device);
  require_weighted_ok("combine_backward", h, opt.weighted);
  if (opt.weighted)
    check_tensor(in.y, "combine_backward: y", words("[", h.recv.capacity, ", ", c.hidden, "] (the combine's input)"),
                 DType::bf16, {h.recv.capacity, c.hidden}, device);
}

}  // namespace epx::detail
