// An independent, deliberately naive statement of docs/semantics.md: it looks at every rank's
// inputs at once and builds each expected output by scanning all (rank, token, slot) triples.
// It shares only the scalar codecs and the documented reductions with the library.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "verify/random_inputs.hpp"

namespace epx::verify {

// Per rank [T*K]: the routing after the capacity-factor drop rule.
std::vector<std::vector<int32_t>> kept_routing(const Problem& p);

// ExpectedRow::local_expert of a shared-expert row (BufferConfig::shared_expert).
constexpr int32_t kSharedExpert = -2;

struct ExpectedRow {
  int32_t src_rank = -1;  // -1: padding
  int32_t src_token = -1;
  int32_t local_expert = -1;  // expert-major: the row's expert, or kSharedExpert
  float weight = 0.0f;
};

struct Expected {
  std::vector<ExpectedRow> rows;
  std::vector<int64_t> expert_offsets;     // expert-major
  std::vector<int64_t> tokens_per_expert;
  std::vector<int64_t> rank_offsets;
  std::vector<int32_t> topk_idx;           // rank-major [N*K]
  std::vector<float> topk_weights;         // rank-major [N*K]
};

Expected expected_dispatch(const Problem& p, const std::vector<std::vector<int32_t>>& kept, int rank, Layout layout);

// A dispatch result on the host, to be checked: every tensor through copy (a device tensor to a
// host one), no handle (the device state stays with the caller's copy), and in capacity mode,
// whose num_rows is -1 (the sizes stay on the device), num_rows and overflow read from
// recv_info, as a user reads them.
DispatchResult host_copy(const DispatchResult& d, const std::function<Tensor(const Tensor&)>& copy);

// Empty when `got` is exactly what rank `rank` must receive; otherwise the first difference.
std::string check_dispatch(const Problem& p, const std::vector<std::vector<int32_t>>& kept, int rank, Layout layout,
                           float nvfp4_global_scale, const DispatchResult& got);

// Expected combine output of source rank s, given every rank's y (rows in its dispatch layout)
// and optional shared-expert rows of s. The partials cross back in p.cfg.combine_wire.
std::vector<uint16_t> expected_combine(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                       const std::vector<Expected>& layouts, const std::vector<std::vector<uint16_t>>& y,
                                       int s, Layout layout, bool weighted,
                                       const std::vector<uint16_t>* shared);
// Expected dispatch_backward grad_x of source rank s: the unweighted combine of grad_recv_x with
// bf16 partials, whatever p.cfg.combine_wire is.
std::vector<uint16_t> expected_grad_x(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                      const std::vector<Expected>& layouts,
                                      const std::vector<std::vector<uint16_t>>& grad_recv_x, int s, Layout layout);

// Expected combine-backward outputs: grad_y on expert rank d; grad_w of source rank s.
std::vector<uint16_t> expected_grad_y(const Problem& p, const Expected& layout, const std::vector<std::vector<uint16_t>>& grad_out,
                                      bool weighted);
std::vector<float> expected_grad_w(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                   const std::vector<Expected>& layouts, const std::vector<std::vector<uint16_t>>& grad_out,
                                   const std::vector<std::vector<uint16_t>>& y, int s);

// Expected grad_shared_gate [T] of rank s (its own layout): value_at(row) at each token's shared
// row within capacity (combine_backward: the dot with grad_out; dispatch_backward: the value of
// grad_recv_weights), 0 elsewhere.
std::vector<float> expected_shared_gate_grad(const Problem& p, const Expected& layout, int s,
                                             const std::function<float(int64_t row)>& value_at);
// The documented lane-order dot product of two bf16 rows (combine_backward's weight gradients).
float lane_dot(const uint16_t* a, const uint16_t* b, int64_t n);

// Byte-exact comparison of two arrays; empty when equal, else "what[i]: got a, want b".
std::string compare_bits(const void* got, const void* want, int64_t count, int64_t elem_size, const std::string& what);

}  // namespace epx::verify

namespace epx::verify {
// Expected dispatch_backward grad_topk_weights of source rank s: per kept slot, the value at its
// row on the expert rank (expert-major: g[d][row]; rank-major: g[d][row * K + k]).
std::vector<float> expected_gathered_weights(const Problem& p, const std::vector<std::vector<int32_t>>& kept,
                                             const std::vector<Expected>& layouts,
                                             const std::vector<std::vector<float>>& grad_recv_weights, int s,
                                             Layout layout);
}  // namespace epx::verify

namespace epx::verify {
// Low-latency mode (docs/low-latency.md). num_tokens[s]: the rows of rank s that count. With
// p.cfg.shared_expert the outputs and y lead with the shared expert ([1 + L, ...]), whose rows are
// each rank's own tokens, weighted in combine by RankInput::shared_gate (1 where it is empty).
// Empty when rank `rank`'s ll_dispatch output is exactly right, else the first difference.
std::string check_ll_dispatch(const Problem& p, const std::vector<int64_t>& num_tokens, int rank, float nvfp4_global_scale,
                              const LowLatencyDispatchResult& got);
// Expected ll_combine output of rank s, given every rank's y [(1 +) L, R*M, H]; the partials cross
// back in p.cfg.combine_wire.
std::vector<uint16_t> expected_ll_combine(const Problem& p, const std::vector<int64_t>& num_tokens,
                                          const std::vector<std::vector<uint16_t>>& y, int s, bool weighted);
// Empty when rank s's ll_combine output `got` (on the host) is exactly expected_ll_combine's, else
// the first difference, named `what`.
std::string check_ll_combine(const Problem& p, const std::vector<int64_t>& num_tokens,
                             const std::vector<std::vector<uint16_t>>& y, int s, bool weighted, const Tensor& got,
                             const std::string& what);
}  // namespace epx::verify
