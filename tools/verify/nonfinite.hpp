// For the tests of non-finite input (docs/semantics.md, "Non-finite values"): NaNs and
// infinities put into a problem's inputs, the rows a stand-in expert returns (each received row
// dequantized), and the checks that they reach the combine outputs.
#pragma once
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "verify/reference.hpp"

namespace epx::verify {

struct BadValue {
  int rank;
  int64_t token, channel;
  uint16_t bits;  // bf16
};

inline bool bf16_nan(uint16_t b) { return (b & 0x7fffu) > 0x7f80u; }

// NaNs (with a payload, both signs) and infinities of both signs: at the first and the last
// channel, two in one quantization block, on ranks 0 and 1 (those of ranks a problem lacks, or of
// tokens past its count, are left out). Needs H >= 128.
inline std::vector<BadValue> bad_values(const Problem& p) {
  const int64_t h = p.cfg.hidden;
  return {{0, 1, 5, 0x7fa1}, {0, 2, h - 56, 0x7f80}, {0, 2, h - 55, 0xff80},
          {1, 0, 0, 0xff80}, {1, 3, h - 1, 0xffc0}, {1, 3, 17, 0x7f80}};
}

// Puts them into x; a pre-quantized problem gets them in its codes and scales instead: a NaN as
// the e4m3 NaN code of its sign, an infinity as its block's scale.
inline void put_bad_values(Problem& p, const std::vector<BadValue>& bad) {
  const int64_t h = p.cfg.hidden;
  for (const BadValue& b : bad) {
    if (b.rank >= p.ranks || b.token >= p.inputs[b.rank].tokens) continue;
    RankInput& in = p.inputs[b.rank];
    in.x[b.token * h + b.channel] = b.bits;
    if (!p.prequantized) continue;
    if (bf16_nan(b.bits)) in.x_fp8[b.token * h + b.channel] = (b.bits & 0x8000u) ? 0xff : 0x7f;
    else in.x_scales[b.token * (h / kFp8Block) + b.channel / kFp8Block] = bf16_to_float(b.bits);
  }
}

// Row i of a receive tensor seen as `rows` rows.
inline const uint8_t* row_bytes(const Tensor& t, int64_t rows, int64_t i) {
  return t.data<uint8_t>() + i * (t.numel() / rows * dtype_size(t.dtype()));
}

// Every received row (recv_x with its scales, host tensors, as `rows` rows of H channels)
// dequantized and rounded to bf16: what a stand-in expert returns.
inline std::vector<uint16_t> dequantized_rows(WireFormat wire, const Tensor& recv_x, const Tensor& recv_scales,
                                              const Tensor& recv_global_scale, int64_t rows, int64_t h) {
  std::vector<uint16_t> y(rows * h);
  std::vector<float> v(h);
  for (int64_t i = 0; i < rows; ++i) {
    if (wire == WireFormat::bf16) {
      std::memcpy(&y[i * h], row_bytes(recv_x, rows, i), 2 * h);
      continue;
    }
    if (wire == WireFormat::nvfp4) {
      float inv_g;
      std::memcpy(&inv_g, row_bytes(recv_global_scale, rows, i), 4);
      dequantize_nvfp4_row(row_bytes(recv_x, rows, i), row_bytes(recv_scales, rows, i), inv_g, h, v.data());
    } else {
      std::vector<float> s(h / kFp8Block);
      std::memcpy(s.data(), row_bytes(recv_scales, rows, i), s.size() * 4);
      dequantize_fp8_row(row_bytes(recv_x, rows, i), s.data(), h, v.data());
    }
    for (int64_t c = 0; c < h; ++c) y[i * h + c] = float_to_bf16(v[c]);
  }
  return y;
}

// The channels a bad value makes non-finite at the receiver: its own (bf16 wire; a pre-quantized
// NaN code), or its whole quantization block.
inline std::pair<int64_t, int64_t> spoiled_channels(const Problem& p, const BadValue& b) {
  int64_t width = 1;
  if (p.prequantized) width = bf16_nan(b.bits) ? 1 : kFp8Block;
  else if (p.cfg.wire == WireFormat::nvfp4) width = kNvfp4Block;
  else if (p.cfg.wire != WireFormat::bf16) width = kFp8Block;
  const int64_t first = b.channel / width * width;
  return {first, first + width};
}

// Empty when source rank s's combine output (bf16 [T, H]) is non-finite at every channel its bad
// values spoil, for tokens that count (t < counted) and were sent (a slot >= 0).
inline std::string check_reaches_output(const Problem& p, const std::vector<BadValue>& bad, int s, int64_t counted,
                                        const uint16_t* out) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  for (const BadValue& b : bad) {
    if (b.rank != s || b.token >= counted || b.token >= p.inputs[s].tokens) continue;
    bool sent = false;
    for (int64_t k = 0; k < k_count; ++k) sent |= p.inputs[s].idx[b.token * k_count + k] >= 0;
    if (!sent) continue;
    const auto [first, end] = spoiled_channels(p, b);
    for (int64_t c = first; c < end; ++c)
      if (std::isfinite(bf16_to_float(out[b.token * h + c])))
        return "rank " + std::to_string(s) + " out[" + std::to_string(b.token) + "][" + std::to_string(c) +
               "] is finite; the non-finite input at channel " + std::to_string(b.channel) + " did not reach it";
  }
  return {};
}

// compare_bits for bf16 arrays where any NaN matches any NaN (a combine's NaN bits are its
// backend's arithmetic's: the CUDA backend's are canonical).
inline std::string compare_bf16_nan_equal(const uint16_t* got, const uint16_t* want, int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i)
    if (got[i] != want[i] && !(bf16_nan(got[i]) && bf16_nan(want[i]))) return compare_bits(got + i, want + i, 1, 2, what + "[" + std::to_string(i) + "]");
  return {};
}

}  // namespace epx::verify
