// HandleState: everything dispatch learned that combine and the backward passes reuse.
// Backend-free; a device backend keeps a device copy of the same arrays.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "epx/config.hpp"

namespace epx::detail {

// Where the rows this rank received sit in its dispatch output.
struct RecvLayout {
  Layout layout = Layout::expert_major;
  int64_t tokens = 0;                    // M: rows received, one per (source token, this rank)
  std::vector<int64_t> rank_offsets;     // [R+1] first received row of each source rank
  std::vector<int32_t> src_rank;         // [M]
  std::vector<int32_t> src_token;        // [M]
  std::vector<int32_t> slot_expert;      // [M*K] local expert of the source's slot k, -1 if not on this rank
  std::vector<float> slot_weight;        // [M*K] router weight of that slot
  std::vector<int64_t> slot_row;         // [M*K] output row holding the slot, -1 if none
  // BufferConfig::shared_expert: segment 0 holds this rank's own tokens, so shared row t is row t.
  bool shared_expert = false;
  int64_t shared_tokens = 0;             // rows of the shared segment before padding: this rank's T
  std::vector<int64_t> expert_offsets;   // [L+1] padded offsets (expert-major only); shared: [L+2]
  std::vector<int64_t> tokens_per_expert;  // [L]; shared: [L+1], the shared segment first
  int64_t num_rows = 0;                  // output rows the layout needs
  int64_t capacity = 0;                  // output rows allocated
  bool overflow() const { return num_rows > capacity; }
};

// What a device backend keeps of a dispatch beside the backend-free state (its device arrays);
// each backend derives its own and reads it back through that type.
struct BackendPayload {
  virtual ~BackendPayload() = default;
};

struct HandleState {
  const void* owner = nullptr;  // the backend instance that made it
  // The number of the dispatch call that made it (the buffer's call count then). Every call on a
  // handle puts it in the options its ranks must agree on: ranks passing handles of different
  // dispatches (even with identical routing) fail with config_mismatch instead of mixing layouts.
  int64_t dispatch_call = -1;
  Layout layout = Layout::expert_major;
  int rank = 0;
  int ranks = 0;
  int64_t tokens = 0;  // T of this rank's dispatch
  int64_t topk = 0;
  int64_t hidden = 0;
  bool has_weights = false;

  // Source side: this rank's tokens.
  std::vector<int32_t> slot_expert;  // [T*K] global expert after drops, -1 unused
  std::vector<float> slot_weight;    // [T*K]
  std::vector<int32_t> send_pos;     // [T*R] row of token t in the stream to rank d, -1 if not sent
  std::vector<int64_t> sent_rows;    // [R] tokens sent to each rank
  std::vector<float> shared_weight;  // [T] shared_expert: weight of token t's shared row (its gate, or 1)
  bool has_shared_gate = false;      // dispatch was given shared_gate (combine_backward returns its gradient)

  RecvLayout recv;  // receiver side (the CPU backend fills all of it; CUDA only layout and capacity)

  std::shared_ptr<const BackendPayload> device;  // a device backend's copy of the arrays above
};

// A dispatch's handle state as every backend starts it: who made it, in which call, its layout
// and this rank's shape (tokens, and whether the dispatch was given router weights).
inline std::shared_ptr<HandleState> new_handle_state(const void* owner, int64_t dispatch_call, Layout layout, int rank,
                                                     int ranks, int64_t tokens, const BufferConfig& c,
                                                     bool has_weights) {
  auto h = std::make_shared<HandleState>();
  h->owner = owner;
  h->dispatch_call = dispatch_call;
  h->layout = layout;
  h->rank = rank;
  h->ranks = ranks;
  h->tokens = tokens;
  h->topk = c.topk;
  h->hidden = c.hidden;
  h->has_weights = has_weights;
  h->recv.layout = layout;
  return h;
}

// Fills slot_row, expert_offsets, tokens_per_expert, num_rows and capacity of `r` from its
// received rows (src_*, slot_expert and the shared_* fields already set). capacity_rows <= 0
// means blocking (exact).
void plan_receive_layout(RecvLayout& r, int64_t local_experts, int64_t topk, int64_t alignment,
                         int64_t capacity_rows);

// For the source side: which of this rank's tokens go to which rank, given its final routing.
void plan_send(HandleState& h, int64_t local_experts);

}  // namespace epx::detail
