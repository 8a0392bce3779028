#include "core/reduce.hpp"

#include <algorithm>
#include <cmath>

#include "epx/codec.hpp"

namespace epx::detail {

namespace {

// The lane order of dot_bf16, generic over the fused multiply-add used.
// p[l] += p[l ^ o] for o = 16, 8, 4, 2, 1 (a warp's xor-shuffle reduction); every lane ends
// with the same value because fp32 addition is commutative.
float butterfly_sum(float* lane) {
  for (int o = 16; o >= 1; o /= 2) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ o];
    for (int l = 0; l < 32; ++l) lane[l] = next[l];
  }
  return lane[0];
}

// Hardware fma where the CPU has it (fast, vectorised); std::fma (correct, slow) elsewhere.
// Both round once, so the results are identical.
#if defined(__x86_64__) && defined(__GNUC__)
#define EPX_FMA_TARGET __attribute__((target("fma")))
// The loops are spelled out here: a generic helper compiled without the target could not
// inline the instruction and would pay a call per element.
EPX_FMA_TARGET void fma_row_hw(float* acc, float w, const uint16_t* y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] = __builtin_fmaf(w, bf16_to_float(y[h]), acc[h]);
}
EPX_FMA_TARGET float dot_hw(const uint16_t* a, const uint16_t* b, int64_t n) {
  float lane[32] = {};
  for (int64_t c = 0; c * 8 < n; ++c) {  // 8-channel chunk c belongs to lane c % 32
    float& p = lane[c % 32];
    for (int64_t h = c * 8; h < std::min<int64_t>(n, c * 8 + 8); ++h) p = __builtin_fmaf(bf16_to_float(a[h]), bf16_to_float(b[h]), p);
  }
  return butterfly_sum(lane);
}
bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("fma");
  return has;
}
#else
void fma_row_hw(float*, float, const uint16_t*, int64_t) {}
float dot_hw(const uint16_t*, const uint16_t*, int64_t) { return 0.0f; }
bool cpu_has_fma() { return false; }
#endif

}  // namespace

void fma_row(float* acc, float w, const uint16_t* y, int64_t hidden) {
  if (cpu_has_fma()) return fma_row_hw(acc, w, y, hidden);
  for (int64_t h = 0; h < hidden; ++h) acc[h] = std::fma(w, bf16_to_float(y[h]), acc[h]);
}

void add_row(float* acc, const uint16_t* y, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) acc[h] += bf16_to_float(y[h]);
}

void round_row(uint16_t* out, const float* acc, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) out[h] = float_to_bf16(acc[h]);
}

void scale_row(uint16_t* out, float w, const uint16_t* y, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) out[h] = float_to_bf16(w * bf16_to_float(y[h]));
}

float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t hidden) {
  if (cpu_has_fma()) return dot_hw(a, b, hidden);
  float lane[32] = {};
  for (int64_t c = 0; c * 8 < hidden; ++c) {
    float& p = lane[c % 32];
    for (int64_t h = c * 8; h < std::min<int64_t>(hidden, c * 8 + 8); ++h) p = std::fma(bf16_to_float(a[h]), bf16_to_float(b[h]), p);
  }
  return butterfly_sum(lane);
}

}  // namespace epx::detail
