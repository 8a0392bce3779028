#include "cuda/copy_cuts.hpp"

#include <algorithm>

namespace epx::detail {

void return_piece_starts(int64_t max_tokens, int64_t piece_tokens, int32_t* start) {
  int64_t at = 0;
  for (int p = 0; p <= kMaxPieces; ++p) {
    start[p] = static_cast<int32_t>(std::min(at, max_tokens));
    at += std::max<int64_t>(1, (piece_tokens + kChunkTokens - 1) / kChunkTokens * kChunkTokens);
  }
}

}  // namespace epx::detail
