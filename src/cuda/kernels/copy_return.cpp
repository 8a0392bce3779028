// Copy-engine return, the expert side of combine and dispatch_backward. At two ranks a blocking
// rank-major call returns y's rows as they are (a source sums its rows from +0, so the bf16(0 + y)
// the SM path's returning warps write gives the same sums) and the slot values as they are (the SM
// path zeroes those of other ranks' experts, which the source never reads); an expert-major call
// returns the partials reduce_partials summed into a rank-major buffer (combine.cu). The rows of
// each source are contiguous there, in the source's stream order, so the copy engines move them in
// a few large copies while every SM reduces (docs/lab/2026-12-01-performance-diary.md).
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {

void copy_rows(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t row_bytes, int64_t n,
               cudaStream_t copies) {
  if (src_stride == row_bytes && dst_stride == row_bytes)  // one block: the cheaper call
    EPX_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(n * row_bytes), cudaMemcpyDefault, copies));
  else
    EPX_CUDA(cudaMemcpy2DAsync(dst, static_cast<size_t>(dst_stride), src, static_cast<size_t>(src_stride),
                               static_cast<size_t>(row_bytes), static_cast<size_t>(n), cudaMemcpyDefault, copies));
}

void copy_pieces(const std::vector<FlaggedPiece>& pieces, cudaStream_t copies) {
  for (const FlaggedPiece& p : pieces) {
    for (int i = 0; i < p.parts; ++i) {
      const FlaggedPiece::Part& c = p.part[i];
      copy_rows(c.dst, c.dst_stride, c.src, c.src_stride, c.row_bytes, c.rows, copies);
    }
    EPX_CUDA(cudaMemcpyAsync(p.flag, p.epoch, sizeof(uint32_t), cudaMemcpyDefault, copies));
  }
}

std::vector<FlaggedPiece> return_pieces(const Ctx& ctx, const ReturnRows& rows, const std::vector<int64_t>& rank_offsets,
                                        const void* epoch) {
  const PeerWindows& w = ctx.peers;
  const WindowMap& m = ctx.map;
  const int64_t row_bytes = 2 * ctx.shape.hidden, slot_bytes = 4 * ctx.shape.topk;
  std::vector<FlaggedPiece> pieces;
  for (int k = 1; k < w.ranks; ++k) {
    const int d = (w.rank + k) % w.ranks;
    const int64_t count = rank_offsets[d + 1] - rank_offsets[d];
    for (int piece = 0; piece < kMaxPieces && m.return_start[piece] < count; ++piece) {
      const int64_t first = m.return_start[piece];
      const int64_t n = std::min<int64_t>(m.return_start[piece + 1], count) - first, row = rank_offsets[d] + first;
      const int64_t at = w.rank * ctx.shape.max_tokens + first;  // the first row's place at d
      FlaggedPiece p{};
      p.part[0] = {w.base[d] + m.rev_rows + at * row_bytes, row_bytes, rows.y + row * rows.y_stride_bytes,
                   rows.y_stride_bytes, row_bytes, n};
      p.parts = 1;
      if (rows.slot_values)
        p.part[p.parts++] = {w.base[d] + m.rev_slots + at * slot_bytes, slot_bytes,
                             rows.slot_values + row * rows.slot_stride_bytes, rows.slot_stride_bytes, slot_bytes, n};
      p.flag = w.base[d] + m.rev_piece_flag + (w.rank * kMaxPieces + piece) * sizeof(uint32_t);
      p.epoch = static_cast<const char*>(epoch);
      pieces.push_back(p);
    }
  }
  return pieces;
}

}  // namespace epx::detail::kernels
