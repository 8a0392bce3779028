// The receive layout (expert-major or rank-major) and the send plan: pure host arithmetic
// shared by all backends.
#include "core/handle.hpp"

namespace epx::detail {

void plan_receive_layout(RecvLayout& r, int64_t local_experts, int64_t topk, int64_t alignment,
                         int64_t capacity_rows) {
  // Segments in row order: the shared expert's first (when on), then the local experts.
  const int64_t first = r.shared_expert ? 1 : 0;  // segment of local expert 0
  r.tokens_per_expert.assign(first + local_experts, 0);
  if (r.shared_expert) r.tokens_per_expert[0] = r.shared_tokens;
  for (int32_t l : r.slot_expert)
    if (l >= 0) ++r.tokens_per_expert[first + l];
  r.slot_row.assign(r.slot_expert.size(), -1);

  if (r.layout == Layout::rank_major) {
    r.expert_offsets.clear();
    r.num_rows = r.tokens;
    for (int64_t i = 0; i < r.tokens; ++i)
      for (int64_t k = 0; k < topk; ++k)
        if (r.slot_expert[i * topk + k] >= 0) r.slot_row[i * topk + k] = i;
  } else {
    const size_t segments = r.tokens_per_expert.size();
    r.expert_offsets.assign(segments + 1, 0);
    for (size_t s = 0; s < segments; ++s) {
      const int64_t padded = (r.tokens_per_expert[s] + alignment - 1) / alignment * alignment;
      r.expert_offsets[s + 1] = r.expert_offsets[s] + padded;
    }
    r.num_rows = r.expert_offsets[segments];
    // Rows arrive in (source rank, source token) order and a token holds an expert at most
    // once, so filling each segment in arrival order gives the specified order.
    std::vector<int64_t> fill(r.expert_offsets.begin() + first, r.expert_offsets.end() - 1);
    for (int64_t i = 0; i < r.tokens; ++i)
      for (int64_t k = 0; k < topk; ++k) {
        const int32_t l = r.slot_expert[i * topk + k];
        if (l >= 0) r.slot_row[i * topk + k] = fill[l]++;
      }
  }
  r.capacity = capacity_rows > 0 ? capacity_rows : r.num_rows;
}

void plan_send(HandleState& h, int64_t local_experts) {
  h.send_pos.assign(h.tokens * h.ranks, -1);
  h.sent_rows.assign(h.ranks, 0);
  for (int64_t t = 0; t < h.tokens; ++t) {
    for (int64_t k = 0; k < h.topk; ++k) {
      const int32_t e = h.slot_expert[t * h.topk + k];
      if (e < 0) continue;
      const int64_t d = e / local_experts;
      if (h.send_pos[t * h.ranks + d] < 0) h.send_pos[t * h.ranks + d] = static_cast<int32_t>(h.sent_rows[d]++);
    }
  }
}

}  // namespace epx::detail
