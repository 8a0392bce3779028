// Low-latency mode on the CPU backend: the executable specification of docs/low-latency.md.
// The send half writes each (token, expert) row straight into the expert rank's receive area,
// at a slot of its own (source rank, position); the receive half waits for every peer and
// compacts the rows of each expert in (source rank, source token) order.
#include <cmath>
#include <cstring>

#include "core/check.hpp"
#include "core/creation.hpp"
#include "core/low_latency_backend.hpp"
#include "core/reduce.hpp"
#include "core/replicas.hpp"
#include "core/routing.hpp"
#include "core/timeout.hpp"
#include "core/validate.hpp"
#include "core/wire.hpp"
#include "epx/codec.hpp"
#include "host/host_group.hpp"

namespace epx::detail {

namespace {

// One rank's receive memory, two sets per kind of call (call n uses set n % 2).
struct LowLatencyArea {
  struct DispatchSet {
    std::vector<uint8_t> payload;  // [L][R*M] wire rows, slot (l, s*M + i)
    std::vector<int32_t> token;    // [L][R*M]
    std::vector<int32_t> slot;     // [L][R*M]
    std::vector<int64_t> count;    // [L][R] rows each source wrote for each expert
    Mailbox mailbox;
  } dispatch[2];
  struct CombineSet {
    std::vector<uint16_t> rows;    // [M][K] bf16 rows: expert output of (token, slot)
    Mailbox mailbox;
  } combine[2];
};

struct LowLatencyShared {
  explicit LowLatencyShared(int ranks) : barrier(ranks), areas(ranks) {}
  PeerBarrier barrier;
  std::vector<LowLatencyArea> areas;
};


class HostLowLatency final : public LowLatencyBackend {
 public:
  HostLowLatency(const Group& group, const LowLatencyConfig& c)
      : LowLatencyBackend(group, c),
        combine_wire_(wire_row(c.combine_wire, c.hidden)) {
    auto* state = dynamic_cast<HostGroupState*>(group.state().get());
    require(state != nullptr, "low-latency buffer: group is not a host group");
    // Before joining anything; a bad EPX_TIMEOUT_MS is refused here, on every rank.
    agree_after_checks(group, "low-latency buffer", describe(c), c.timeout_ms, [&] { resolve_timeout(c.timeout_ms); });
    shared_ = state->join_next<LowLatencyShared>(rank_, "LowLatencyBuffer");
    LowLatencyArea& a = shared_->areas[rank_];
    for (auto& set : a.dispatch) {
      set.payload.assign(local_ * slots_ * wire_.bytes(), 0);
      set.token.assign(local_ * slots_, -1);
      set.slot.assign(local_ * slots_, -1);
      set.count.assign(local_ * ranks_, 0);
    }
    for (auto& set : a.combine) {
      set.rows.assign(c.max_tokens_per_rank * c.topk * c.hidden, 0);
    }
    load_ = Tensor::zeros_host(DType::i64, {local_});
    // A send half writes into its peers' areas before any barrier of its call.
    sync("low-latency buffer creation (areas ready)");
  }

  void dispatch_send(const LowLatencyDispatchInput& in) override {
    require(!dispatch_pending_, "ll dispatch_send: the previous dispatch_send has no dispatch_recv yet");
    const int64_t call = dispatch_calls_++;
    const int set = static_cast<int>(call % 2);
    const std::string name = cat("ll_dispatch #", call);
    auto h = std::make_shared<LowLatencyHandleState>();
    h->owner = this;
    std::string error, signature;
    try {
      take_rejection();
      read_dispatch_input(in, *h);
      signature = replica_table_signature(in.expert_replicas, replicas_);  // every rank routes by one table
    } catch (const Error& e) {
      error = e.what();
    }
    if (error.empty()) send_rows(in, *h, set);
    if (error.empty() && config().shared_expert) keep_shared_rows(in, *h);
    publish(set, name, error, /*dispatch=*/true, signature);
    dispatch_pending_ = std::move(h);
    if (!error.empty()) {  // fail together: wait for the peers' receive half, then throw
      dispatch_pending_.reset();
      sync(name + " (receive)");
      throw Error(ErrorCode::invalid_argument, error);
    }
  }

  LowLatencyDispatchResult dispatch_recv() override {
    require(dispatch_pending_ != nullptr, "ll dispatch_recv: no dispatch_send before it");
    const int64_t call = dispatch_calls_ - 1;
    const int set = static_cast<int>(call % 2);
    auto h = std::move(dispatch_pending_);
    const std::string name = cat("ll_dispatch #", call);
    sync(name + " (receive)");
    check_mailboxes(set, name, true);

    const LowLatencyConfig& c = config();
    const LowLatencyArea::DispatchSet& area = shared_->areas[rank_].dispatch[set];
    LowLatencyDispatchResult out;
    allocate(out);
    h->recv_count.assign(segments_, 0);
    h->src_rank.assign(segments_ * slots_, -1);
    h->src_token.assign(segments_ * slots_, -1);
    h->src_slot.assign(segments_ * slots_, -1);
    auto* layout = out.recv_layout.data<int32_t>();
    auto* src = out.recv_src.data<int32_t>();
    if (c.shared_expert) place_shared_rows(out, *h);
    for (int64_t l = 0; l < local_; ++l) {
      const int64_t o = first_routed_ + l;  // the output's expert: the shared one comes first
      int64_t row = 0;
      for (int s = 0; s < ranks_; ++s) {
        const int64_t n = area.count[l * ranks_ + s];
        layout[(o * ranks_ + s) * 2] = static_cast<int32_t>(row);
        layout[(o * ranks_ + s) * 2 + 1] = static_cast<int32_t>(n);
        for (int64_t i = 0; i < n; ++i, ++row) {
          const int64_t from = l * slots_ + s * c.max_tokens_per_rank + i, to = o * slots_ + row;
          store(out, to, &area.payload[from * wire_.bytes()]);
          src[2 * to] = s;
          src[2 * to + 1] = area.token[from];
          h->src_rank[to] = s;
          h->src_token[to] = area.token[from];
          h->src_slot[to] = area.slot[from];
        }
      }
      h->recv_count[o] = static_cast<int32_t>(row);
      out.recv_count.data<int32_t>()[o] = static_cast<int32_t>(row);
      load_.data<int64_t>()[l] += row;
    }
    out.topk_physical = std::move(h->topk_physical);
    out.handle = LowLatencyHandle(std::move(h));
    return out;
  }

  Tensor expert_load() const override { return load_; }
  const void* partners() const override { return shared_.get(); }
  void reset_expert_load() override { std::fill_n(load_.data<int64_t>(), local_, int64_t{0}); }

  void combine_send(const LowLatencyCombineInput& in, const LowLatencyHandle& handle) override {
    require(combine_pending_.handle == nullptr, "ll combine_send: the previous combine_send has no combine_recv yet");
    const int64_t call = combine_calls_++;
    const int set = static_cast<int>(call % 2);
    const std::string name = cat("ll_combine #", call);
    const LowLatencyConfig& c = config();
    std::string error;
    const LowLatencyHandleState* h = nullptr;
    try {
      take_rejection();
      require(handle.valid(), "ll_combine: the handle is empty; pass the handle ll_dispatch returned");
      require(handle.state().owner == this, "ll_combine: the handle belongs to another buffer or rank");
      h = &handle.state();
      check_tensor(in.y, "ll_combine: y",
                   words("[", c.shared_expert ? "1 + L=" : "L=", segments_, ", R*M=", slots_, ", H=", c.hidden, "]"),
                   DType::bf16, {segments_, slots_, c.hidden}, DeviceKind::host);
      require(in.y.is_contiguous(), "ll_combine: y must be contiguous");
      check_combine_weights(in, *h, DeviceKind::host);
    } catch (const Error& e) {
      error = e.what();
    }
    if (error.empty()) {
      // Each expert row goes back to its source, into the (token, slot) place it came from.
      const uint16_t* y = in.y.ptr<const uint16_t>();
      for (int64_t o = first_routed_; o < segments_; ++o)
        for (int64_t j = 0; j < h->recv_count[o]; ++j) {
          const int64_t row = o * slots_ + j;
          LowLatencyArea::CombineSet& dst = shared_->areas[h->src_rank[row]].combine[set];
          const int64_t at = static_cast<int64_t>(h->src_token[row]) * c.topk + h->src_slot[row];
          std::memcpy(&dst.rows[at * c.hidden], y + row * c.hidden, 2 * c.hidden);
        }
      combine_pending_ = {handle.state_ptr(), in.weighted, in.topk_weights, {}};
      if (c.shared_expert)  // the shared expert's rows stay here: this rank's own tokens, rows 0..
        combine_pending_.shared_rows.assign(y, y + h->num_tokens * c.hidden);
    }
    publish(set, name, error, /*dispatch=*/false);
    if (!error.empty()) {
      sync(name + " (receive)");
      throw Error(ErrorCode::invalid_argument, error);
    }
  }

  Tensor combine_recv() override {
    require(combine_pending_.handle != nullptr, "ll combine_recv: no combine_send before it");
    const int64_t call = combine_calls_ - 1;
    const int set = static_cast<int>(call % 2);
    const PendingCombine p = std::move(combine_pending_);
    combine_pending_ = {};
    const std::string name = cat("ll_combine #", call);
    sync(name + " (receive)");
    check_mailboxes(set, name, false);

    // docs/low-latency.md: for each rank d in order holding one of the token's experts, its
    // partial (that rank's slots in slot order: fma(w, y, acc) or acc + y, from 0) rounded to
    // bf16, in the combine wire's form (bf16, or quantized to fp8 and dequantized); out[t] =
    // bf16 of the partials' sum. The CUDA backend sums the partials on the expert ranks; here
    // every row came back and the same sums run at the source.
    const LowLatencyConfig& c = config();
    const LowLatencyArea::CombineSet& area = shared_->areas[rank_].combine[set];
    const LowLatencyHandleState& h = *p.handle;
    Tensor out = Tensor::zeros_host(DType::bf16, {h.tokens, c.hidden});
    std::vector<float> acc(c.hidden), partial(c.hidden);
    std::vector<uint16_t> rounded(c.hidden);
    std::vector<uint8_t> wire_partial(combine_wire_.bytes());
    for (int64_t t = 0; t < h.num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int d = 0; d < ranks_; ++d) {
        bool any = false;
        std::fill(partial.begin(), partial.end(), 0.0f);
        for (int64_t k = 0; k < c.topk; ++k) {
          const int32_t e = h.slot_expert[t * c.topk + k];
          if (e < 0 || e / local_ != d) continue;
          any = true;
          const uint16_t* y = &area.rows[(t * c.topk + k) * c.hidden];
          const float w = !p.weighted               ? 0.0f
                          : h.weights_at_dispatch ? h.dispatch_weights[t * c.topk + k]
                                                  : at<float>(p.weights, t, k);
          if (p.weighted) fma_row(partial.data(), w, y, c.hidden);
          else add_row(partial.data(), y, c.hidden);
        }
        if (!any) continue;
        round_row(rounded.data(), partial.data(), c.hidden);  // one row per (token, rank)
        encode_partial(combine_wire_, rounded.data(), wire_partial.data());
        add_partial(combine_wire_, wire_partial.data(), acc.data());
      }
      if (c.shared_expert) {  // then the shared expert's row, weighted by the gate (as Buffer's combine)
        const uint16_t* y = &p.shared_rows[t * c.hidden];
        if (p.weighted) fma_row(acc.data(), h.shared_weight[t], y, c.hidden);
        else add_row(acc.data(), y, c.hidden);
      }
      round_row(out.data<uint16_t>() + t * c.hidden, acc.data(), c.hidden);
    }
    return out;
  }

 private:
  struct PendingCombine {
    std::shared_ptr<const LowLatencyHandleState> handle;
    bool weighted = false;
    TensorView weights;
    std::vector<uint16_t> shared_rows;  // shared_expert: [num_tokens, H] the shared expert's output rows
  };

  void sync(const std::string& what) { shared_->barrier.arrive_and_wait(rank_, timeout_, what); }

  // Rank r's mailbox of set `set`, for dispatch or combine.
  Mailbox& mailbox(int r, int set, bool dispatch) const {
    return dispatch ? shared_->areas[r].dispatch[set].mailbox : shared_->areas[r].combine[set].mailbox;
  }

  void publish(int set, const std::string& name, const std::string& error, bool dispatch,
               const std::string& signature = "") {
    Mailbox& m = mailbox(rank_, set, dispatch);
    m.op = name;
    m.error = error;
    m.signature = signature;
  }

  void check_mailboxes(int set, const std::string& name, bool dispatch) {
    for (int r = 0; r < ranks_; ++r) {
      const Mailbox& m = mailbox(r, set, dispatch);
      if (m.op != name)
        fail(ErrorCode::config_mismatch, name, " (rank ", rank_, "): rank ", r, " is in '", m.op,
             "'; every rank must make the same low-latency calls in the same order");
      if (!m.error.empty())
        fail(ErrorCode::peer_failed, name, " (rank ", rank_, "): rank ", r, " rejected its input, so the group stops: ",
             m.error);
    }
    const Mailbox& mine = mailbox(rank_, set, dispatch);
    for (int r = 0; r < ranks_; ++r) {
      const Mailbox& m = mailbox(r, set, dispatch);
      if (m.signature != mine.signature)
        fail(ErrorCode::config_mismatch, name, ": ranks disagree on the call's options: rank ", rank_, " has {",
             mine.signature, "}, rank ", r, " has {", m.signature, "}");
    }
  }

  void read_dispatch_input(const LowLatencyDispatchInput& in, LowLatencyHandleState& h) {
    const LowLatencyConfig& c = config();
    check_tensor(in.x, "ll_dispatch: x", words("[T, ", c.hidden, "] with T <= max_tokens_per_rank=", c.max_tokens_per_rank),
                 DType::bf16, {kAnyDim, c.hidden}, DeviceKind::host);
    h.tokens = in.x.shape[0];
    require(h.tokens <= c.max_tokens_per_rank, "ll_dispatch: x has ", h.tokens,
            " tokens but the buffer was sized for max_tokens_per_rank=", c.max_tokens_per_rank);
    require(std::isfinite(in.nvfp4_global_scale) && in.nvfp4_global_scale >= 0.0f,
            "ll_dispatch: nvfp4_global_scale must be 0 (per token) or a positive finite number");
    check_tensor2(in.topk_idx, "ll_dispatch: topk_idx", words("[T=", h.tokens, ", K=", c.topk, "]"), DType::i32, DType::i64,
                  {h.tokens, c.topk}, DeviceKind::host);
    h.num_tokens = h.tokens;
    if (in.num_tokens.defined()) {
      check_tensor(in.num_tokens, "ll_dispatch: num_tokens", "[1]", DType::i32, {1}, DeviceKind::host);
      const int32_t n = *in.num_tokens.ptr<const int32_t>();
      require(n >= 0 && n <= h.tokens, "ll_dispatch: num_tokens = ", n, " must be in [0, T=", h.tokens, "]");
      h.num_tokens = n;
    }
    check_dispatch_weights(in, h.tokens, DeviceKind::host);
    if (c.shared_expert) {
      h.has_shared_gate = in.shared_gate.defined();
      h.shared_weight = shared_gate_weights(in.shared_gate, h.tokens);
    }
    if (in.topk_weights.defined()) {  // kept for this dispatch's combine
      h.weights_at_dispatch = true;
      h.dispatch_weights.resize(h.tokens * c.topk);
      for (int64_t t = 0; t < h.tokens; ++t)
        for (int64_t k = 0; k < c.topk; ++k) h.dispatch_weights[t * c.topk + k] = at<float>(in.topk_weights, t, k);
    }
    h.slot_expert.assign(h.tokens * c.topk, -1);
    for (int64_t t = 0; t < h.num_tokens; ++t)
      for (int64_t k = 0; k < c.topk; ++k) {
        const int64_t e = in.topk_idx.dtype == DType::i32 ? at<int32_t>(in.topk_idx, t, k) : at<int64_t>(in.topk_idx, t, k);
        require(e >= -1 && e < c.num_experts, "ll_dispatch: topk_idx[", t, ", ", k, "] = ", e,
                " is out of range; expert ids must be in [0, ", c.num_experts, ") or -1 for an unused slot");
        for (int64_t j = 0; j < k && e >= 0; ++j)
          require(h.slot_expert[t * c.topk + j] != e, "ll_dispatch: token ", t, " selects expert ", e, " twice");
        h.slot_expert[t * c.topk + k] = static_cast<int32_t>(e);
      }
    // EPLB: the slots' logical experts become the physical ones the replica rule picks; the choice
    // goes back to the caller as topk_physical.
    h.topk_physical = route_to_replicas(in.expert_replicas, replicas_, h.slot_expert, h.tokens, c.topk, rank_, ranks_,
                                        "ll_dispatch");
    for (int64_t t = 0; c.check_finite && t < h.num_tokens; ++t)  // the rows that count; the first NaN or infinity
      for (int64_t i = 0; i < c.hidden; ++i) {
        const float v = bf16_to_float(at<uint16_t>(in.x, t, i));
        if (is_nonfinite(v)) fail(ErrorCode::invalid_argument, "ll_dispatch: x[", t, "][", i, "] is not finite (", nonfinite_name(v), ")");
      }
  }

  // Every (token, expert) pair to the expert's rank, at this rank's next slot of that expert.
  void send_rows(const LowLatencyDispatchInput& in, const LowLatencyHandleState& h, int set) {
    const LowLatencyConfig& c = config();
    const int64_t experts = replicas_.physical;
    std::vector<int64_t> next(experts, 0);
    std::vector<uint8_t> row(wire_.bytes());
    DispatchInput as_dispatch;
    as_dispatch.x = in.x;
    for (int64_t t = 0; t < h.num_tokens; ++t) {
      bool encoded = false;
      for (int64_t k = 0; k < c.topk; ++k) {
        const int32_t e = h.slot_expert[t * c.topk + k];
        if (e < 0) continue;
        if (!encoded) encode_row(as_dispatch, t, wire_, in.nvfp4_global_scale, row.data());
        encoded = true;
        LowLatencyArea::DispatchSet& dst = shared_->areas[e / local_].dispatch[set];
        const int64_t at = (e % local_) * slots_ + rank_ * c.max_tokens_per_rank + next[e]++;
        std::memcpy(&dst.payload[at * wire_.bytes()], row.data(), row.size());
        dst.token[at] = static_cast<int32_t>(t);
        dst.slot[at] = static_cast<int32_t>(k);
      }
    }
    for (int64_t e = 0; e < experts; ++e)
      shared_->areas[e / local_].dispatch[set].count[(e % local_) * ranks_ + rank_] = next[e];
  }

  void allocate(LowLatencyDispatchResult& out) const {
    const LowLatencyConfig& c = config();
    switch (c.wire) {
      case WireFormat::bf16: out.recv_x = Tensor::zeros_host(DType::bf16, {segments_, slots_, c.hidden}); break;
      case WireFormat::fp8:
      case WireFormat::fp8_ue8m0:
        out.recv_x = Tensor::zeros_host(DType::fp8_e4m3, {segments_, slots_, c.hidden});
        out.recv_scales = Tensor::zeros_host(DType::f32, {segments_, slots_, c.hidden / kFp8Block});
        break;
      case WireFormat::nvfp4:
        out.recv_x = Tensor::zeros_host(DType::e2m1x2, {segments_, slots_, c.hidden / 2});
        out.recv_scales = Tensor::zeros_host(DType::fp8_e4m3, {segments_, slots_, c.hidden / kNvfp4Block});
        out.recv_global_scale = Tensor::zeros_host(DType::f32, {segments_, slots_});
        break;
    }
    out.recv_count = Tensor::zeros_host(DType::i32, {segments_});
    out.recv_src = Tensor::zeros_host(DType::i32, {segments_, slots_, 2});
    std::fill_n(out.recv_src.data<int32_t>(), 2 * segments_ * slots_, -1);
    out.recv_layout = Tensor::zeros_host(DType::i32, {segments_, ranks_, 2});
  }

  // shared_expert: this rank's own rows that count, encoded as every row, for the shared expert.
  void keep_shared_rows(const LowLatencyDispatchInput& in, const LowLatencyHandleState& h) {
    DispatchInput as_dispatch;
    as_dispatch.x = in.x;
    shared_rows_.assign(h.num_tokens * wire_.bytes(), 0);
    for (int64_t t = 0; t < h.num_tokens; ++t)
      encode_row(as_dispatch, t, wire_, in.nvfp4_global_scale, &shared_rows_[t * wire_.bytes()]);
  }

  // The shared expert (output expert 0): rows 0..num_tokens-1 are this rank's tokens in order, all
  // from this rank (its layout range; the other sources' are empty at row num_tokens' end).
  void place_shared_rows(LowLatencyDispatchResult& out, LowLatencyHandleState& h) {
    const int64_t n = h.num_tokens;
    auto* layout = out.recv_layout.data<int32_t>();
    auto* src = out.recv_src.data<int32_t>();
    for (int s = 0; s < ranks_; ++s) {
      layout[s * 2] = static_cast<int32_t>(s <= rank_ ? 0 : n);
      layout[s * 2 + 1] = static_cast<int32_t>(s == rank_ ? n : 0);
    }
    for (int64_t t = 0; t < n; ++t) {
      store(out, t, &shared_rows_[t * wire_.bytes()]);
      src[2 * t] = rank_;
      src[2 * t + 1] = static_cast<int32_t>(t);
      h.src_rank[t] = rank_;
      h.src_token[t] = static_cast<int32_t>(t);
    }
    h.recv_count[0] = static_cast<int32_t>(n);
    out.recv_count.data<int32_t>()[0] = static_cast<int32_t>(n);
  }

  void store(LowLatencyDispatchResult& out, int64_t row, const uint8_t* payload) const {
    std::memcpy(out.recv_x.data<uint8_t>() + row * wire_.x_bytes, payload, wire_.x_bytes);
    if (wire_.scale_bytes)
      std::memcpy(out.recv_scales.data<uint8_t>() + row * wire_.scale_bytes, payload + wire_.x_bytes, wire_.scale_bytes);
    if (wire_.global_bytes)
      std::memcpy(out.recv_global_scale.data<uint8_t>() + row * 4, payload + wire_.x_bytes + wire_.scale_bytes, 4);
  }

  const WireRow combine_wire_;  // LowLatencyConfig::combine_wire
  std::vector<uint8_t> shared_rows_;  // shared_expert: the pending dispatch's own wire rows
  std::shared_ptr<LowLatencyShared> shared_;
  std::shared_ptr<LowLatencyHandleState> dispatch_pending_;
  PendingCombine combine_pending_;
  Tensor load_;  // [L] i64: LowLatencyBuffer::expert_load
};

}  // namespace

std::unique_ptr<LowLatencyBackend> make_host_low_latency(const Group& group, const LowLatencyConfig& config) {
  return std::make_unique<HostLowLatency>(group, config);
}

}  // namespace epx::detail
