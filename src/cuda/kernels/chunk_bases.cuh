// Where a chunk's tokens or pairs of each column start among this rank's (ChunkPositions): the
// base of the plan kernel's block that owns the chunk plus the chunk's place among that block's
// chunks (route.cu scans each block's chunks, then the blocks).
#pragma once
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

struct ChunkBases {
  const int32_t* in_block;  // chunk_base's row of the chunk
  const int32_t* block;     // block_base's row of its block
  __device__ int32_t operator[](int64_t col) const { return in_block[col] + block[col]; }
};

__device__ inline ChunkBases chunk_bases(const ChunkPositions& p, int64_t width, int64_t chunk) {
  return {p.chunk_base + chunk * width, p.block_base + chunk / p.chunks_per_block * width};
}

}  // namespace epx::detail::kernels
