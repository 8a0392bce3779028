// How the CUDA backend cuts the combine's copy-engine return into pieces by stream position
// (docs/lab/2026-12-01-performance-diary.md). Plain host code (no CUDA), so the CPU tests check
// it.
#pragma once
#include <cstdint>

#include "cuda/kernels/device_types.hpp"

namespace epx::detail {

// start[0..kMaxPieces]: piece p holds stream positions [start[p], start[p + 1]), each start a
// multiple of kChunkTokens (but the last, max_tokens); entries past the last piece are max_tokens.
// Equal pieces of piece_tokens: the broadcast's.
void return_piece_starts(int64_t max_tokens, int64_t piece_tokens, int32_t* start);

}  // namespace epx::detail
