#include "cuda/copy_cuts.hpp"

#include <algorithm>

namespace epx::detail {

void return_piece_starts(int64_t max_tokens, int64_t piece_tokens, bool halving, int32_t* start) {
  int64_t at = 0;
  for (int p = 0; p <= kMaxPieces; ++p) {
    start[p] = static_cast<int32_t>(std::min(at, max_tokens));
    const int64_t left = max_tokens - at;
    const int64_t size = halving ? (p < 4 ? (left + 1) / 2 : left) : piece_tokens;
    at += std::max<int64_t>(1, (size + kChunkTokens - 1) / kChunkTokens * kChunkTokens);
  }
}

bool cut_row_runs(const int32_t* pos, int64_t tokens, int ranks, int rank, int64_t count, int64_t offset,
                  int64_t capacity, int64_t piece_tokens, std::vector<RowRun>& runs) {
  runs.clear();
  int64_t found = 0;
  for (int64_t t = 0; t < tokens && found != count; ++t) {
    const int32_t p = pos[t * ranks + rank];
    if (p < 0) continue;
    const int64_t row = offset + p;
    if (p != found++ || row < 0 || row >= capacity) return false;
    const bool joins = !runs.empty() && runs.back().token + runs.back().count == t &&
                       (piece_tokens <= 0 || t % piece_tokens != 0);
    if (joins) ++runs.back().count;
    else runs.push_back({t, row, 1});
  }
  return count < 0 || found == count;
}

}  // namespace epx::detail
