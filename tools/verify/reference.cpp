#include "verify/reference.hpp"

#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <unordered_map>

namespace epx::verify {

namespace {

int64_t local_experts(const Problem& p) { return p.cfg.num_experts / p.ranks; }

int64_t capacity_of(const Problem& p, const Expected& e) {
  return p.cfg.mode == CapacityMode::capacity ? p.cfg.capacity_rows : static_cast<int64_t>(e.rows.size());
}

float weight_of(const RankInput& in, int64_t i) { return in.has_weights ? in.weights[i] : 1.0f; }
float shared_gate_of(const RankInput& in, int64_t t) { return in.shared_gate.empty() ? 1.0f : in.shared_gate[t]; }

// (source rank, token, local expert, -1 or kSharedExpert) -> row, for one receiving rank's layout.
struct RowIndex {
  std::unordered_map<int64_t, int64_t> rows;
  static int64_t key(int64_t s, int64_t t, int64_t l) { return (s << 40) | (t << 12) | (l + 2); }
  explicit RowIndex(const Expected& e) {
    for (size_t i = 0; i < e.rows.size(); ++i)
      if (e.rows[i].src_rank >= 0)
        rows[key(e.rows[i].src_rank, e.rows[i].src_token, e.rows[i].local_expert)] = static_cast<int64_t>(i);
  }
  int64_t find(int64_t s, int64_t t, int64_t l) const {
    auto it = rows.find(key(s, t, l));
    return it == rows.end() ? -1 : it->second;
  }
};

// The documented encoders, naively: per block, a block holding a NaN or an infinity is written
// as the rules for non-finite values say (fp8: scale the fp32 NaN 0x7fc00000, codes 0x7f; nvfp4:
// scale 0x7f, codes 0; the nvfp4 per-token global scale from the row's finite values only), any
// other block from the scalar formulas.
bool block_is_finite(const uint16_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(bf16_to_float(x[i]))) return false;
  return true;
}

void fp8_row(const uint16_t* x, int64_t h, bool ue8m0, uint8_t* q, float* scales) {
  for (int64_t b = 0; b < h / kFp8Block; ++b) {
    const uint16_t* xb = x + b * kFp8Block;
    if (!block_is_finite(xb, kFp8Block)) {
      const uint32_t nan = 0x7fc00000u;
      std::memcpy(&scales[b], &nan, 4);
      std::memset(q + b * kFp8Block, 0x7f, kFp8Block);
      continue;
    }
    float amax = 0.0f;
    for (int64_t i = 0; i < kFp8Block; ++i) amax = std::fmax(amax, std::fabs(bf16_to_float(xb[i])));
    scales[b] = fp8_scale(amax, ue8m0);
    const float inv = 1.0f / scales[b];
    for (int64_t i = 0; i < kFp8Block; ++i) q[b * kFp8Block + i] = float_to_e4m3(bf16_to_float(xb[i]) * inv);
  }
}

// The combine wire, naively (docs/semantics.md, "Combine wire"): the fp32 partial of one (token,
// rank) rounded to bf16, then for fp8 quantized per 128-channel block with the dispatch wire's
// encoder above and dequantized as code * scale; the values the source adds, channel by channel.
std::vector<float> after_combine_wire(const std::vector<float>& partial, WireFormat wire) {
  const int64_t h = static_cast<int64_t>(partial.size());
  std::vector<uint16_t> row(h);
  for (int64_t c = 0; c < h; ++c) row[c] = float_to_bf16(partial[c]);
  std::vector<float> back(h);
  if (wire == WireFormat::bf16) {
    for (int64_t c = 0; c < h; ++c) back[c] = bf16_to_float(row[c]);
    return back;
  }
  std::vector<uint8_t> q(h);
  std::vector<float> scales(h / kFp8Block);
  fp8_row(row.data(), h, wire == WireFormat::fp8_ue8m0, q.data(), scales.data());
  for (int64_t c = 0; c < h; ++c) back[c] = e4m3_to_float(q[c]) * scales[c / kFp8Block];
  return back;
}

float nvfp4_row(const uint16_t* x, int64_t h, float given, uint8_t* q, uint8_t* scales) {
  float rowmax = 0.0f;
  for (int64_t i = 0; i < h; ++i)
    if (std::isfinite(bf16_to_float(x[i]))) rowmax = std::fmax(rowmax, std::fabs(bf16_to_float(x[i])));
  const float g = given > 0.0f ? given : nvfp4_token_global_scale(rowmax);
  std::memset(q, 0, h / 2);
  for (int64_t b = 0; b < h / kNvfp4Block; ++b) {
    const uint16_t* xb = x + b * kNvfp4Block;
    if (!block_is_finite(xb, kNvfp4Block)) {
      scales[b] = 0x7f;  // codes stay 0
      continue;
    }
    float bmax = 0.0f;
    for (int64_t i = 0; i < kNvfp4Block; ++i) bmax = std::fmax(bmax, std::fabs(bf16_to_float(xb[i])));
    scales[b] = nvfp4_block_scale(bmax, g);
    const float f = nvfp4_encode_factor(scales[b], g);
    for (int64_t i = 0; i < kNvfp4Block; ++i)
      q[(b * kNvfp4Block + i) / 2] |= static_cast<uint8_t>(float_to_e2m1(bf16_to_float(xb[i]) * f) << (4 * (i & 1)));
  }
  return 1.0f / g;
}

// Wire bytes of token t of rank s: x codes, scales, global scale (as dispatch must deliver them).
struct Encoded {
  std::vector<uint8_t> x, scales, global;
};

Encoded encode(const Problem& p, int s, int64_t t, float nvfp4_gs) {
  const int64_t h = p.cfg.hidden;
  const RankInput& in = p.inputs[s];
  const uint16_t* x = &in.x[t * h];
  Encoded e;
  switch (p.cfg.wire) {
    case WireFormat::bf16:
      e.x.assign(reinterpret_cast<const uint8_t*>(x), reinterpret_cast<const uint8_t*>(x + h));
      break;
    case WireFormat::fp8:
    case WireFormat::fp8_ue8m0: {
      std::vector<float> sc(h / kFp8Block);
      e.x.resize(h);
      if (p.prequantized) {
        std::memcpy(e.x.data(), &in.x_fp8[t * h], h);
        std::memcpy(sc.data(), &in.x_scales[t * (h / kFp8Block)], sc.size() * 4);
      } else {
        fp8_row(x, h, p.cfg.wire == WireFormat::fp8_ue8m0, e.x.data(), sc.data());
      }
      e.scales.resize(sc.size() * 4);
      std::memcpy(e.scales.data(), sc.data(), e.scales.size());
      break;
    }
    case WireFormat::nvfp4: {
      e.x.resize(h / 2);
      e.scales.resize(h / kNvfp4Block);
      const float inv = nvfp4_row(x, h, nvfp4_gs, e.x.data(), e.scales.data());
      e.global.resize(4);
      std::memcpy(e.global.data(), &inv, 4);
      break;
    }
  }
  return e;
}

// A padding row: every byte zero.
Encoded padding_row(const Problem& p) {
  const int64_t h = p.cfg.hidden;
  Encoded e;
  switch (p.cfg.wire) {
    case WireFormat::bf16: e.x.assign(2 * h, 0); break;
    case WireFormat::fp8:
    case WireFormat::fp8_ue8m0:
      e.x.assign(h, 0);
      e.scales.assign(4 * (h / kFp8Block), 0);
      break;
    case WireFormat::nvfp4:
      e.x.assign(h / 2, 0);
      e.scales.assign(h / kNvfp4Block, 0);
      e.global.assign(4, 0);
      break;
  }
  return e;
}

template <typename T>
std::string compare_vec(const Tensor& got, const std::vector<T>& want, const std::string& what) {
  if (!got.defined()) return what + ": missing";
  if (got.numel() != static_cast<int64_t>(want.size()))
    return what + ": " + std::to_string(got.numel()) + " elements, want " + std::to_string(want.size());
  return compare_bits(got.data<T>(), want.data(), static_cast<int64_t>(want.size()), sizeof(T), what);
}

// Row `row` of t seen as `rows` rows (HT: dimension 0; low-latency: experts x slots).
std::string check_bytes_row(const Tensor& t, int64_t rows, int64_t row, const std::vector<uint8_t>& want,
                            const std::string& what) {
  if (want.empty()) return {};
  if (!t.defined()) return what + ": missing";
  const int64_t row_bytes = t.numel() / rows * dtype_size(t.dtype());
  if (row_bytes != static_cast<int64_t>(want.size()))
    return what + ": row of " + std::to_string(row_bytes) + " bytes, want " + std::to_string(want.size());
  return compare_bits(t.data<uint8_t>() + row * row_bytes, want.data(), row_bytes, 1,
                      what + "[row " + std::to_string(row) + "]");
}

}  // namespace

// The documented dot order: 32 lanes over 8-channel chunks, then a butterfly.
float lane_dot(const uint16_t* a, const uint16_t* b, int64_t n) {
  float lane[32] = {};
  for (int64_t h = 0; h < n; ++h)
    lane[(h / 8) % 32] = std::fma(bf16_to_float(a[h]), bf16_to_float(b[h]), lane[(h / 8) % 32]);
  for (int o = 16; o >= 1; o /= 2) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lane[l] + lane[l ^ o];
    std::memcpy(lane, next, sizeof lane);
  }
  return lane[0];
}

std::string compare_bits(const void* got, const void* want, int64_t count, int64_t elem_size, const std::string& what) {
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* w = static_cast<const uint8_t*>(want);
  for (int64_t i = 0; i < count; ++i) {
    if (std::memcmp(g + i * elem_size, w + i * elem_size, elem_size) == 0) continue;
    std::ostringstream os;
    os << what << "[" << i << "]: got 0x" << std::hex;
    for (int64_t b = elem_size - 1; b >= 0; --b) os << static_cast<int>(g[i * elem_size + b]) / 16 << static_cast<int>(g[i * elem_size + b]) % 16;
    os << ", want 0x";
    for (int64_t b = elem_size - 1; b >= 0; --b) os << static_cast<int>(w[i * elem_size + b]) / 16 << static_cast<int>(w[i * elem_size + b]) % 16;
    return os.str();
  }
  return {};
}

std::vector<std::vector<int32_t>> kept_routing(const Problem& p) {
  std::vector<std::vector<int32_t>> kept(p.ranks);
  for (int s = 0; s < p.ranks; ++s) kept[s] = p.inputs[s].idx;
  if (p.cfg.capacity_factor <= 0.0) return kept;
  int64_t total = 0;
  for (const auto& in : p.inputs) total += in.tokens;
  const auto cap = static_cast<int64_t>(
      std::ceil(p.cfg.capacity_factor * static_cast<double>(total * p.cfg.topk) / static_cast<double>(p.cfg.num_experts)));
  std::vector<int64_t> seen(p.cfg.num_experts, 0);
  for (int s = 0; s < p.ranks; ++s)  // global (source rank, token, slot) order
    for (auto& e : kept[s])
      if (e >= 0 && seen[e]++ >= cap) e = -1;
  return kept;
}

Expected expected_dispatch(const Problem& p, const std::vector<std::vector<int32_t>>& kept, int rank, Layout layout) {
  const int64_t k_count = p.cfg.topk, l_count = local_experts(p);
  Expected x;
  x.tokens_per_expert.assign(l_count, 0);
  x.rank_offsets.assign(p.ranks + 1, 0);
  for (int s = 0; s < p.ranks; ++s) {
    const RankInput& in = p.inputs[s];
    int64_t tokens_here = 0;
    for (int64_t t = 0; t < in.tokens; ++t) {
      bool here = false;
      for (int64_t k = 0; k < k_count; ++k) {
        const int32_t e = kept[s][t * k_count + k];
        if (e >= 0 && e / l_count == rank) {
          here = true;
          ++x.tokens_per_expert[e % l_count];
        }
      }
      tokens_here += here;
      if (!here || layout != Layout::rank_major) continue;
      x.rows.push_back({s, static_cast<int32_t>(t), -1, 0.0f});
      for (int64_t k = 0; k < k_count; ++k) {
        const int32_t e = kept[s][t * k_count + k];
        const bool on = e >= 0 && e / l_count == rank;
        x.topk_idx.push_back(on ? static_cast<int32_t>(e % l_count) : -1);
        x.topk_weights.push_back(on ? weight_of(in, t * k_count + k) : 0.0f);
      }
    }
    x.rank_offsets[s + 1] = x.rank_offsets[s] + tokens_here;
  }
  if (layout == Layout::rank_major) return x;

  // Each segment: its rows, then padding rows to the alignment.
  x.expert_offsets.assign(1, 0);
  auto close_segment = [&] {
    while (static_cast<int64_t>(x.rows.size()) % p.cfg.expert_alignment != 0) x.rows.push_back({});
    x.expert_offsets.push_back(static_cast<int64_t>(x.rows.size()));
  };
  if (p.cfg.shared_expert) {  // segment 0: this rank's own tokens, in token order
    const RankInput& own = p.inputs[rank];
    for (int64_t t = 0; t < own.tokens; ++t)
      x.rows.push_back({rank, static_cast<int32_t>(t), kSharedExpert, shared_gate_of(own, t)});
    close_segment();
    x.tokens_per_expert.insert(x.tokens_per_expert.begin(), own.tokens);
  }
  for (int64_t l = 0; l < l_count; ++l) {
    const int32_t e = static_cast<int32_t>(rank * l_count + l);
    for (int s = 0; s < p.ranks; ++s)
      for (int64_t t = 0; t < p.inputs[s].tokens; ++t)
        for (int64_t k = 0; k < k_count; ++k)
          if (kept[s][t * k_count + k] == e)
            x.rows.push_back({s, static_cast<int32_t>(t), static_cast<int32_t>(l), weight_of(p.inputs[s], t * k_count + k)});
    close_segment();
  }
  return x;
}

DispatchResult host_copy(const DispatchResult& d, const std::function<Tensor(const Tensor&)>& copy) {
  DispatchResult h = d;
  h.handle = Handle();
  for (Tensor* t : {&h.recv_x, &h.recv_scales, &h.recv_global_scale, &h.recv_src, &h.recv_weights, &h.recv_topk_idx,
                    &h.recv_topk_weights, &h.expert_offsets, &h.tokens_per_expert, &h.rank_offsets, &h.recv_info,
                    &h.topk_physical})
    *t = copy(*t);
  if (h.num_rows < 0) {
    const int64_t* info = h.recv_info.data<int64_t>();  // rows received, num_rows, allocated, overflow
    h.num_rows = info[1];
    h.overflow = info[3] != 0;
  }
  return h;
}

std::string check_dispatch(const Problem& p, const std::vector<std::vector<int32_t>>& kept, int rank, Layout layout,
                           float nvfp4_global_scale, const DispatchResult& got) {
  const Expected x = expected_dispatch(p, kept, rank, layout);
  const std::string at = "rank " + std::to_string(rank) + " ";
  const int64_t n = static_cast<int64_t>(x.rows.size()), cap = capacity_of(p, x), k_count = p.cfg.topk;
  if (got.num_rows != n) return at + "num_rows " + std::to_string(got.num_rows) + ", want " + std::to_string(n);
  if (got.overflow != (n > cap)) return at + "overflow flag wrong";
  if (!got.recv_x.defined() || got.recv_x.size(0) != cap)
    return at + "recv_x has " + (got.recv_x.defined() ? std::to_string(got.recv_x.size(0)) : "no") + " rows, want " +
           std::to_string(cap);
  std::string err;
  if (!(err = compare_vec(got.tokens_per_expert, x.tokens_per_expert, at + "tokens_per_expert")).empty()) return err;
  if (!(err = compare_vec(got.rank_offsets, x.rank_offsets, at + "rank_offsets")).empty()) return err;
  if (layout == Layout::expert_major &&
      !(err = compare_vec(got.expert_offsets, x.expert_offsets, at + "expert_offsets")).empty())
    return err;

  for (int64_t i = 0; i < std::min(n, cap); ++i) {
    const ExpectedRow& row = x.rows[i];
    const std::string where = at + "row " + std::to_string(i);
    const Encoded want = row.src_rank >= 0 ? encode(p, row.src_rank, row.src_token, nvfp4_global_scale) : padding_row(p);
    if (!(err = check_bytes_row(got.recv_x, got.recv_x.size(0), i, want.x, at + "recv_x")).empty()) return err;
    if (!(err = check_bytes_row(got.recv_scales, got.recv_x.size(0), i, want.scales, at + "recv_scales")).empty()) return err;
    if (!(err = check_bytes_row(got.recv_global_scale, got.recv_x.size(0), i, want.global, at + "recv_global_scale")).empty()) return err;
    const int32_t src[2] = {row.src_rank, row.src_token};
    if (!(err = compare_bits(got.recv_src.data<int32_t>() + 2 * i, src, 2, 4, where + " recv_src")).empty()) return err;
    if (layout == Layout::expert_major) {
      if (!(err = compare_bits(got.recv_weights.data<float>() + i, &row.weight, 1, 4, where + " recv_weights")).empty())
        return err;
    } else {
      if (!(err = compare_bits(got.recv_topk_idx.data<int32_t>() + i * k_count, &x.topk_idx[i * k_count], k_count, 4,
                               where + " recv_topk_idx")).empty())
        return err;
      if (!(err = compare_bits(got.recv_topk_weights.data<float>() + i * k_count, &x.topk_weights[i * k_count], k_count,
                               4, where + " recv_topk_weights")).empty())
        return err;
    }
  }
  // Capacity mode: rows past num_rows hold no token (zero bytes, source -1, no slots).
  const Encoded empty = padding_row(p);
  const std::vector<int32_t> no_slots(k_count, -1);
  const std::vector<float> no_weights(k_count, 0.0f);
  for (int64_t i = n; i < cap; ++i) {
    const std::string where = at + "empty row " + std::to_string(i);
    if (!(err = check_bytes_row(got.recv_x, got.recv_x.size(0), i, empty.x, where + " recv_x")).empty()) return err;
    if (!(err = check_bytes_row(got.recv_scales, got.recv_x.size(0), i, empty.scales, where + " recv_scales")).empty())
      return err;
    if (!(err = check_bytes_row(got.recv_global_scale, got.recv_x.size(0), i, empty.global, where + " recv_global_scale"))
             .empty())
      return err;
    const int32_t src[2] = {-1, -1};
    if (!(err = compare_bits(got.recv_src.data<int32_t>() + 2 * i, src, 2, 4, where + " recv_src")).empty()) return err;
    if (layout == Layout::expert_major) {
      const float zero = 0.0f;
      if (!(err = compare_bits(got.recv_weights.data<float>() + i, &zero, 1, 4, where + " recv_weights")).empty())
        return err;
    } else {
      if (!(err = compare_bits(got.recv_topk_idx.data<int32_t>() + i * k_count, no_slots.data(), k_count, 4,
                               where + " recv_topk_idx")).empty())
        return err;
      if (!(err = compare_bits(got.recv_topk_weights.data<float>() + i * k_count, no_weights.data(), k_count, 4,
                               where + " recv_topk_weights")).empty())
        return err;
    }
  }
  return {};
}

namespace {
// Combine's sums with the partials crossing back in `wire`: combine's own, or bf16 for
// dispatch_backward.
std::vector<uint16_t> combine_over(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                   const std::vector<Expected>& layouts, const std::vector<std::vector<uint16_t>>& y, int s,
                                   Layout layout, bool weighted, const std::vector<uint16_t>* shared, WireFormat wire) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk, l_count = local_experts(p);
  const RankInput& in = p.inputs[s];
  std::vector<RowIndex> index;
  for (const auto& l : layouts) index.emplace_back(l);
  std::vector<uint16_t> out(in.tokens * h);
  std::vector<float> partial(h), total(h);
  for (int64_t t = 0; t < in.tokens; ++t) {
    std::fill(total.begin(), total.end(), 0.0f);
    for (int d = 0; d < p.ranks; ++d) {
      std::fill(partial.begin(), partial.end(), 0.0f);
      const int64_t cap = capacity_of(p, layouts[d]);
      bool sent = false;
      for (int64_t k = 0; k < k_count; ++k) {
        const int32_t e = kept[s][t * k_count + k];
        if (e < 0 || e / l_count != d) continue;
        sent = true;
        if (layout == Layout::rank_major) continue;
        const int64_t row = index[d].find(s, t, e % l_count);
        if (row < 0 || row >= cap) continue;  // lost to overflow
        const float w = weight_of(in, t * k_count + k);
        for (int64_t c = 0; c < h; ++c) {
          const float v = bf16_to_float(y[d][row * h + c]);
          partial[c] = weighted ? std::fma(w, v, partial[c]) : partial[c] + v;
        }
      }
      if (!sent) continue;
      if (layout == Layout::rank_major) {  // the caller already reduced the token's local experts
        const int64_t row = index[d].find(s, t, -1);
        if (row >= 0 && row < cap)
          for (int64_t c = 0; c < h; ++c) partial[c] = bf16_to_float(y[d][row * h + c]);
      }
      const std::vector<float> back = after_combine_wire(partial, wire);
      for (int64_t c = 0; c < h; ++c) total[c] += back[c];
    }
    // The shared expert: this rank's own row of t, after the ranks, unrounded, with its gate.
    const int64_t shared_row = p.cfg.shared_expert ? index[s].find(s, t, kSharedExpert) : -1;
    if (shared_row >= 0 && shared_row < capacity_of(p, layouts[s])) {
      const float g = shared_gate_of(in, t);
      for (int64_t c = 0; c < h; ++c) {
        const float v = bf16_to_float(y[s][shared_row * h + c]);
        total[c] = weighted ? std::fma(g, v, total[c]) : total[c] + v;
      }
    }
    if (shared)
      for (int64_t c = 0; c < h; ++c) total[c] += bf16_to_float((*shared)[t * h + c]);
    for (int64_t c = 0; c < h; ++c) out[t * h + c] = float_to_bf16(total[c]);
  }
  return out;
}
}  // namespace

std::vector<uint16_t> expected_combine(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                       const std::vector<Expected>& layouts, const std::vector<std::vector<uint16_t>>& y,
                                       int s, Layout layout, bool weighted, const std::vector<uint16_t>* shared) {
  return combine_over(p, kept, layouts, y, s, layout, weighted, shared, p.cfg.combine_wire);
}

std::vector<uint16_t> expected_grad_x(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                      const std::vector<Expected>& layouts,
                                      const std::vector<std::vector<uint16_t>>& grad_recv_x, int s, Layout layout) {
  return combine_over(p, kept, layouts, grad_recv_x, s, layout, false, nullptr, WireFormat::bf16);
}

std::vector<uint16_t> expected_grad_y(const Problem& p, const Expected& layout,
                                      const std::vector<std::vector<uint16_t>>& grad_out, bool weighted) {
  const int64_t h = p.cfg.hidden, cap = capacity_of(p, layout);
  std::vector<uint16_t> g(cap * h, 0);
  for (int64_t i = 0; i < std::min<int64_t>(cap, layout.rows.size()); ++i) {
    const ExpectedRow& row = layout.rows[i];
    if (row.src_rank < 0) continue;
    const uint16_t* src = &grad_out[row.src_rank][row.src_token * h];
    for (int64_t c = 0; c < h; ++c)
      g[i * h + c] = weighted ? float_to_bf16(row.weight * bf16_to_float(src[c])) : src[c];
  }
  return g;
}

namespace {
// Calls fn(t, k, d, row) for every kept slot of source rank s whose row on expert rank d exists
// (not lost to overflow). Rank-major rows are looked up per token.
template <typename Fn>
void for_each_slot_row(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                       const std::vector<Expected>& layouts, int s, Layout layout, Fn&& fn) {
  const int64_t k_count = p.cfg.topk, l_count = local_experts(p);
  std::vector<RowIndex> index;
  for (const auto& l : layouts) index.emplace_back(l);
  for (int64_t t = 0; t < p.inputs[s].tokens; ++t)
    for (int64_t k = 0; k < k_count; ++k) {
      const int32_t e = kept[s][t * k_count + k];
      if (e < 0) continue;
      const int d = static_cast<int>(e / l_count);
      const int64_t row = index[d].find(s, t, layout == Layout::rank_major ? -1 : e % l_count);
      if (row >= 0 && row < capacity_of(p, layouts[d])) fn(t, k, d, row);
    }
}
}  // namespace

std::vector<float> expected_grad_w(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                   const std::vector<Expected>& layouts, const std::vector<std::vector<uint16_t>>& grad_out,
                                   const std::vector<std::vector<uint16_t>>& y, int s) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk;
  std::vector<float> gw(p.inputs[s].tokens * k_count, 0.0f);
  for_each_slot_row(p, kept, layouts, s, Layout::expert_major, [&](int64_t t, int64_t k, int d, int64_t row) {
    gw[t * k_count + k] = lane_dot(&grad_out[s][t * h], &y[d][row * h], h);
  });
  return gw;
}

std::vector<float> expected_shared_gate_grad(const Problem& p, const Expected& layout, int s,
                                             const std::function<float(int64_t row)>& value_at) {
  std::vector<float> g(p.inputs[s].tokens, 0.0f);
  for (int64_t i = 0; i < std::min<int64_t>(capacity_of(p, layout), layout.rows.size()); ++i)
    if (layout.rows[i].local_expert == kSharedExpert) g[layout.rows[i].src_token] = value_at(i);
  return g;
}

std::vector<float> expected_gathered_weights(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                             const std::vector<Expected>& layouts,
                                             const std::vector<std::vector<float>>& grad_recv_weights, int s,
                                             Layout layout) {
  const int64_t k_count = p.cfg.topk;
  std::vector<float> gw(p.inputs[s].tokens * k_count, 0.0f);
  for_each_slot_row(p, kept, layouts, s, layout, [&](int64_t t, int64_t k, int d, int64_t row) {
    gw[t * k_count + k] = layout == Layout::rank_major ? grad_recv_weights[d][row * k_count + k] : grad_recv_weights[d][row];
  });
  return gw;
}

namespace {
// Rows of local expert l on rank d in the low-latency layout: (source rank, token), in order.
std::vector<std::pair<int, int64_t>> ll_rows(const Problem& p, const std::vector<int64_t>& num_tokens, int d, int64_t l) {
  const int64_t e = d * local_experts(p) + l, k_count = p.cfg.topk;
  std::vector<std::pair<int, int64_t>> rows;
  for (int s = 0; s < p.ranks; ++s)
    for (int64_t t = 0; t < num_tokens[s]; ++t)
      for (int64_t k = 0; k < k_count; ++k)
        if (p.inputs[s].idx[t * k_count + k] == e) rows.emplace_back(s, t);
  return rows;
}
}  // namespace

std::string check_ll_dispatch(const Problem& p, const std::vector<int64_t>& num_tokens, int rank, float nvfp4_global_scale,
                              const LowLatencyDispatchResult& got) {
  // With the shared expert, output expert 0 holds this rank's own rows t < num_tokens, in order.
  const int64_t first = p.cfg.shared_expert ? 1 : 0, segments = first + local_experts(p);
  const int64_t slots = p.ranks * p.cfg.max_tokens_per_rank;
  const std::string at = "rank " + std::to_string(rank) + " ";
  if (!got.recv_x.defined() || got.recv_x.numel() / got.recv_x.size(got.recv_x.view().ndim - 1) != segments * slots)
    return at + (first ? "recv_x is not [1 + L, R*M, ...]" : "recv_x is not [L, R*M, ...]");
  const Encoded zero = padding_row(p);
  std::string err;
  for (int64_t o = 0; o < segments; ++o) {
    std::vector<std::pair<int, int64_t>> rows;
    if (o < first)
      for (int64_t t = 0; t < num_tokens[rank]; ++t) rows.emplace_back(rank, t);
    else
      rows = ll_rows(p, num_tokens, rank, o - first);
    const std::string ex = at + (o < first ? std::string("shared expert ") : "expert " + std::to_string(o - first) + " ");
    if (got.recv_count.data<int32_t>()[o] != static_cast<int32_t>(rows.size()))
      return ex + "count " + std::to_string(got.recv_count.data<int32_t>()[o]) + ", want " + std::to_string(rows.size());
    int64_t begin = 0;
    for (int s = 0; s < p.ranks; ++s) {
      int64_t n = 0;
      for (const auto& r : rows) n += r.first == s;
      const int32_t want[2] = {static_cast<int32_t>(begin), static_cast<int32_t>(n)};
      if (!(err = compare_bits(got.recv_layout.data<int32_t>() + (o * p.ranks + s) * 2, want, 2, 4, ex + "recv_layout")).empty())
        return err;
      begin += n;
    }
    for (int64_t j = 0; j < slots; ++j) {
      const int64_t row = o * slots + j;
      const bool real = j < static_cast<int64_t>(rows.size());
      const Encoded want = real ? encode(p, rows[j].first, rows[j].second, nvfp4_global_scale) : zero;
      if (!(err = check_bytes_row(got.recv_x, segments * slots, row, want.x, ex + "recv_x")).empty()) return err;
      if (!(err = check_bytes_row(got.recv_scales, segments * slots, row, want.scales, ex + "recv_scales")).empty()) return err;
      if (!(err = check_bytes_row(got.recv_global_scale, segments * slots, row, want.global, ex + "recv_global_scale")).empty()) return err;
      const int32_t src[2] = {real ? rows[j].first : -1, real ? static_cast<int32_t>(rows[j].second) : -1};
      if (!(err = compare_bits(got.recv_src.data<int32_t>() + 2 * row, src, 2, 4, ex + "recv_src")).empty()) return err;
    }
  }
  return {};
}

std::vector<uint16_t> expected_ll_combine(const Problem& p, const std::vector<int64_t>& num_tokens,
                                          const std::vector<std::vector<uint16_t>>& y, int s, bool weighted) {
  const int64_t h = p.cfg.hidden, k_count = p.cfg.topk, l_count = local_experts(p), slots = p.ranks * p.cfg.max_tokens_per_rank;
  const int64_t first = p.cfg.shared_expert ? 1 : 0;  // y's expert 0: the shared one
  const RankInput& in = p.inputs[s];
  std::vector<uint16_t> out(in.tokens * h, 0);
  std::vector<float> acc(h);
  std::vector<float> partial(h);
  for (int64_t t = 0; t < num_tokens[s]; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < p.ranks; ++d) {  // each expert rank's partial, ranks in order
      bool any = false;
      std::fill(partial.begin(), partial.end(), 0.0f);
      for (int64_t k = 0; k < k_count; ++k) {  // its slots in slot order
        const int32_t e = in.idx[t * k_count + k];
        if (e < 0 || e / l_count != d) continue;
        any = true;
        const auto rows = ll_rows(p, num_tokens, d, e % l_count);
        int64_t j = 0;
        while (rows[j] != std::make_pair(s, t)) ++j;
        const uint16_t* yr = &y[d][((first + e % l_count) * slots + j) * h];
        const float w = weight_of(in, t * k_count + k);
        for (int64_t c = 0; c < h; ++c)
          partial[c] = weighted ? std::fma(w, bf16_to_float(yr[c]), partial[c]) : partial[c] + bf16_to_float(yr[c]);
      }
      if (!any) continue;
      const std::vector<float> back = after_combine_wire(partial, p.cfg.combine_wire);
      for (int64_t c = 0; c < h; ++c) acc[c] += back[c];
    }
    if (first) {  // then the shared expert's row t, times its gate (1 without one) when weighted
      const uint16_t* yr = &y[s][t * h];
      const float w = in.shared_gate.empty() ? 1.0f : in.shared_gate[t];
      for (int64_t c = 0; c < h; ++c)
        acc[c] = weighted ? std::fma(w, bf16_to_float(yr[c]), acc[c]) : acc[c] + bf16_to_float(yr[c]);
    }
    for (int64_t c = 0; c < h; ++c) out[t * h + c] = float_to_bf16(acc[c]);
  }
  return out;
}

std::string check_ll_combine(const Problem& p, const std::vector<int64_t>& num_tokens,
                             const std::vector<std::vector<uint16_t>>& y, int s, bool weighted, const Tensor& got,
                             const std::string& what) {
  const auto want = expected_ll_combine(p, num_tokens, y, s, weighted);
  if (got.numel() != static_cast<int64_t>(want.size()))
    return what + ": " + std::to_string(got.numel()) + " elements, expected " + std::to_string(want.size());
  return compare_bits(got.data<uint16_t>(), want.data(), static_cast<int64_t>(want.size()), 2, what);
}

}  // namespace epx::verify
