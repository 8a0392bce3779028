// How the CUDA backend cuts its copy-engine transfers (docs/performance.md): the combine's
// return into pieces by stream position, and a dispatch's own rows into runs, the entries of one
// batched copy. Plain host code (no CUDA), so the CPU tests check it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/kernels/device_types.hpp"

namespace epx::detail {

// start[0..kMaxPieces]: piece p holds stream positions [start[p], start[p + 1]), each start a
// multiple of kChunkTokens (but the last, max_tokens); entries past the last piece are max_tokens.
// Equal pieces of piece_tokens, or halving: 1/2, 1/4, 1/8, 1/16 and the rest (1/16) of max_tokens.
void return_piece_starts(int64_t max_tokens, int64_t piece_tokens, bool halving, int32_t* start);

// Tokens [token, token + count) of a rank's input to output rows [row, row + count).
struct RowRun {
  int64_t token, row, count;
};

// The first `count` tokens t < tokens with pos[t * ranks + rank] >= 0 (count < 0: all of them), their
// stream positions at `rank`, to output rows offset + pos, as maximal runs, cut where a run would
// cross a multiple of piece_tokens (> 0: the broadcast's pieces, which land one after another). The
// positions must be 0, 1, 2, ... in token order, as a stream's are. False (runs then unusable) when
// they are not, when fewer than count are found, or when a row falls outside [0, capacity).
bool cut_row_runs(const int32_t* pos, int64_t tokens, int ranks, int rank, int64_t count, int64_t offset,
                  int64_t capacity, int64_t piece_tokens, std::vector<RowRun>& runs);

}  // namespace epx::detail
