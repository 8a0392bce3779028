// The CUDA backend's cuts of its copy-engine transfers (src/cuda/copy_cuts.hpp): plain host
// code, checked here without a GPU.
#include "cuda/copy_cuts.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace epx::detail {
namespace {

std::vector<int32_t> starts(int64_t max_tokens, int64_t piece_tokens, bool halving) {
  std::vector<int32_t> s(kMaxPieces + 1, -1);
  return_piece_starts(max_tokens, piece_tokens, halving, s.data());
  return s;
}

TEST(CopyCuts, EqualPiecesAreTheBroadcastsPieces) {
  const auto s = starts(4096, 1024, false);
  const std::vector<int32_t> head{0, 1024, 2048, 3072, 4096};
  EXPECT_EQ(std::vector<int32_t>(s.begin(), s.begin() + 5), head);
  for (int p = 5; p <= kMaxPieces; ++p) EXPECT_EQ(s[p], 4096) << p;
}

TEST(CopyCuts, HalvingPiecesEndWithASixteenth) {
  const auto s = starts(4096, 1024, true);
  const std::vector<int32_t> head{0, 2048, 3072, 3584, 3840, 4096};
  EXPECT_EQ(std::vector<int32_t>(s.begin(), s.begin() + 6), head);
  for (int p = 6; p <= kMaxPieces; ++p) EXPECT_EQ(s[p], 4096) << p;
}

TEST(CopyCuts, PiecesCoverEveryPositionOnceForAnySize) {
  for (bool halving : {false, true})
    for (int64_t m : {1, 7, 16, 17, 100, 1000, 4095, 4096, 16384}) {
      const int64_t piece = (m + 3) / 4;
      const auto s = starts(m, (piece + kChunkTokens - 1) / kChunkTokens * kChunkTokens, halving);
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

// pos [T][R]: the stream position of token t at each rank, or -1.
std::vector<int32_t> positions_at(int ranks, int rank, const std::vector<bool>& here) {
  std::vector<int32_t> pos(here.size() * ranks, -1);
  int32_t next = 0;
  for (size_t t = 0; t < here.size(); ++t)
    if (here[t]) pos[t * ranks + rank] = next++;
  return pos;
}

TEST(CopyCuts, RunsSkipTheTokensThatGoElsewhere) {
  const std::vector<bool> here{true, true, false, true, true, true, false, false, true};
  const auto pos = positions_at(2, 1, here);
  std::vector<RowRun> runs;
  ASSERT_TRUE(cut_row_runs(pos.data(), 9, 2, 1, 100, 1000, 32, runs));
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].token, 0);
  EXPECT_EQ(runs[0].row, 100);
  EXPECT_EQ(runs[0].count, 2);
  EXPECT_EQ(runs[1].token, 3);
  EXPECT_EQ(runs[1].row, 102);
  EXPECT_EQ(runs[1].count, 3);
  EXPECT_EQ(runs[2].token, 8);
  EXPECT_EQ(runs[2].row, 105);
  EXPECT_EQ(runs[2].count, 1);
}

TEST(CopyCuts, TooManyRunsOrARowOutsideTheOutputsRefuse) {
  std::vector<bool> alternate(20);
  for (size_t t = 0; t < alternate.size(); t += 2) alternate[t] = true;  // ten runs of one
  const auto pos = positions_at(1, 0, alternate);
  std::vector<RowRun> runs;
  EXPECT_TRUE(cut_row_runs(pos.data(), 20, 1, 0, 0, 10, 10, runs));
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, 0, 10, 9, runs));   // ten runs, nine allowed
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, 1, 10, 10, runs));  // the last row would be 10
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, -1, 10, 10, runs));  // an unwritten offset
  EXPECT_TRUE(cut_row_runs(pos.data(), 0, 1, 0, 0, 0, 1, runs));  // no tokens: nothing to copy
  EXPECT_TRUE(runs.empty());
}

}  // namespace
}  // namespace epx::detail
