// The wire number formats against hand-computed values and their error bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/wire.hpp"
#include "epx/codec.hpp"
#include "verify/random_inputs.hpp"

namespace epx {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(bits_float(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808001u)), 0x3f81);  // above tie
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(0x4049), 3.140625f);
}

TEST(E4m3, DecodesHandValues) {
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 0.001953125f);  // smallest subnormal 2^-9
  EXPECT_EQ(e4m3_to_float(0x08), 0.015625f);     // smallest normal 2^-6
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
}

TEST(E4m3, EveryFiniteCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    const uint8_t back = float_to_e4m3(v);
    if (v == 0.0f) {
      EXPECT_EQ(back & 0x7f, 0) << c;
    } else {
      EXPECT_EQ(back, c) << "code " << c << " value " << v;
    }
  }
}

TEST(E4m3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);   // halfway 1.0 / 1.125: even (1.0)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);   // halfway 1.125 / 1.25: even (1.25)
  EXPECT_EQ(float_to_e4m3(1.07f), 0x39);     // above halfway: 1.125
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7e);   // saturates to 448
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e4m3(0.0029296875f), 0x02);  // 1.5 * 2^-9: tie between subnormals 1 and 2, even (2)
  EXPECT_EQ(float_to_e4m3(0.0009765625f), 0x00);  // 0.5 * 2^-9: tie, even (0)
  EXPECT_EQ(float_to_e4m3(0.0152587890625f), 0x08);  // 7.8125 * 2^-9 rounds up into the first normal
  EXPECT_EQ(float_to_e4m3(NAN), 0x7f);
}

TEST(E2m1, RoundsToNearestEvenAndSaturates) {
  const float values[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(float_to_e2m1(values[c]), c);
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(c)), values[c]);
    if (c) {
      EXPECT_EQ(float_to_e2m1(-values[c]), c | 8);
    }
  }
  EXPECT_EQ(float_to_e2m1(0.25f), 0);   // tie 0 / 0.5: even code 0
  EXPECT_EQ(float_to_e2m1(0.75f), 2);   // tie 0.5 / 1: code 2
  EXPECT_EQ(float_to_e2m1(1.25f), 2);   // tie 1 / 1.5: code 2
  EXPECT_EQ(float_to_e2m1(1.75f), 4);
  EXPECT_EQ(float_to_e2m1(2.5f), 4);
  EXPECT_EQ(float_to_e2m1(3.5f), 6);
  EXPECT_EQ(float_to_e2m1(5.0f), 6);
  EXPECT_EQ(float_to_e2m1(5.1f), 7);
  EXPECT_EQ(float_to_e2m1(100.0f), 7);
  EXPECT_EQ(float_to_e2m1(-0.1f), 0);   // no negative zero
}

TEST(Fp8Block, HandComputedScaleAndCodes) {
  std::vector<uint16_t> x(128, float_to_bf16(0.5f));
  x[3] = float_to_bf16(-7.0f);  // amax 7 -> scale 7/448 = 1/64
  std::vector<uint8_t> q(128);
  float scale = 0.0f;
  quantize_fp8_row(x.data(), 128, false, q.data(), &scale);
  EXPECT_EQ(scale, 7.0f / 448.0f);
  EXPECT_EQ(q[3], 0xfe);                     // -448
  EXPECT_EQ(e4m3_to_float(q[0]), 32.0f);     // 0.5 * 64
  // UE8M0: 7/448 = 0.015625 exactly 2^-6, stays; 9/448 rounds up to 2^-5.
  quantize_fp8_row(x.data(), 128, true, q.data(), &scale);
  EXPECT_EQ(scale, 0.015625f);
  x[3] = float_to_bf16(9.0f);
  quantize_fp8_row(x.data(), 128, true, q.data(), &scale);
  EXPECT_EQ(scale, 0.03125f);
  EXPECT_EQ(e4m3_to_float(q[3]), 288.0f);   // 9 / 2^-5
}

TEST(Fp8Block, AllZeroBlockUsesTheAmaxFloor) {
  std::vector<uint16_t> x(128, 0);
  std::vector<uint8_t> q(128, 0xff);
  float scale = 0.0f;
  quantize_fp8_row(x.data(), 128, false, q.data(), &scale);
  EXPECT_EQ(scale, kAmaxFloor / 448.0f);
  for (uint8_t c : q) EXPECT_EQ(c, 0);
}

TEST(Fp8Block, RoundTripWithinFormatError) {
  for (bool ue8m0 : {false, true}) {
    const int64_t h = 1024;
    const auto x = verify::random_bf16(h, 7);
    std::vector<uint8_t> q(h);
    std::vector<float> s(h / 128), back(h);
    quantize_fp8_row(x.data(), h, ue8m0, q.data(), s.data());
    dequantize_fp8_row(q.data(), s.data(), h, back.data());
    for (int64_t i = 0; i < h; ++i) {
      const float v = bf16_to_float(x[i]);
      // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step.
      const float bound = std::fabs(v) * 0.0625f + s[i / 128] * 0.001953125f;
      EXPECT_LE(std::fabs(back[i] - v), bound) << "channel " << i << (ue8m0 ? " ue8m0" : "");
    }
  }
}

TEST(Nvfp4, HandComputedBlock) {
  // Row of 16: max 6 -> per-token g = 2688 / 6 = 448, block scale e4m3(6 * 448 / 6) = 448,
  // factor g / 448 = 1: codes are e2m1 of the values themselves.
  const float vals[16] = {6, -3, 1.5f, 0.5f, 0, 2, -4, 1, 0.25f, 0.75f, 5, -6, 3.5f, -1.25f, 0.1f, 2.5f};
  std::vector<uint16_t> x(16);
  for (int i = 0; i < 16; ++i) x[i] = float_to_bf16(vals[i]);
  uint8_t q[8], sc = 0;
  const float inv_g = quantize_nvfp4_row(x.data(), 16, 0.0f, q, &sc);
  EXPECT_EQ(inv_g, 1.0f / 448.0f);
  EXPECT_EQ(sc, 0x7e);
  const uint8_t want[16] = {7, 5 | 8, 3, 1, 0, 4, 6 | 8, 2, 0, 2, 6, 7 | 8, 6, 2 | 8, 0, 4};
  for (int i = 0; i < 16; ++i) EXPECT_EQ((q[i / 2] >> (4 * (i & 1))) & 0xf, want[i]) << i;
  float back[16];
  dequantize_nvfp4_row(q, &sc, inv_g, 16, back);
  EXPECT_FLOAT_EQ(back[0], 6.0f);  // 6 * 448 * (1/448): 1/448 is inexact in fp32
  EXPECT_FLOAT_EQ(back[1], -3.0f);
}

TEST(Nvfp4, GivenGlobalScaleAndRoundTrip) {
  const int64_t h = 256;
  const auto x = verify::random_bf16(h, 11);
  std::vector<uint8_t> q(h / 2), sc(h / 16);
  std::vector<float> back(h);
  float rowmax = 0.0f;
  for (auto b : x) rowmax = std::fmax(rowmax, std::fabs(bf16_to_float(b)));
  for (float gs : {0.0f, 2688.0f / rowmax, 100.0f}) {
    const float inv = quantize_nvfp4_row(x.data(), h, gs, q.data(), sc.data());
    if (gs > 0) {
      EXPECT_EQ(inv, 1.0f / gs);
    }
    dequantize_nvfp4_row(q.data(), sc.data(), inv, h, back.data());
    for (int64_t b = 0; b < h / 16; ++b) {
      float bmax = 0.0f;
      for (int i = 0; i < 16; ++i) bmax = std::fmax(bmax, std::fabs(bf16_to_float(x[b * 16 + i])));
      for (int i = 0; i < 16; ++i) {
        const float v = bf16_to_float(x[b * 16 + i]), err = std::fabs(back[b * 16 + i] - v);
        // e2m1 steps are at most 1/3 of the block max (4 -> 6 of 6), plus the e4m3 scale error.
        EXPECT_LE(err, bmax * (1.0f / 3.0f + 0.07f)) << "g " << gs << " channel " << b * 16 + i;
      }
    }
  }
}


// ---- non-finite values (docs/semantics.md, "Non-finite values") ----

constexpr uint16_t kBf16Nan = 0x7fc0, kBf16NegNan = 0xffc1, kBf16Inf = 0x7f80, kBf16NegInf = 0xff80;
constexpr uint16_t kNonFinite[] = {kBf16Nan, kBf16NegNan, kBf16Inf, kBf16NegInf};

TEST(NonFinite, ScalarHelpers) {
  EXPECT_TRUE(is_nonfinite(NAN));
  EXPECT_TRUE(is_nonfinite(-INFINITY));
  EXPECT_FALSE(is_nonfinite(3.4e38f));
  for (uint16_t b : kNonFinite) EXPECT_TRUE(bf16_is_nonfinite(b)) << b;
  EXPECT_FALSE(bf16_is_nonfinite(0x7f7f));  // the largest finite bf16
  // The block max keeps a NaN wherever it comes, and an infinity over every finite value.
  EXPECT_TRUE(std::isnan(max_abs_nonfinite(0.0f, NAN)));
  EXPECT_TRUE(std::isnan(max_abs_nonfinite(NAN, 5.0f)));
  EXPECT_EQ(max_abs_nonfinite(7.0f, -INFINITY), INFINITY);
  EXPECT_EQ(max_abs_nonfinite(INFINITY, 5.0f), INFINITY);
  EXPECT_EQ(max_abs_nonfinite(2.0f, -3.0f), 3.0f);
  EXPECT_EQ(max_abs_nonfinite(3.0f, -2.0f), 3.0f);
  // The finite max skips them.
  EXPECT_EQ(max_abs_finite(2.0f, NAN), 2.0f);
  EXPECT_EQ(max_abs_finite(2.0f, -INFINITY), 2.0f);
  EXPECT_EQ(max_abs_finite(2.0f, -3.0f), 3.0f);
  EXPECT_STREQ(nonfinite_name(bf16_to_float(kBf16NegNan)), "nan");
  EXPECT_STREQ(nonfinite_name(INFINITY), "inf");
  EXPECT_STREQ(nonfinite_name(-INFINITY), "-inf");
}

TEST(NonFinite, Fp8ScaleOfANonFiniteBlockIsNanInBothRoundings) {
  for (bool ue8m0 : {false, true}) {
    for (float amax : {NAN, -NAN, INFINITY}) {
      EXPECT_EQ(float_bits(fp8_scale(amax, ue8m0)), kNanScaleBits) << amax << (ue8m0 ? " ue8m0" : "");
    }
    EXPECT_EQ(fp8_scale(9.0f, ue8m0), ue8m0 ? 0.03125f : 9.0f / 448.0f);  // finite: as before
  }
  EXPECT_EQ(float_bits(fp8_scale(bf16_to_float(0x7f7f), true)), 0x7b800000u);  // the largest bf16: 2^120, finite
}

TEST(NonFinite, Fp8BlockWithNanOrInfIsNanAndTheOtherBlocksAreUnchanged) {
  const int64_t h = 384;  // 3 blocks; the bad value goes into block 1
  const auto clean = verify::random_bf16(h, 21);
  std::vector<uint8_t> want_q(h), q(h);
  std::vector<float> want_s(h / 128), s(h / 128), back(h);
  for (bool ue8m0 : {false, true}) {
    quantize_fp8_row(clean.data(), h, ue8m0, want_q.data(), want_s.data());
    for (uint16_t bad : kNonFinite)
      for (int at : {128, 133, 255}) {
        SCOPED_TRACE(testing::Message() << "bad 0x" << std::hex << bad << std::dec << " at " << at << (ue8m0 ? " ue8m0" : ""));
        auto x = clean;
        x[at] = bad;
        x[140] = float_to_bf16(1000.0f);  // a large finite value in the block, larger than the rest
        quantize_fp8_row(x.data(), h, ue8m0, q.data(), s.data());
        EXPECT_EQ(float_bits(s[1]), kNanScaleBits);
        for (int i = 128; i < 256; ++i) EXPECT_EQ(q[i], 0x7f) << i;
        for (int b : {0, 2}) {
          EXPECT_EQ(float_bits(s[b]), float_bits(want_s[b])) << "block " << b;
          for (int i = b * 128; i < (b + 1) * 128; ++i) ASSERT_EQ(q[i], want_q[i]) << i;
        }
        dequantize_fp8_row(q.data(), s.data(), h, back.data());
        for (int i = 128; i < 256; ++i) ASSERT_TRUE(std::isnan(back[i])) << i;
        for (int i : {0, 300}) EXPECT_TRUE(std::isfinite(back[i]));
      }
  }
}

TEST(NonFinite, Nvfp4BlockWithNanOrInfIsNanAndGlobalScaleSkipsIt) {
  const int64_t h = 64;  // 4 blocks; the bad value goes into block 2
  auto clean = verify::random_bf16(h, 23);
  clean[37] = float_to_bf16(-12.0f);  // the row's max |x|, in the bad block: it still counts for g
  std::vector<uint8_t> q(h / 2), sc(h / 16), want_q(h / 2), want_sc(h / 16);
  std::vector<float> back(h);
  for (float given : {0.0f, 100.0f}) {
    for (uint16_t bad : kNonFinite)
      for (int at : {32, 35, 47}) {
        SCOPED_TRACE(testing::Message() << "bad 0x" << std::hex << bad << std::dec << " at " << at << " g " << given);
        auto x = clean, absent = clean;
        x[at] = bad;
        absent[at] = 0;  // as if the non-finite value were not there
        const float inv = quantize_nvfp4_row(x.data(), h, given, q.data(), sc.data());
        const float want_inv = quantize_nvfp4_row(absent.data(), h, given, want_q.data(), want_sc.data());
        EXPECT_EQ(float_bits(inv), float_bits(want_inv));
        if (given == 0.0f) {
          EXPECT_EQ(inv, 1.0f / (2688.0f / 12.0f));
        }
        EXPECT_EQ(sc[2], 0x7f);
        for (int i = 16; i < 24; ++i) EXPECT_EQ(q[i], 0) << "code byte " << i;
        for (int b : {0, 1, 3}) {
          EXPECT_EQ(sc[b], want_sc[b]) << "block " << b;
          for (int i = b * 8; i < (b + 1) * 8; ++i) ASSERT_EQ(q[i], want_q[i]) << "code byte " << i;
        }
        dequantize_nvfp4_row(q.data(), sc.data(), inv, h, back.data());
        for (int i = 32; i < 48; ++i) ASSERT_TRUE(std::isnan(back[i])) << i;
        for (int i : {0, 20, 60}) EXPECT_TRUE(std::isfinite(back[i])) << i;
      }
  }
}

TEST(NonFinite, Nvfp4RowOfOnlyNonFiniteValues) {
  std::vector<uint16_t> x(32, kBf16Inf);
  x[20] = kBf16Nan;
  std::vector<uint8_t> q(16, 0xff), sc(2, 0);
  const float inv = quantize_nvfp4_row(x.data(), 32, 0.0f, q.data(), sc.data());
  EXPECT_EQ(inv, 1.0f / (2688.0f / kAmaxFloor));  // no finite value: the floor
  EXPECT_EQ(sc[0], 0x7f);
  EXPECT_EQ(sc[1], 0x7f);
  for (uint8_t c : q) EXPECT_EQ(c, 0);
}

// The wire rows dispatch sends (encode_row): bf16 bits as given, NaN payloads and infinities
// included; the quantized formats by the block rules above.
TEST(NonFinite, WireRowsOfEveryFormat) {
  const int64_t h = 256;
  auto x = verify::random_bf16(h, 29);
  x[3] = 0x7fa1;  // a NaN with a payload
  x[4] = kBf16NegNan;
  x[5] = kBf16Inf;
  x[6] = kBf16NegInf;
  DispatchInput in;
  in.x = TensorView::of(x.data(), DType::bf16, {1, h});
  for (WireFormat f : {WireFormat::bf16, WireFormat::fp8, WireFormat::fp8_ue8m0, WireFormat::nvfp4}) {
    SCOPED_TRACE(std::string(wire_name(f)));
    const detail::WireRow w = detail::wire_row(f, h);
    std::vector<uint8_t> row(w.bytes(), 0xa5);
    detail::encode_row(in, 0, w, 0.0f, row.data());
    if (f == WireFormat::bf16) {
      EXPECT_EQ(std::memcmp(row.data(), x.data(), 2 * h), 0);
    } else if (f == WireFormat::nvfp4) {
      EXPECT_EQ(row[h / 2], 0x7f);       // block 0 holds them
      EXPECT_NE(row[h / 2 + 1], 0x7f);   // block 1 does not
      for (int i = 0; i < 8; ++i) EXPECT_EQ(row[i], 0);
    } else {
      float s[2];
      std::memcpy(s, row.data() + h, 8);
      EXPECT_EQ(float_bits(s[0]), kNanScaleBits);
      EXPECT_TRUE(std::isfinite(s[1]));
      for (int i = 0; i < 128; ++i) EXPECT_EQ(row[i], 0x7f);
    }
  }
}

}  // namespace
}  // namespace epx
