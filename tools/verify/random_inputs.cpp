#include "verify/random_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>

namespace epx::verify {

namespace {
TensorView view2(const void* p, DType t, int64_t rows, int64_t cols) {
  return TensorView::of(const_cast<void*>(p), t, {rows, cols});
}
}  // namespace

DispatchInput RankInput::view(int64_t hidden, int64_t topk) const {
  DispatchInput in;
  if (!x_fp8.empty()) {
    in.x = view2(x_fp8.data(), DType::fp8_e4m3, tokens, hidden);
    in.x_scales = view2(x_scales.data(), DType::f32, tokens, hidden / kFp8Block);
  } else {
    in.x = view2(x.data(), DType::bf16, tokens, hidden);
  }
  in.topk_idx = view2(idx.data(), DType::i32, tokens, topk);
  if (has_weights) in.topk_weights = view2(weights.data(), DType::f32, tokens, topk);
  if (!shared_gate.empty()) in.shared_gate = TensorView::of(const_cast<float*>(shared_gate.data()), DType::f32, {tokens});
  return in;
}

std::vector<uint16_t> random_bf16(int64_t count, uint64_t seed, bool exact_values) {
  std::mt19937_64 rng(seed);
  // log2 of the magnitude: a wide range, so that fp32 sums round and their order shows.
  std::uniform_real_distribution<float> mag(-16.0f, 2.0f);
  std::vector<uint16_t> v(count);
  for (auto& b : v) {
    float f = std::exp2(mag(rng));
    if (rng() & 1) f = -f;
    uint16_t bits = float_to_bf16(f);
    if (exact_values) bits &= 0xfff8;  // keep 4 significant bits (1 implicit + 3 stored)
    b = bits;
  }
  return v;
}

namespace {

// Pre-quantized input: x as fp8 codes and scales (the wire's own quantizer).
void quantize_x(RankInput& in, int64_t hidden) {
  in.x_fp8.resize(in.tokens * hidden);
  in.x_scales.resize(in.tokens * (hidden / kFp8Block));
  for (int64_t t = 0; t < in.tokens; ++t)
    quantize_fp8_row(&in.x[t * hidden], hidden, false, &in.x_fp8[t * hidden], &in.x_scales[t * (hidden / kFp8Block)]);
}

}  // namespace

Problem make_problem(const ProblemSpec& spec) {
  Problem p{spec.cfg, spec.ranks, spec.prequantized, {}, {}};
  const BufferConfig& c = spec.cfg;
  std::mt19937_64 rng(spec.seed * 0x9e3779b97f4a7c15ull + 12345);
  // Skewed routing: expert e drawn with weight 1 / (e + 1); uniform: all equal.
  std::vector<double> expert_weight(c.num_experts);
  for (int64_t e = 0; e < c.num_experts; ++e)
    expert_weight[e] = spec.routing == Routing::skewed ? 1.0 / static_cast<double>(e + 1) : 1.0;
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);

  for (int r = 0; r < spec.ranks; ++r) {
    RankInput in;
    in.tokens = spec.tokens.empty() ? c.max_tokens_per_rank : spec.tokens[r];
    in.x = random_bf16(in.tokens * c.hidden, spec.seed * 1000 + r, spec.exact_values);
    in.idx.assign(in.tokens * c.topk, -1);
    in.weights.assign(in.tokens * c.topk, 0.0f);
    for (int64_t t = 0; t < in.tokens; ++t) {
      // K distinct experts, without replacement, in random slot order.
      std::vector<double> left(expert_weight);
      for (int64_t k = 0; k < c.topk; ++k) {
        std::discrete_distribution<int64_t> pick(left.begin(), left.end());
        const int64_t e = pick(rng);
        left[e] = 0.0;
        if (unit(rng) < spec.unused_slot_fraction) continue;
        in.idx[t * c.topk + k] = static_cast<int32_t>(e);
        in.weights[t * c.topk + k] = weight(rng);
      }
    }
    if (spec.prequantized) quantize_x(in, c.hidden);
    p.inputs.push_back(std::move(in));
  }
  return p;
}

Problem with_fresh_x(const Problem& p, uint64_t seed) {
  Problem fresh = p;
  for (int r = 0; r < p.ranks; ++r) {
    RankInput& in = fresh.inputs[r];
    in.x = random_bf16(in.tokens * p.cfg.hidden, seed * 1000 + r);
    if (p.prequantized) quantize_x(in, p.cfg.hidden);
  }
  return fresh;
}

DenseRouting dense_routing(const Problem& p) {
  const int64_t e_count = p.cfg.num_experts, k_count = p.cfg.topk;
  DenseRouting d{std::vector<std::vector<uint8_t>>(p.ranks), std::vector<std::vector<float>>(p.ranks), p};
  for (int r = 0; r < p.ranks; ++r) {
    const RankInput& in = p.inputs[r];
    RankInput& sorted = d.sorted.inputs[r];
    d.maps[r].assign(in.tokens * e_count, 0);
    d.probs[r].assign(in.tokens * e_count, 0.0f);
    for (int64_t t = 0; t < in.tokens; ++t) {
      std::map<int32_t, float> chosen;  // ascending expert ids
      for (int64_t k = 0; k < k_count; ++k)
        if (in.idx[t * k_count + k] >= 0) chosen[in.idx[t * k_count + k]] = in.weights[t * k_count + k];
      int64_t k = 0;
      for (const auto& [e, w] : chosen) {
        d.maps[r][t * e_count + e] = 1;
        d.probs[r][t * e_count + e] = w;
        sorted.idx[t * k_count + k] = e;
        sorted.weights[t * k_count + k] = w;
        ++k;
      }
      for (; k < k_count; ++k) sorted.idx[t * k_count + k] = -1, sorted.weights[t * k_count + k] = 0.0f;
    }
  }
  return d;
}

}  // namespace epx::verify
