// dispatch, combine and their backward passes on the CPU backend. The comments name the
// rules of docs/semantics.md that each step implements.
#include <cmath>
#include <cstring>

#include "core/check.hpp"
#include "core/reduce.hpp"
#include "core/routing.hpp"
#include "core/validate.hpp"
#include "core/validate_ops.hpp"
#include "epx/codec.hpp"
#include "host/host_backend.hpp"

namespace epx::detail {

namespace {

// Combine's partial sum on the expert rank for received row i (fp32, slots in order).
void partial_sum(const RecvLayout& r, int64_t i, int64_t topk, const TensorView& y, bool weighted, float* acc,
                 int64_t hidden) {
  std::fill(acc, acc + hidden, 0.0f);
  if (r.layout == Layout::rank_major) {  // one row per (token, rank), already reduced by the caller
    if (i < r.capacity) add_row(acc, row_ptr<uint16_t>(y, i), hidden);
    return;
  }
  for (int64_t k = 0; k < topk; ++k) {
    const int64_t row = r.slot_row[i * topk + k];
    if (row < 0 || row >= r.capacity) continue;  // slot not here, or lost to overflow
    const uint16_t* yr = row_ptr<uint16_t>(y, row);
    if (weighted) fma_row(acc, r.slot_weight[i * topk + k], yr, hidden);
    else add_row(acc, yr, hidden);
  }
}

// Calls place(row, i, k) for every output row of received row i within capacity: rank-major,
// row i itself (k = -1); expert-major, the row of each of its local slots k.
template <typename Place>
void for_each_output_row(const RecvLayout& r, int64_t topk, Place&& place) {
  for (int64_t i = 0; i < r.tokens; ++i) {
    if (r.layout == Layout::rank_major) {
      if (i < r.capacity) place(i, i, int64_t{-1});
      continue;
    }
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t row = r.slot_row[i * topk + k];
      if (row >= 0 && row < r.capacity) place(row, i, k);
    }
  }
}

// BufferConfig::check_finite on the host: the first NaN or infinity, x row-major, then x_scales.
void check_finite_x(const DispatchInput& in, int64_t tokens, int64_t hidden) {
  const bool fp8 = in.x.dtype == DType::fp8_e4m3;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      const float v = fp8 ? e4m3_to_float(row_ptr<uint8_t>(in.x, t)[h]) : bf16_to_float(row_ptr<uint16_t>(in.x, t)[h]);
      if (is_nonfinite(v)) fail(ErrorCode::invalid_argument, "dispatch: x[", t, "][", h, "] is not finite (", nonfinite_name(v), ")");
    }
  for (int64_t t = 0; fp8 && t < tokens; ++t)
    for (int64_t b = 0; b < hidden / kFp8Block; ++b) {
      const float v = row_ptr<float>(in.x_scales, t)[b];
      if (is_nonfinite(v))
        fail(ErrorCode::invalid_argument, "dispatch: x_scales[", t, "][", b, "] is not finite (", nonfinite_name(v), ")");
    }
}

// BufferConfig::shared_expert: calls place(t) for each shared row within capacity; shared row t
// of the receive layout is row t (the shared segment comes first).
template <typename Place>
void for_each_shared_row(const RecvLayout& r, Place&& place) {
  if (!r.shared_expert) return;
  for (int64_t t = 0; t < std::min(r.shared_tokens, r.capacity); ++t) place(t);
}

// Each token's shared-row weight: its gate, or 1 without one.
void read_shared_gate(HandleState& h, const TensorView& gate) {
  h.has_shared_gate = gate.defined();
  h.shared_weight = shared_gate_weights(gate, h.tokens);
}

// The shared rows' wire rows: this rank's own tokens, encoded here; they cross no link.
void store_shared_rows(DispatchResult& out, const DispatchInput& in, const RecvLayout& r, const WireRow& wire,
                       float nvfp4_global_scale) {
  std::vector<uint8_t> payload(wire.bytes());
  for_each_shared_row(r, [&](int64_t t) {
    encode_row(in, t, wire, nvfp4_global_scale, payload.data());
    store_row(out, wire, t, payload.data());
  });
}

// Combine step 2's shared-expert term of token t: its own shared row of `y`, weighted by its gate.
void add_shared_row(const HandleState& h, const TensorView& y, int64_t t, bool weighted, float* acc, int64_t hidden) {
  if (!h.recv.shared_expert || t >= h.recv.capacity) return;
  const uint16_t* row = row_ptr<uint16_t>(y, t);
  if (weighted) fma_row(acc, h.shared_weight[t], row, hidden);
  else add_row(acc, row, hidden);
}

// [T] f32 of value(t) for each shared row (the shared gate's gradients).
template <typename Value>
Tensor shared_row_values(const HandleState& h, Value&& value) {
  Tensor out = Tensor::zeros_host(DType::f32, {h.tokens});
  for_each_shared_row(h.recv, [&](int64_t t) { out.data<float>()[t] = value(t); });
  return out;
}

Tensor offsets_tensor(const std::vector<int64_t>& v) {
  Tensor t = Tensor::zeros_host(DType::i64, {static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

}  // namespace

DispatchResult HostBackend::dispatch(const DispatchInput& in, const DispatchOptions& opt) {
  const Call call = begin_call("dispatch");
  const BufferConfig& c = config();
  Mailbox mine;
  mine.signature = cat("layout=", layout_name(opt.layout));
  Routing routing;
  Tensor topk_physical;
  try {
    validate_dispatch_options(opt);
    validate_dispatch_x(in, c, DeviceKind::host);
    routing = routing_from_input(in, c);
    validate_shared_expert(in, c, opt, routing.tokens, DeviceKind::host);
    // From here on, experts are physical ones; every rank must route by the same table.
    topk_physical = route_to_replicas(in.expert_replicas, replicas_, routing.expert, routing.tokens, routing.topk,
                                      rank_, ranks_, "dispatch");
    mine.signature += replica_table_signature(in.expert_replicas, replicas_);
    if (c.check_finite) check_finite_x(in, routing.tokens, c.hidden);
    mine.tokens = routing.tokens;
    mine.expert_counts = count_per_expert(routing, replicas_.physical);
  } catch (const Error& e) {
    mine.error = e.what();
  }
  const std::vector<const Mailbox*> boxes = exchange_plan(call, std::move(mine));

  return guarded(call, [&] {
    // Capacity-factor dropping: needs every rank's counts, hence after the plan exchange.
    int64_t dropped = 0;
    if (c.capacity_factor > 0.0) {
      std::vector<std::vector<int64_t>> counts(ranks_);
      int64_t total_tokens = 0;
      for (int r = 0; r < ranks_; ++r) {
        counts[r] = boxes[r]->expert_counts;
        total_tokens += boxes[r]->tokens;
      }
      // Per physical expert: with EPLB, C spreads the slots over the P experts that serve them.
      const int64_t cap = expert_capacity(c.capacity_factor, total_tokens, c.topk, replicas_.physical);
      dropped = drop_over_capacity(routing, counts, rank_, cap);
    }

    auto h = new_handle_state(this, call.index, opt.layout, rank_, ranks_, routing.tokens, c, routing.has_weights);
    h->slot_expert = routing.expert;
    h->slot_weight = routing.weight;
    if (c.shared_expert) read_shared_gate(*h, in.shared_gate);
    plan_send(*h, local_experts_);

    // Transfer: each token once per destination rank, with its slots as the receiver sees them.
    push_forward(*h, wire_.bytes(), [&](int64_t t, uint8_t* dst) { encode_row(in, t, wire_, opt.nvfp4_global_scale, dst); });
    const int64_t max_tokens = c.max_tokens_per_rank, k_count = c.topk;
    for (int64_t t = 0; t < h->tokens; ++t)
      for (int d = 0; d < ranks_; ++d) {
        const int32_t pos = h->send_pos[t * ranks_ + d];
        if (pos < 0) continue;
        RankArea& dst = shared_->areas[d];
        const int64_t at = rank_ * max_tokens + pos;
        dst.fwd_token[at] = static_cast<int32_t>(t);
        for (int64_t k = 0; k < k_count; ++k) {
          const int32_t e = h->slot_expert[t * k_count + k];
          const bool here = e >= 0 && e / local_experts_ == d;
          dst.fwd_slot_expert[at * k_count + k] = here ? static_cast<int32_t>(e % local_experts_) : -1;
          dst.fwd_slot_weight[at * k_count + k] = here ? h->slot_weight[t * k_count + k] : 0.0f;
        }
      }
    for (int d = 0; d < ranks_; ++d) shared_->areas[d].fwd_rows[rank_] = h->sent_rows[d];
    sync(call, "transfer");

    // Receive: rows in (source rank, source token) order, then the layout.
    const RankArea& area = shared_->areas[rank_];
    RecvLayout& r = h->recv;
    r.layout = opt.layout;
    r.rank_offsets.assign(ranks_ + 1, 0);
    for (int s = 0; s < ranks_; ++s) r.rank_offsets[s + 1] = r.rank_offsets[s] + area.fwd_rows[s];
    r.tokens = r.rank_offsets[ranks_];
    for (int s = 0; s < ranks_; ++s)
      for (int64_t p = 0; p < area.fwd_rows[s]; ++p) {
        const int64_t at = s * max_tokens + p;
        r.src_rank.push_back(s);
        r.src_token.push_back(area.fwd_token[at]);
        r.slot_expert.insert(r.slot_expert.end(), &area.fwd_slot_expert[at * k_count],
                             &area.fwd_slot_expert[(at + 1) * k_count]);
        r.slot_weight.insert(r.slot_weight.end(), &area.fwd_slot_weight[at * k_count],
                             &area.fwd_slot_weight[(at + 1) * k_count]);
      }
    r.shared_expert = c.shared_expert;
    r.shared_tokens = h->tokens;
    plan_receive_layout(r, local_experts_, k_count, c.expert_alignment,
                        c.mode == CapacityMode::capacity ? c.capacity_rows : 0);

    // Outputs: zero-filled, so padding rows are zero (and recv_src marks them -1).
    DispatchResult out;
    allocate_recv(out, wire_, r.capacity);
    out.recv_src = Tensor::zeros_host(DType::i32, {r.capacity, 2});
    std::fill_n(out.recv_src.data<int32_t>(), 2 * r.capacity, -1);
    const bool expert_major = opt.layout == Layout::expert_major;
    if (expert_major) {
      out.recv_weights = Tensor::zeros_host(DType::f32, {r.capacity});
    } else {
      out.recv_topk_idx = Tensor::zeros_host(DType::i32, {r.capacity, k_count});
      std::fill_n(out.recv_topk_idx.data<int32_t>(), r.capacity * k_count, -1);  // rows past num_rows: empty
      out.recv_topk_weights = Tensor::zeros_host(DType::f32, {r.capacity, k_count});
    }
    auto store = [&](int64_t row, int64_t i, const uint8_t* payload) {
      store_row(out, wire_, row, payload);
      out.recv_src.data<int32_t>()[2 * row] = r.src_rank[i];
      out.recv_src.data<int32_t>()[2 * row + 1] = r.src_token[i];
    };
    for_each_output_row(r, k_count, [&](int64_t row, int64_t i, int64_t k) {
      store(row, i, forward_payload(r.src_rank[i], i - r.rank_offsets[r.src_rank[i]]));
      if (k >= 0) {  // expert-major: one row per local expert
        out.recv_weights.data<float>()[row] = r.slot_weight[i * k_count + k];
        return;
      }
      std::copy_n(&r.slot_expert[i * k_count], k_count, out.recv_topk_idx.data<int32_t>() + i * k_count);
      std::copy_n(&r.slot_weight[i * k_count], k_count, out.recv_topk_weights.data<float>() + i * k_count);
    });
    store_shared_rows(out, in, r, wire_, opt.nvfp4_global_scale);
    for_each_shared_row(r, [&](int64_t t) {
      out.recv_src.data<int32_t>()[2 * t] = rank_;
      out.recv_src.data<int32_t>()[2 * t + 1] = static_cast<int32_t>(t);
      out.recv_weights.data<float>()[t] = h->shared_weight[t];
    });
    if (expert_major) out.expert_offsets = offsets_tensor(r.expert_offsets);
    out.tokens_per_expert = offsets_tensor(r.tokens_per_expert);
    out.rank_offsets = offsets_tensor(r.rank_offsets);
    out.num_rows = r.num_rows;
    out.overflow = r.overflow();
    out.recv_info = offsets_tensor({r.tokens, r.num_rows, r.capacity, r.overflow() ? 1 : 0});
    out.dropped_slots = dropped;
    out.topk_physical = std::move(topk_physical);
    count_load(r);
    out.handle = Handle(std::move(h));
    return out;
  });
}

DispatchResult HostBackend::cached_dispatch(const DispatchInput& in, const Handle& handle,
                                            const CachedDispatchOptions& opt) {
  const Call call = begin_call("cached_dispatch");
  const BufferConfig& c = config();
  const HandleState* h = &start_handle_call(
      call, handle, [&](const HandleState& s) { return cat("layout=", layout_name(s.layout)); },
      [&](const HandleState& s) {
        validate_cached_dispatch(in, s, c, opt, DeviceKind::host);
        if (c.check_finite) check_finite_x(in, s.tokens, c.hidden);
      });

  return guarded(call, [&] {
    // The dispatch's transfer of the rows, with the handle's stream positions.
    push_forward(*h, wire_.bytes(), [&](int64_t t, uint8_t* dst) { encode_row(in, t, wire_, opt.nvfp4_global_scale, dst); });
    sync(call, "transfer");
    const RecvLayout& r = h->recv;
    DispatchResult out;
    allocate_recv(out, wire_, r.capacity);  // zero-filled: padding rows as dispatch leaves them
    for_each_output_row(r, c.topk, [&](int64_t row, int64_t i, int64_t) {
      store_row(out, wire_, row, forward_payload(r.src_rank[i], i - r.rank_offsets[r.src_rank[i]]));
    });
    store_shared_rows(out, in, r, wire_, opt.nvfp4_global_scale);
    out.num_rows = r.num_rows;
    out.overflow = r.overflow();
    out.handle = handle;
    return out;
  });
}

CombineResult HostBackend::combine(const CombineInput& in, const Handle& handle, const CombineOptions& opt) {
  const Call call = begin_call("combine");
  const BufferConfig& c = config();
  const HandleState* h = &start_handle_call(
      call, handle, [&](const HandleState& s) { return cat("weighted=", opt.weighted, " layout=", layout_name(s.layout)); },
      [&](const HandleState& s) { validate_combine(in, s, c, opt, DeviceKind::host); });

  return guarded(call, [&] {
    const int64_t hidden = c.hidden;
    std::vector<float> acc(hidden);
    // One bf16 row per (token, rank), in the combine wire's form, crosses back.
    push_reverse(*h, combine_wire_, true, false, [&](int64_t i, uint16_t* row, float*) {
      partial_sum(h->recv, i, c.topk, in.y, opt.weighted, acc.data(), hidden);
      round_row(row, acc.data(), hidden);
    });
    sync(call, "transfer");

    CombineResult out;
    out.out = sum_returned_rows(*h, combine_wire_, [&](int64_t t, float* acc) {
      add_shared_row(*h, in.y, t, opt.weighted, acc, hidden);  // the shared expert, then shared_out
      if (in.shared_out.defined()) add_row(acc, row_ptr<uint16_t>(in.shared_out, t), hidden);
    });
    out.overflow = h->recv.overflow();
    return out;
  });
}

DispatchBackwardResult HostBackend::dispatch_backward(const DispatchBackwardInput& in, const Handle& handle) {
  const Call call = begin_call("dispatch_backward");
  const BufferConfig& c = config();
  const HandleState* h = &start_handle_call(
      call, handle, [&](const HandleState&) { return cat("grad_weights=", in.grad_recv_weights.defined()); },
      [&](const HandleState& s) { validate_dispatch_backward(in, s, c, DeviceKind::host); });

  return guarded(call, [&] {
    const int64_t hidden = c.hidden, k_count = c.topk;
    const bool with_weights = in.grad_recv_weights.defined();
    const RecvLayout& r = h->recv;
    std::vector<float> acc(hidden);
    // Gradients cross back in bf16 whatever combine_wire is (docs/semantics.md, "Backward").
    push_reverse(*h, gradient_wire_, true, with_weights, [&](int64_t i, uint16_t* row, float* slots) {
      partial_sum(r, i, k_count, in.grad_recv_x, false, acc.data(), hidden);
      round_row(row, acc.data(), hidden);
      if (!slots) return;
      for (int64_t k = 0; k < k_count; ++k) {
        const int64_t row_k = r.slot_row[i * k_count + k];
        const bool valid = row_k >= 0 && row_k < r.capacity;
        slots[k] = !valid ? 0.0f
                   : r.layout == Layout::expert_major ? in.grad_recv_weights.ptr<const float>()[row_k * in.grad_recv_weights.strides[0]]
                                                      : at<float>(in.grad_recv_weights, row_k, k);
      }
    });
    sync(call, "transfer");

    DispatchBackwardResult out;
    out.grad_x = sum_returned_rows(*h, gradient_wire_, [&](int64_t t, float* acc) {
      add_shared_row(*h, in.grad_recv_x, t, false, acc, hidden);
    });
    if (with_weights) out.grad_topk_weights = gather_slot_values(*h);
    if (with_weights && r.shared_expert) {
      const TensorView& g = in.grad_recv_weights;
      out.grad_shared_gate = shared_row_values(*h, [&](int64_t t) { return g.ptr<const float>()[t * g.strides[0]]; });
    }
    return out;
  });
}

CombineBackwardResult HostBackend::combine_backward(const CombineBackwardInput& in, const Handle& handle,
                                                    const CombineOptions& opt) {
  const Call call = begin_call("combine_backward");
  const BufferConfig& c = config();
  const HandleState* h = &start_handle_call(
      call, handle, [&](const HandleState&) { return cat("weighted=", opt.weighted); },
      [&](const HandleState& s) { validate_combine_backward(in, s, c, opt, DeviceKind::host); });

  return guarded(call, [&] {
    const int64_t hidden = c.hidden, k_count = c.topk;
    // Forward: grad_out[t] once per rank that holds one of its experts (bf16 on the wire).
    push_forward(*h, 2 * hidden, [&](int64_t t, uint8_t* dst) {
      std::memcpy(dst, row_ptr<uint16_t>(in.grad_out, t), 2 * hidden);
    });
    sync(call, "transfer");

    // Expand into the dispatch layout, scaled per row; grad of each weight on the expert rank.
    const RecvLayout& r = h->recv;
    CombineBackwardResult out;
    out.grad_y = Tensor::zeros_host(DType::bf16, {r.capacity, hidden});
    std::vector<float> grad_w(r.tokens * k_count, 0.0f);
    for (int64_t i = 0; i < r.tokens; ++i) {
      const auto* g = reinterpret_cast<const uint16_t*>(forward_payload(r.src_rank[i], i - r.rank_offsets[r.src_rank[i]]));
      for (int64_t k = 0; k < k_count; ++k) {
        const int64_t row = r.slot_row[i * k_count + k];
        if (row < 0 || row >= r.capacity) continue;
        uint16_t* dst = out.grad_y.data<uint16_t>() + row * hidden;
        if (!opt.weighted) {
          std::memcpy(dst, g, 2 * hidden);
          continue;
        }
        scale_row(dst, r.slot_weight[i * k_count + k], g, hidden);
        grad_w[i * k_count + k] = dot_bf16(g, row_ptr<uint16_t>(in.y, row), hidden);
      }
    }
    // The shared rows: this rank's own grad_out, scaled by the gate; nothing crosses.
    for_each_shared_row(r, [&](int64_t t) {
      uint16_t* dst = out.grad_y.data<uint16_t>() + t * hidden;
      if (opt.weighted) scale_row(dst, h->shared_weight[t], row_ptr<uint16_t>(in.grad_out, t), hidden);
      else std::memcpy(dst, row_ptr<uint16_t>(in.grad_out, t), 2 * hidden);
    });
    if (opt.weighted && h->has_shared_gate)
      out.grad_shared_gate = shared_row_values(
          *h, [&](int64_t t) { return dot_bf16(row_ptr<uint16_t>(in.grad_out, t), row_ptr<uint16_t>(in.y, t), hidden); });
    if (!opt.weighted) return out;

    push_reverse(*h, gradient_wire_, false, true, [&](int64_t i, uint16_t*, float* slots) {
      std::copy_n(&grad_w[i * k_count], k_count, slots);
    });
    sync(call, "weight gradients");
    out.grad_topk_weights = gather_slot_values(*h);
    return out;
  });
}

}  // namespace epx::detail
