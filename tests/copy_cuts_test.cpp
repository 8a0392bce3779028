// The CUDA backend's cuts of its copy-engine return (src/cuda/copy_cuts.hpp): plain host code,
// checked here without a GPU.
#include "cuda/copy_cuts.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace epx::detail {
namespace {

std::vector<int32_t> starts(int64_t max_tokens, int64_t piece_tokens) {
  std::vector<int32_t> s(kMaxPieces + 1, -1);
  return_piece_starts(max_tokens, piece_tokens, s.data());
  return s;
}

TEST(CopyCuts, EqualPiecesAreTheBroadcastsPieces) {
  const auto s = starts(4096, 1024);
  const std::vector<int32_t> head{0, 1024, 2048, 3072, 4096};
  EXPECT_EQ(std::vector<int32_t>(s.begin(), s.begin() + 5), head);
  for (int p = 5; p <= kMaxPieces; ++p) EXPECT_EQ(s[p], 4096) << p;
}

TEST(CopyCuts, PiecesCoverEveryPositionOnceForAnySize) {
  for (int64_t m : {1, 7, 16, 17, 100, 1000, 4095, 4096, 16384}) {
    const int64_t piece = (m + 3) / 4;
    const auto s = starts(m, (piece + kChunkTokens - 1) / kChunkTokens * kChunkTokens);
    EXPECT_EQ(s[0], 0);
    EXPECT_EQ(s[kMaxPieces], m) << "max_tokens " << m;
    for (int p = 0; p < kMaxPieces; ++p) {
      EXPECT_LE(s[p], s[p + 1]);
      if (s[p + 1] < m) {
        EXPECT_EQ(s[p + 1] % kChunkTokens, 0) << "max_tokens " << m << " piece " << p;
      }
    }
  }
}

}  // namespace
}  // namespace epx::detail
