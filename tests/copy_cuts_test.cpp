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
  ASSERT_TRUE(cut_row_runs(pos.data(), 9, 2, 1, -1, 100, 1000, 0, runs));
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

TEST(CopyCuts, RunsStopAtThePiecesBoundaries) {
  const std::vector<bool> here(10, true);
  const auto pos = positions_at(1, 0, here);
  std::vector<RowRun> runs;
  ASSERT_TRUE(cut_row_runs(pos.data(), 10, 1, 0, -1, 0, 10, 4, runs));
  ASSERT_EQ(runs.size(), 3u);  // tokens 0..3, 4..7, 8..9: one run per piece of four
  EXPECT_EQ(runs[1].token, 4);
  EXPECT_EQ(runs[1].row, 4);
  EXPECT_EQ(runs[1].count, 4);
  EXPECT_EQ(runs[2].count, 2);
}

// A peer's positions as this rank reads them: its count's worth, then whatever an earlier call
// left in the rest of the array, which must not be read.
TEST(CopyCuts, APeersRunsEndAtItsCount) {
  std::vector<bool> here(12, true);
  here[2] = false;
  auto pos = positions_at(2, 0, here);
  pos[9 * 2] = 0;  // stale: tokens 9.. belong to an earlier call
  pos[10 * 2] = 1;
  std::vector<RowRun> runs;
  ASSERT_TRUE(cut_row_runs(pos.data(), 12, 2, 0, 8, 50, 100, 0, runs));
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[1].token, 3);
  EXPECT_EQ(runs[1].row, 52);
  EXPECT_EQ(runs[1].count, 6);  // tokens 3..8: the count ends it
}

TEST(CopyCuts, PositionsOutOfOrderTooFewOrOutsideTheOutputsRefuse) {
  std::vector<bool> alternate(20);
  for (size_t t = 0; t < alternate.size(); t += 2) alternate[t] = true;  // ten runs of one
  auto pos = positions_at(1, 0, alternate);
  std::vector<RowRun> runs;
  EXPECT_TRUE(cut_row_runs(pos.data(), 20, 1, 0, -1, 0, 10, 0, runs));
  EXPECT_EQ(runs.size(), 10u);
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, 11, 0, 10, 0, runs));  // ten found, eleven expected
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, -1, 1, 10, 0, runs));  // the last row would be 10
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, -1, -1, 10, 0, runs));  // an unwritten offset
  pos[4] = 3;  // token 4 says 3 where 2 is next
  EXPECT_FALSE(cut_row_runs(pos.data(), 20, 1, 0, -1, 0, 10, 0, runs));
  EXPECT_TRUE(cut_row_runs(pos.data(), 0, 1, 0, -1, 0, 0, 0, runs));  // no tokens: nothing to copy
  EXPECT_TRUE(runs.empty());
  EXPECT_TRUE(cut_row_runs(pos.data(), 20, 1, 0, 0, 0, 0, 0, runs));  // a count of zero: nothing read
  EXPECT_TRUE(runs.empty());
}

}  // namespace
}  // namespace epx::detail
