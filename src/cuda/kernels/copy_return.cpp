// Copy-engine combine, the expert side: no kernel. At two ranks a blocking rank-major combine
// returns y's rows as they are (a source sums its rows from +0, so the bf16(0 + y) the SM path's
// returning warps write gives the same sums), and the rows of each source are contiguous in y, in
// the source's stream order, so the copy engines move them in a few large copies while every SM
// reduces (docs/performance.md).
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

void return_rows(const Ctx& ctx, cudaStream_t copies, const char* y, int64_t y_stride_bytes,
                 const std::vector<int64_t>& rank_offsets, const void* epoch) {
  const PeerWindows& w = ctx.peers;
  const WindowMap& m = ctx.map;
  const int64_t row_bytes = 2 * ctx.shape.hidden;
  for (int k = 1; k < w.ranks; ++k) {
    const int d = (w.rank + k) % w.ranks;
    const int64_t rows = rank_offsets[d + 1] - rank_offsets[d];
    for (int64_t first = 0, piece = 0; first < rows; first += m.piece_tokens, ++piece) {
      const int64_t n = std::min(m.piece_tokens, rows - first);
      const char* src = y + (rank_offsets[d] + first) * y_stride_bytes;
      char* dst = w.base[d] + m.rev_rows + (w.rank * ctx.shape.max_tokens + first) * row_bytes;
      if (y_stride_bytes == row_bytes)
        EPX_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(n * row_bytes), cudaMemcpyDefault, copies));
      else
        EPX_CUDA(cudaMemcpy2DAsync(dst, static_cast<size_t>(row_bytes), src, static_cast<size_t>(y_stride_bytes),
                                   static_cast<size_t>(row_bytes), static_cast<size_t>(n), cudaMemcpyDefault, copies));
      char* flag = w.base[d] + m.rev_piece_flag + (w.rank * kMaxPieces + piece) * sizeof(uint32_t);
      EPX_CUDA(cudaMemcpyAsync(flag, epoch, sizeof(uint32_t), cudaMemcpyDefault, copies));
    }
  }
}

}  // namespace epx::detail::kernels
