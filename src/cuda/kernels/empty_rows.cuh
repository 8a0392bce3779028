// The output rows of a receive layout that hold no token: expert-major padding after each
// expert's rows, and (capacity mode) the rows past num_rows. Outputs must be zero there.
#pragma once
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

// Calls fn(row) for each such row this warp owns (rows strided by `warps` from `warp`).
template <typename Fn>
__device__ void for_each_empty_row(const Shape& s, const RecvArrays& r, Layout layout, int64_t warp, int64_t warps, Fn fn) {
  const int64_t capacity = r.info[2];
  if (layout == Layout::expert_major)  // segment -1: the shared expert's (RecvArrays)
    for (int64_t l = s.shared_expert ? -1 : 0; l < s.local_experts; ++l) {
      const int64_t end = min(r.expert_offsets[l + 1], capacity);
      for (int64_t row = r.expert_offsets[l] + r.tokens_per_expert[l] + warp; row < end; row += warps) fn(row);
    }
  for (int64_t row = r.info[1] + warp; row < capacity; row += warps) fn(row);
}

}  // namespace epx::detail::kernels
