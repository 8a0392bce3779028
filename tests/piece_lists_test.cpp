// The copy-engine transfers' piece lists (kernels::broadcast_pieces, kernels::return_pieces): plain
// host code that only computes addresses, checked here without a GPU on made-up window addresses.
// The copy calls follow these lists.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/copy_cuts.hpp"
#include "cuda/kernels/launch.hpp"

namespace epx::detail::kernels {
namespace {

// Rank `rank` of `ranks`, windows 1 GiB apart, pieces of 64 tokens (max_tokens 200: four pieces,
// the last of 8), hidden 16 (rows of 32 bytes), top-2.
Ctx made_up_ctx(int rank, int ranks) {
  Ctx c{};
  for (int d = 0; d < ranks; ++d) c.peers.base[d] = reinterpret_cast<char*>((d + 1) * (int64_t{1} << 30));
  c.peers.rank = rank;
  c.peers.ranks = ranks;
  c.shape.rank = rank;
  c.shape.ranks = ranks;
  c.shape.hidden = 16;
  c.shape.topk = 2;
  c.shape.max_tokens = 200;
  c.map.bcast_rows = 0x1000;
  c.map.bcast_stride = 32;
  c.map.piece_tokens = 64;
  c.map.bcast_flag = 0x100;
  c.map.bcast_epoch_src = 0x80;
  c.map.rev_rows = 0x2000000;
  c.map.rev_slots = 0x3000000;
  c.map.rev_piece_flag = 0x200;
  return_piece_starts(c.shape.max_tokens, c.map.piece_tokens, c.map.return_start);
  return c;
}

TEST(PieceLists, TheBroadcastSendsEveryRowToEveryOtherRankOncePieceByPiece) {
  const Ctx c = made_up_ctx(1, 3);
  const char* x = reinterpret_cast<const char*>(int64_t{1} << 40);
  const auto pieces = broadcast_pieces(c, x, 32, 32, 150, 0, kMaxPieces);
  ASSERT_EQ(pieces.size(), 6u);  // 150 tokens: pieces of 64, 64, 22, each to ranks 2 and 0
  int64_t rows_to[3] = {0, 0, 0};
  for (size_t i = 0; i < pieces.size(); ++i) {
    const FlaggedPiece& p = pieces[i];
    const int d = i % 2 == 0 ? 2 : 0;
    const int64_t piece = static_cast<int64_t>(i / 2), first = piece * 64;
    ASSERT_EQ(p.parts, 1);
    EXPECT_EQ(p.part[0].src, x + first * 32);
    EXPECT_EQ(p.part[0].dst, c.peers.base[d] + 0x1000 + (1 * 200 + first) * 32);  // this rank's rows there
    EXPECT_EQ(p.part[0].rows, piece < 2 ? 64 : 22);
    EXPECT_EQ(p.flag, c.peers.base[d] + 0x100 + (1 * kMaxPieces + piece) * 4);
    EXPECT_EQ(p.epoch, c.peers.base[1] + 0x80);  // from this rank's window
    rows_to[d] += p.part[0].rows;
  }
  EXPECT_EQ(rows_to[0], 150);
  EXPECT_EQ(rows_to[1], 0);
  EXPECT_EQ(rows_to[2], 150);
  // The same pieces in two goes, as a lean dispatch enqueues them.
  auto first_two = broadcast_pieces(c, x, 32, 32, 150, 0, 2);
  const auto rest = broadcast_pieces(c, x, 32, 32, 150, 2, kMaxPieces);
  first_two.insert(first_two.end(), rest.begin(), rest.end());
  ASSERT_EQ(first_two.size(), pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(first_two[i].part[0].dst, pieces[i].part[0].dst) << i;
    EXPECT_EQ(first_two[i].part[0].src, pieces[i].part[0].src) << i;
    EXPECT_EQ(first_two[i].part[0].rows, pieces[i].part[0].rows) << i;
    EXPECT_EQ(first_two[i].flag, pieces[i].flag) << i;
  }
  EXPECT_TRUE(broadcast_pieces(c, x, 32, 32, 0, 0, kMaxPieces).empty());  // no tokens: nothing sent, nothing flagged
}

TEST(PieceLists, TheReturnSendsEachRanksRowsBackWithTheirSlotsWhenGiven) {
  const Ctx c = made_up_ctx(0, 2);
  const std::vector<int64_t> rank_offsets{0, 70, 200};  // 70 rows came from rank 0 itself, 130 from rank 1
  const char* y = reinterpret_cast<const char*>(int64_t{1} << 40);
  const char* slots = reinterpret_cast<const char*>(int64_t{1} << 41);
  const char* epoch = reinterpret_cast<const char*>(int64_t{1} << 42);
  for (const bool with_slots : {false, true}) {
    const ReturnRows rows{y, 40, with_slots ? slots : nullptr, with_slots ? 12 : 0};  // strided y and slots
    const auto pieces = return_pieces(c, rows, rank_offsets, epoch);
    ASSERT_EQ(pieces.size(), 3u);  // rank 1's 130 rows: stream positions [0, 64), [64, 128), [128, 130)
    int64_t rows_back = 0;
    for (size_t q = 0; q < pieces.size(); ++q) {
      const FlaggedPiece& p = pieces[q];
      const int64_t first = c.map.return_start[q];
      ASSERT_EQ(p.parts, with_slots ? 2 : 1);
      EXPECT_EQ(p.part[0].src, y + (70 + first) * 40);
      EXPECT_EQ(p.part[0].src_stride, 40);
      EXPECT_EQ(p.part[0].dst, c.peers.base[1] + 0x2000000 + first * 32);  // rank 0's rows at rank 1
      EXPECT_EQ(p.part[0].row_bytes, 32);
      if (with_slots) {
        EXPECT_EQ(p.part[1].src, slots + (70 + first) * 12);
        EXPECT_EQ(p.part[1].dst, c.peers.base[1] + 0x3000000 + first * 8);
        EXPECT_EQ(p.part[1].rows, p.part[0].rows);
      }
      EXPECT_EQ(p.flag, c.peers.base[1] + 0x200 + q * 4);
      EXPECT_EQ(p.epoch, epoch);
      rows_back += p.part[0].rows;
    }
    EXPECT_EQ(rows_back, 130);
  }
}

}  // namespace
}  // namespace epx::detail::kernels
