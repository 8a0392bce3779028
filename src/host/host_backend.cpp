// Collective plumbing of the CPU backend: construction, plan exchange, transfers.
#include "host/host_backend.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/check.hpp"
#include "core/creation.hpp"
#include "core/timeout.hpp"
#include "core/reduce.hpp"
#include "core/validate.hpp"

namespace epx::detail {


std::unique_ptr<Backend> make_host_backend(const Group& group, const BufferConfig& config) {
  return std::make_unique<HostBackend>(group, config);
}

HostBackend::HostBackend(const Group& group, const BufferConfig& config)
    : Backend(group, config),
      rank_(group.rank()),
      ranks_(group.size()),
      replicas_(replica_shape(config.num_experts, config.num_physical_experts, config.max_replicas, group.size(),
                              "buffer")),
      local_experts_(replicas_.physical / group.size()),
      wire_(wire_row(config.wire, config.hidden)),
      combine_wire_(wire_row(config.combine_wire, config.hidden)),
      gradient_wire_(wire_row(WireFormat::bf16, config.hidden)),
      fwd_row_bytes_(std::max(wire_.bytes(), 2 * config.hidden)),
      timeout_(resolve_timeout(config.timeout_ms)) {
  auto* state = dynamic_cast<HostGroupState*>(group.state().get());
  require(state != nullptr, "buffer: group is not a host group");
  agree_on_creation(group, "buffer", describe(config), "", config.timeout_ms);  // before joining anything
  shared_ = state->join_next<SharedBuffer>(rank_, "Buffer");

  const int64_t rows = ranks_ * config.max_tokens_per_rank, k = config.topk;
  RankArea& a = shared_->areas[rank_];
  a.fwd_payload.assign(rows * fwd_row_bytes_, 0);
  a.fwd_token.assign(rows, -1);
  a.fwd_slot_expert.assign(rows * k, -1);
  a.fwd_slot_weight.assign(rows * k, 0.0f);
  a.fwd_rows.assign(ranks_, 0);
  a.rev_rows.assign(rows * 2 * config.hidden, 0);  // a bf16 row, the largest combine wire row
  a.rev_slot_value.assign(rows * k, 0.0f);
  load_ = Tensor::zeros_host(DType::i64, {local_experts_});
  // Peers write into these areas from their first call on: every rank's are ready before any
  // rank's first call returns from its plan exchange (a barrier of the call itself).
}

void HostBackend::reset_expert_load() { std::fill_n(load_.data<int64_t>(), local_experts_, int64_t{0}); }

void HostBackend::count_load(const RecvLayout& r) {
  const size_t first = r.shared_expert ? 1 : 0;  // the shared segment is no expert's load
  for (int64_t l = 0; l < local_experts_; ++l) load_.data<int64_t>()[l] += r.tokens_per_expert[first + l];
}

HostBackend::Call HostBackend::begin_call(const char* op) {
  const int64_t index = calls_++;
  return {cat(op, " #", index), index};
}

void HostBackend::sync(const Call& call, const char* step) {
  shared_->barrier.arrive_and_wait(rank_, timeout_, cat(call.name, " (", step, ")"));
}

std::vector<const Mailbox*> HostBackend::exchange_plan(const Call& call, Mailbox mine) {
  mine.op = call.name;
  shared_->areas[rank_].mailbox[call.index % 2] = std::move(mine);
  sync(call, "plan exchange");
  std::vector<const Mailbox*> boxes(ranks_);
  for (int r = 0; r < ranks_; ++r) boxes[r] = &shared_->areas[r].mailbox[call.index % 2];
  const Mailbox& me = *boxes[rank_];
  for (int r = 0; r < ranks_; ++r)
    if (boxes[r]->op != me.op)
      fail(ErrorCode::config_mismatch, call.name, " (rank ", rank_, "): rank ", r, " is in '", boxes[r]->op,
           "' instead; every rank must make the same collective calls in the same order");
  if (!me.error.empty()) throw Error(ErrorCode::invalid_argument, me.error);
  for (int r = 0; r < ranks_; ++r)
    if (!boxes[r]->error.empty())
      fail(ErrorCode::peer_failed, call.name, " (rank ", rank_, "): rank ", r, " rejected its input, so the group stops: ",
           boxes[r]->error);
  for (int r = 0; r < ranks_; ++r)
    if (boxes[r]->signature != me.signature)
      fail(ErrorCode::config_mismatch, call.name, " (rank ", rank_, "): ranks disagree on the call's options: rank ",
           rank_, " has {", me.signature, "}, rank ", r, " has {", boxes[r]->signature, "}");
  return boxes;
}

void HostBackend::reject(Op op, const std::string& reason) {
  const Call call = begin_call(op_name(op));
  Mailbox mine;
  mine.error = reason;
  exchange_plan(call, std::move(mine));  // throws on every rank
  fail(ErrorCode::internal, call.name, ": a rejected call went on");
}

const HandleState& HostBackend::state_of(const Handle& h, const Call& call) const {
  require(h.valid(), call.name, ": the handle is empty; pass the handle returned by dispatch");
  require(h.state().owner == this, call.name,
          ": the handle belongs to another buffer or rank; pass the handle this buffer's dispatch returned");
  return h.state();
}

const HandleState& HostBackend::start_handle_call(const Call& call, const Handle& handle,
                                                  const std::function<std::string(const HandleState&)>& signature,
                                                  const std::function<void(const HandleState&)>& validate) {
  Mailbox mine;
  const HandleState* h = nullptr;
  try {
    h = &state_of(handle, call);
    mine.signature = cat(signature(*h), ", handle of dispatch #", h->dispatch_call);
    validate(*h);
  } catch (const Error& e) {
    mine.error = e.what();
  }
  exchange_plan(call, std::move(mine));  // throws on every rank if any rank's input was bad
  return *h;
}

void HostBackend::push_forward(const HandleState& h, int64_t row_bytes,
                               const std::function<void(int64_t, uint8_t*)>& encode) {
  const int64_t max_tokens = config().max_tokens_per_rank;
  std::vector<uint8_t> row(row_bytes);
  for (int64_t t = 0; t < h.tokens; ++t) {
    const int32_t* pos = &h.send_pos[t * ranks_];
    bool sent = false;
    for (int d = 0; d < ranks_; ++d) sent |= pos[d] >= 0;
    if (!sent) continue;
    encode(t, row.data());  // once per token, however many ranks it goes to
    for (int d = 0; d < ranks_; ++d)
      if (pos[d] >= 0)
        std::memcpy(&shared_->areas[d].fwd_payload[(rank_ * max_tokens + pos[d]) * fwd_row_bytes_], row.data(), row_bytes);
  }
}

const uint8_t* HostBackend::forward_payload(int64_t src_rank, int64_t pos) const {
  return &shared_->areas[rank_].fwd_payload[(src_rank * config().max_tokens_per_rank + pos) * fwd_row_bytes_];
}

void HostBackend::push_reverse(const HandleState& h, const WireRow& wire, bool rows, bool slots,
                               const std::function<void(int64_t, uint16_t*, float*)>& fill) {
  const int64_t max_tokens = config().max_tokens_per_rank, hidden = config().hidden, k = config().topk;
  std::vector<uint16_t> row(rows ? hidden : 0);
  std::vector<float> vals(slots ? k : 0);
  const RecvLayout& r = h.recv;
  for (int64_t i = 0; i < r.tokens; ++i) {
    const int s = r.src_rank[i];
    const int64_t at = rank_ * max_tokens + (i - r.rank_offsets[s]);
    fill(i, rows ? row.data() : nullptr, slots ? vals.data() : nullptr);
    RankArea& dst = shared_->areas[s];
    if (rows) encode_partial(wire, row.data(), &dst.rev_rows[at * 2 * hidden]);
    if (slots) std::memcpy(&dst.rev_slot_value[at * k], vals.data(), k * 4);
  }
}

Tensor HostBackend::sum_returned_rows(const HandleState& h, const WireRow& wire,
                                      const std::function<void(int64_t, float*)>& add_local) const {
  const RankArea& area = shared_->areas[rank_];
  const int64_t max_tokens = config().max_tokens_per_rank, hidden = config().hidden;
  Tensor out = Tensor::zeros_host(DType::bf16, {h.tokens, hidden});
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < h.tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < ranks_; ++d) {  // ranks in order
      const int32_t pos = h.send_pos[t * ranks_ + d];
      if (pos >= 0) add_partial(wire, &area.rev_rows[(d * max_tokens + pos) * 2 * hidden], acc.data());
    }
    add_local(t, acc.data());
    round_row(out.data<uint16_t>() + t * hidden, acc.data(), hidden);
  }
  return out;
}

Tensor HostBackend::gather_slot_values(const HandleState& h) const {
  const RankArea& area = shared_->areas[rank_];
  const int64_t max_tokens = config().max_tokens_per_rank, k_count = h.topk;
  Tensor out = Tensor::zeros_host(DType::f32, {h.tokens, k_count});
  for (int64_t t = 0; t < h.tokens; ++t)
    for (int64_t k = 0; k < k_count; ++k) {
      const int32_t e = h.slot_expert[t * k_count + k];
      if (e < 0) continue;  // unused or dropped: zero
      const int d = static_cast<int>(e / local_experts_);
      const int64_t pos = h.send_pos[t * ranks_ + d];
      out.data<float>()[t * k_count + k] = area.rev_slot_value[(d * max_tokens + pos) * k_count + k];
    }
  return out;
}

}  // namespace epx::detail
