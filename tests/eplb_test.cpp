// Redundant experts (EPLB, docs/semantics.md "Redundant experts (EPLB)"): an EPLB dispatch is a
// plain dispatch (num_experts = P, no EPLB) of the routing rewritten to the physical experts the
// replica rule picks, bit for bit in every output of every operation; the rule is computed apart
// from the library (verify/replicas.hpp). Then the rule's preference for own-rank replicas, the table's refusals, the load
// counters and low-latency mode.
#include <algorithm>
#include <cstring>

#include "harness.hpp"
#include "verify/replicas.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;

// Same dtype, shape and bytes (both undefined counts as equal).
std::string same_tensor(const Tensor& a, const Tensor& b, const std::string& what) {
  if (a.defined() != b.defined()) return what + ": defined in one run only";
  if (!a.defined()) return "";
  if (a.dtype() != b.dtype() || a.view().ndim != b.view().ndim) return what + ": dtype or rank differs";
  for (int d = 0; d < a.view().ndim; ++d)
    if (a.size(d) != b.size(d)) return what + ": shape differs: " + a.view().describe() + " vs " + b.view().describe();
  const size_t bytes = static_cast<size_t>(a.numel() * dtype_size(a.dtype()));
  if (std::memcmp(a.data<uint8_t>(), b.data<uint8_t>(), bytes) != 0) return what + ": bytes differ";
  return "";
}

struct OpsRun {
  DispatchResult dispatched, cached;
  CombineResult combined;
  DispatchBackwardResult dispatch_grad;
  CombineBackwardResult combine_grad;
  Tensor load_after_dispatch, load_after_all;
};

// Every operation on a rank: dispatch of `in`, a cached dispatch of `fresh_x`, combine, both
// backward passes, with inputs that depend only on the row counts and the rank (so two runs of the
// same layout get the same ones). The load counters after the dispatch and after everything.
OpsRun run_all(Buffer& b, const DispatchInput& in, const DispatchInput& fresh_x, const DispatchOptions& opt, bool weighted) {
  const int r = b.group().rank();
  const int64_t h = b.config().hidden, k_count = b.config().topk, tokens = in.x.shape[0];
  OpsRun run;
  run.dispatched = b.dispatch(in, opt);
  run.load_after_dispatch = Tensor::zeros_host(DType::i64, {b.expert_load().numel()});
  std::copy_n(b.expert_load().data<int64_t>(), b.expert_load().numel(), run.load_after_dispatch.data<int64_t>());
  run.cached = b.dispatch(fresh_x, run.dispatched.handle);
  const int64_t rows = run.dispatched.recv_x.size(0);
  const auto y = verify::random_bf16(rows * h, 100 + r), shared = verify::random_bf16(tokens * h, 200 + r);
  run.combined = b.combine({bf16_view(y, rows, h), bf16_view(shared, tokens, h)}, run.dispatched.handle, {weighted});
  const auto grad_recv_x = verify::random_bf16(rows * h, 300 + r);
  const bool expert_major = opt.layout == Layout::expert_major;
  std::vector<float> gw(rows * (expert_major ? 1 : k_count));
  for (size_t i = 0; i < gw.size(); ++i) gw[i] = 0.25f * static_cast<float>(i % 13) - 1.0f;
  const TensorView gw_view = expert_major ? TensorView::of(gw.data(), DType::f32, {rows})
                                          : TensorView::of(gw.data(), DType::f32, {rows, k_count});
  run.dispatch_grad = b.dispatch_backward({bf16_view(grad_recv_x, rows, h), gw_view}, run.dispatched.handle);
  const auto grad_out = verify::random_bf16(tokens * h, 400 + r);
  run.combine_grad = b.combine_backward({bf16_view(grad_out, tokens, h), bf16_view(y, rows, h)}, run.dispatched.handle,
                                        {weighted});
  run.load_after_all = b.expert_load();
  return run;
}

// Every output of the EPLB run against the plain one.
void expect_same_outputs(const OpsRun& a, const OpsRun& b, int rank) {
  const DispatchResult &x = a.dispatched, &y = b.dispatched;
  const std::pair<const Tensor*, const Tensor*> pairs[] = {
      {&x.recv_x, &y.recv_x}, {&x.recv_scales, &y.recv_scales}, {&x.recv_global_scale, &y.recv_global_scale},
      {&x.recv_src, &y.recv_src}, {&x.recv_weights, &y.recv_weights}, {&x.recv_topk_idx, &y.recv_topk_idx},
      {&x.recv_topk_weights, &y.recv_topk_weights}, {&x.expert_offsets, &y.expert_offsets},
      {&x.tokens_per_expert, &y.tokens_per_expert}, {&x.rank_offsets, &y.rank_offsets}, {&x.recv_info, &y.recv_info},
      {&a.cached.recv_x, &b.cached.recv_x}, {&a.cached.recv_scales, &b.cached.recv_scales},
      {&a.combined.out, &b.combined.out}, {&a.dispatch_grad.grad_x, &b.dispatch_grad.grad_x},
      {&a.dispatch_grad.grad_topk_weights, &b.dispatch_grad.grad_topk_weights},
      {&a.dispatch_grad.grad_shared_gate, &b.dispatch_grad.grad_shared_gate},
      {&a.combine_grad.grad_y, &b.combine_grad.grad_y}, {&a.combine_grad.grad_topk_weights, &b.combine_grad.grad_topk_weights},
      {&a.combine_grad.grad_shared_gate, &b.combine_grad.grad_shared_gate},
      {&a.load_after_dispatch, &b.load_after_dispatch}, {&a.load_after_all, &b.load_after_all}};
  const char* names[] = {"recv_x", "recv_scales", "recv_global_scale", "recv_src", "recv_weights", "recv_topk_idx",
                         "recv_topk_weights", "expert_offsets", "tokens_per_expert", "rank_offsets", "recv_info",
                         "cached recv_x", "cached recv_scales", "combine out", "grad_x", "dispatch_backward grad_topk_weights",
                         "dispatch_backward grad_shared_gate", "grad_y", "combine_backward grad_topk_weights",
                         "combine_backward grad_shared_gate", "expert_load after dispatch", "expert_load at the end"};
  for (size_t i = 0; i < std::size(pairs); ++i)
    EXPECT_EQ(same_tensor(*pairs[i].first, *pairs[i].second, names[i]), "") << "rank " << rank;
  EXPECT_EQ(x.num_rows, y.num_rows) << "rank " << rank;
  EXPECT_EQ(x.overflow, y.overflow) << "rank " << rank;
  EXPECT_EQ(x.dropped_slots, y.dropped_slots) << "rank " << rank;
  EXPECT_EQ(a.combined.overflow, b.combined.overflow) << "rank " << rank;
}

enum class Mode { blocking, capacity, overflow, dropping };

struct Case {
  int ranks;
  int64_t experts, physical, width;  // E, P, M (0: the default)
  int64_t topk;
  WireFormat wire;
  Layout layout;
  bool dense;  // routing_map + probs instead of topk_idx + topk_weights
  Mode mode;
  bool shared_expert = false;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* modes[] = {"blocking", "capacity", "overflow", "dropping"};
  return "R" + std::to_string(c.ranks) + "_E" + std::to_string(c.experts) + "_P" + std::to_string(c.physical) + "_M" +
         std::to_string(c.width) + "_K" + std::to_string(c.topk) + "_" + std::string(wire_name(c.wire)) + "_" +
         std::string(layout_name(c.layout)) + (c.dense ? "_dense" : "_topk") + "_" + modes[static_cast<int>(c.mode)] +
         (c.shared_expert ? "_shared" : "");
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(testing::TestParamInfo<Case>(c, 0)); }

verify::Problem case_problem(const Case& c) {
  verify::ProblemSpec spec;
  spec.cfg = small_config(256, 24, c.experts, c.topk, c.wire, c.layout == Layout::expert_major ? 4 : 1);
  spec.ranks = c.ranks;
  for (int r = 0; r < c.ranks; ++r) spec.tokens.push_back(r == 1 ? 0 : 24 - 5 * r % 25);  // rank 1 empty
  spec.routing = c.mode == Mode::dropping ? verify::Routing::skewed : verify::Routing::uniform;
  spec.unused_slot_fraction = 0.1;
  spec.seed = static_cast<uint64_t>(c.ranks * 31 + c.physical + c.topk);
  verify::Problem p = verify::make_problem(spec);
  BufferConfig& cfg = p.cfg;
  if (c.mode == Mode::capacity || c.mode == Mode::overflow) {
    cfg.mode = CapacityMode::capacity;
    cfg.capacity_rows = c.mode == Mode::capacity ? 24 * c.ranks * c.topk + c.physical * 4 : 9;
  }
  if (c.mode == Mode::dropping) cfg.capacity_factor = 0.75;
  if (c.shared_expert) {
    cfg.shared_expert = true;
    if (cfg.mode == CapacityMode::capacity) cfg.capacity_rows += 24;
  }
  return p;
}

class Eplb : public testing::TestWithParam<Case> {};

TEST_P(Eplb, EqualsAPlainDispatchOfThePhysicalRouting) {
  const Case& c = GetParam();
  const verify::Problem p = case_problem(c);
  const int64_t width = c.width > 0 ? c.width : c.physical - c.experts + 1;
  const std::vector<int32_t> table = verify::random_replicas(c.experts, c.physical, width, 7 + c.physical);
  BufferConfig eplb_cfg = p.cfg;
  eplb_cfg.num_physical_experts = c.physical;
  eplb_cfg.max_replicas = c.width;
  BufferConfig plain_cfg = p.cfg;
  plain_cfg.num_experts = c.physical;
  // The plain run's routing: top-k (slots as the dense rule fills them: experts ascending), in physical ids.
  const verify::DenseRouting dense = verify::dense_routing(p);
  const verify::Problem& topk_form = c.dense ? dense.sorted : p;
  const auto physical = verify::physical_routing(topk_form, table, c.physical, width);
  const verify::Problem fresh = fresh_x_problem(p);
  const bool weighted = c.layout == Layout::expert_major;
  std::vector<OpsRun> eplb(c.ranks), plain(c.ranks);
  auto errors = verify::run_ranks(c.ranks, [&](const Group& g) {
    const int r = g.rank();
    const int64_t tokens = p.inputs[r].tokens;
    const DispatchInput fresh_x = cached_input(fresh, r);
    {
      Buffer b(g, eplb_cfg);
      DispatchInput in = p.inputs[r].view(p.cfg.hidden, p.cfg.topk);
      if (c.dense) {
        in.topk_idx = in.topk_weights = {};
        in.routing_map = TensorView::of(const_cast<uint8_t*>(dense.maps[r].data()), DType::boolean, {tokens, c.experts});
        in.probs = TensorView::of(const_cast<float*>(dense.probs[r].data()), DType::f32, {tokens, c.experts});
      }
      in.expert_replicas = TensorView::of(const_cast<int32_t*>(table.data()), DType::i32, {c.experts, width});
      eplb[r] = run_all(b, in, fresh_x, {c.layout}, weighted);
    }
    Buffer b(g, plain_cfg);
    DispatchInput in = topk_form.inputs[r].view(p.cfg.hidden, p.cfg.topk);
    in.topk_idx = TensorView::of(const_cast<int32_t*>(physical[r].data()), DType::i32, {tokens, c.topk});
    plain[r] = run_all(b, in, fresh_x, {c.layout}, weighted);
  });
  for (int r = 0; r < c.ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  int64_t dropped = 0;
  bool overflow = false;
  for (int r = 0; r < c.ranks; ++r) {
    expect_same_outputs(eplb[r], plain[r], r);
    const Tensor& chosen = eplb[r].dispatched.topk_physical;
    ASSERT_TRUE(chosen.defined());
    ASSERT_EQ(chosen.numel(), static_cast<int64_t>(physical[r].size()));
    EXPECT_TRUE(std::equal(physical[r].begin(), physical[r].end(), chosen.data<int32_t>())) << "topk_physical, rank " << r;
    EXPECT_FALSE(plain[r].dispatched.topk_physical.defined());
    EXPECT_EQ(eplb[r].dispatched.tokens_per_expert.numel(), c.physical / c.ranks + (c.shared_expert ? 1 : 0));
    dropped += eplb[r].dispatched.dropped_slots;
    overflow |= eplb[r].dispatched.overflow;
  }
  if (c.mode == Mode::dropping) {
    EXPECT_GT(dropped, 0) << "the dropping case dropped nothing";
  }
  if (c.mode == Mode::overflow) {
    EXPECT_TRUE(overflow) << "the overflow case lost no rows";
  }
}

using W = WireFormat;
using M = Mode;
constexpr Layout EM = Layout::expert_major, RM = Layout::rank_major;

INSTANTIATE_TEST_SUITE_P(
    Shapes, Eplb,
    testing::Values(Case{2, 8, 12, 0, 2, W::bf16, EM, false, M::blocking},
                    Case{2, 8, 12, 0, 2, W::bf16, RM, false, M::blocking},
                    Case{2, 8, 12, 2, 2, W::bf16, EM, true, M::blocking},
                    Case{2, 8, 12, 0, 2, W::bf16, RM, true, M::blocking},
                    Case{4, 16, 24, 3, 4, W::fp8, EM, false, M::blocking},
                    Case{4, 16, 24, 0, 4, W::fp8, RM, true, M::blocking},
                    Case{3, 6, 12, 0, 3, W::fp8_ue8m0, EM, false, M::blocking},
                    Case{1, 4, 8, 0, 2, W::bf16, EM, false, M::blocking},
                    Case{4, 8, 8, 1, 2, W::bf16, EM, false, M::blocking},  // P = E: a permutation
                    Case{2, 8, 12, 0, 2, W::bf16, EM, false, M::capacity},
                    Case{2, 8, 12, 0, 2, W::fp8, RM, true, M::capacity},
                    Case{3, 6, 12, 0, 3, W::bf16, EM, false, M::overflow},
                    Case{2, 8, 12, 0, 2, W::bf16, EM, false, M::dropping},
                    Case{4, 8, 16, 0, 4, W::fp8, RM, true, M::dropping},
                    Case{4, 8, 16, 0, 4, W::fp8, EM, true, M::dropping},
                    Case{2, 8, 12, 0, 2, W::bf16, EM, false, M::blocking, true},
                    Case{3, 6, 12, 0, 3, W::fp8, EM, true, M::capacity, true}),
    case_name);

// Runs fn(rank, buffer) on `ranks` ranks of one EPLB buffer; every rank must return.
void on_ranks(int ranks, const BufferConfig& cfg, const std::function<void(int, Buffer&)>& fn) {
  auto errors = verify::run_ranks(ranks, [&](const Group& g) {
    Buffer b(g, cfg);
    fn(g.rank(), b);
  });
  for (int r = 0; r < ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
}

BufferConfig eplb_config(int64_t experts, int64_t physical, int64_t topk) {
  BufferConfig c = small_config(64, 8, experts, topk);
  c.num_physical_experts = physical;
  return c;
}

struct Tokens {
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  DispatchInput view(int64_t tokens, int64_t topk, std::vector<int32_t>& table, int64_t experts, int64_t width) {
    x = verify::random_bf16(tokens * 64, 9);
    DispatchInput in;
    in.x = bf16_view(x, tokens, 64);
    in.topk_idx = TensorView::of(idx.data(), DType::i32, {tokens, topk});
    in.expert_replicas = TensorView::of(table.data(), DType::i32, {experts, width});
    return in;
  }
};

// Logical 0 has a replica on each rank: each rank keeps its tokens home. Logical 1 has both on
// rank 0: rank 0 alternates from the first, rank 1 (offset t + 1) from the second.
TEST(EplbRule, PrefersReplicasOnTheSourceRank) {
  // P = 8, L = 4 per rank: rank 0 holds 0..3, rank 1 holds 4..7.
  std::vector<int32_t> table = {0, 4, 1, 2, 5, -1, -1, 3};  // E = 4 rows of M = 2 (the last: {3}, a -1 first)
  on_ranks(2, [] {
    BufferConfig c = eplb_config(4, 8, 2);
    c.max_replicas = 2;
    return c;
  }(), [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 1, 0, 1, 2, 3, 3, -1};  // 4 tokens, K = 2
    const DispatchResult d = b.dispatch(tk.view(4, 2, table, 4, 2));
    const std::vector<int32_t> want =
        r == 0 ? std::vector<int32_t>{0, 1, 0, 2, 5, 3, 3, -1} : std::vector<int32_t>{4, 2, 4, 1, 5, 3, 3, -1};
    ASSERT_TRUE(d.topk_physical.defined());
    EXPECT_EQ(std::vector<int32_t>(d.topk_physical.data<int32_t>(), d.topk_physical.data<int32_t>() + 8), want)
        << "rank " << r;
  });
}

// A bad table on rank 1 fails every rank, naming the entry there; the next dispatch works.
void expect_table_refused(const std::vector<int32_t>& bad, const std::string& words) {
  std::vector<int32_t> good = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1};  // E = 5, P = 6, M = 2 (5 on rank 1)
  on_ranks(2, eplb_config(5, 6, 2), [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 4, 1, 2, 3, -1};
    std::vector<int32_t> mine = r == 1 ? bad : good;
    std::string what;
    const ErrorCode code = code_of([&] { b.dispatch(tk.view(3, 2, mine, 5, 2)); }, &what);
    EXPECT_EQ(code, r == 1 ? ErrorCode::invalid_argument : ErrorCode::peer_failed) << what;
    EXPECT_THAT(what, HasSubstr(words)) << "rank " << r;
    const DispatchResult d = b.dispatch(tk.view(3, 2, good, 5, 2));  // the buffer stays usable
    EXPECT_EQ(d.topk_physical.data<int32_t>()[0], r == 0 ? 0 : 5);  // logical 0 on its own rank
  });
}

TEST(EplbTable, ARowWithoutReplicasFailsEveryRank) {
  expect_table_refused({0, 5, 1, -1, -1, -1, 3, -1, 4, -1}, "expert_replicas[2] has no entry");
}
TEST(EplbTable, AnIdOutOfRangeFailsEveryRank) {
  expect_table_refused({0, 5, 1, -1, 2, -1, 3, 6, 4, -1}, "expert_replicas[3][1] = 6 is out of range");
  expect_table_refused({0, 5, 1, -1, 2, -2, 3, -1, 4, -1}, "expert_replicas[2][1] = -2 is out of range");
}
TEST(EplbTable, AnIdTwiceFailsEveryRank) {
  expect_table_refused({0, 5, 1, -1, 2, -1, 3, 1, 4, -1}, "expert_replicas[3][1] = 1 repeats expert_replicas[1][0]");
}

TEST(EplbTable, IsRequiredWithEplbAndRefusedWithout) {
  on_ranks(2, eplb_config(4, 8, 2), [&](int, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 1};
    std::vector<int32_t> none;
    DispatchInput in = tk.view(1, 2, none, 4, 2);
    in.expert_replicas = {};
    std::string what;
    code_of([&] { b.dispatch(in); }, &what);
    EXPECT_THAT(what, HasSubstr("expert_replicas is missing"));
    std::vector<int32_t> narrow(4, 0);
    code_of([&] { b.dispatch(tk.view(1, 2, narrow, 4, 1)); }, &what);
    EXPECT_THAT(what, HasSubstr("dispatch: expert_replicas: expected shape [E=4, M=5]"));
  });
  on_ranks(2, small_config(64, 8, 4, 2), [&](int, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 1};
    std::vector<int32_t> table = {0, 1, 2, 3};
    std::string what;
    EXPECT_EQ(code_of([&] { b.dispatch(tk.view(1, 2, table, 4, 1)); }, &what), ErrorCode::invalid_argument);
    EXPECT_THAT(what, HasSubstr("expert_replicas given but the buffer has no redundant experts"));
  });
}

// Tables that differ between ranks (each valid) would send tokens to a physical expert its owner
// counts as another logical expert's: the plan exchange compares them and every rank fails the call;
// the failed call counts no load and the next one works.
TEST(EplbTable, TablesThatDifferBetweenRanksFailEveryRankAndCountNoLoad) {
  std::vector<int32_t> good = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1};  // E = 5, P = 6, M = 2
  std::vector<int32_t> other = {0, 5, 1, -1, 2, -1, 4, -1, 3, -1};  // logical 3 and 4 swapped
  on_ranks(2, eplb_config(5, 6, 2), [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 4, 1, 2, 3, -1};
    std::vector<int32_t> mine = r == 1 ? other : good;
    std::string what;
    EXPECT_EQ(code_of([&] { b.dispatch(tk.view(3, 2, mine, 5, 2)); }, &what), ErrorCode::config_mismatch);
    EXPECT_THAT(what, HasSubstr("expert_replicas hash")) << "rank " << r;
    const Tensor load = b.expert_load();
    EXPECT_EQ(std::count(load.data<int64_t>(), load.data<int64_t>() + load.numel(), 0), load.numel()) << "rank " << r;
    EXPECT_EQ(b.dispatch(tk.view(3, 2, good, 5, 2)).topk_physical.data<int32_t>()[0], r == 0 ? 0 : 5);
  });
}

// A bad table on one rank counts no load on any rank.
TEST(EplbTable, ARefusedTableCountsNoLoad) {
  std::vector<int32_t> good = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1}, bad = {0, 5, 1, -1, 2, -1, 3, 1, 4, -1};
  on_ranks(2, eplb_config(5, 6, 2), [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 4, 1, 2, 3, -1};
    std::vector<int32_t> mine = r == 1 ? bad : good;
    EXPECT_EQ(code_of([&] { b.dispatch(tk.view(3, 2, mine, 5, 2)); }),
              r == 1 ? ErrorCode::invalid_argument : ErrorCode::peer_failed);
    const Tensor load = b.expert_load();
    EXPECT_EQ(std::count(load.data<int64_t>(), load.data<int64_t>() + load.numel(), 0), load.numel()) << "rank " << r;
  });
}

// A cached dispatch takes its handle's replica choice: a table given to it is refused.
TEST(EplbTable, ACachedDispatchRefusesATable) {
  std::vector<int32_t> table = {0, 5, 1, -1, 2, -1, 3, -1, 4, -1};
  on_ranks(2, eplb_config(5, 6, 2), [&](int, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 4, 1, 2, 3, -1};
    const DispatchInput in = tk.view(3, 2, table, 5, 2);
    const DispatchResult d = b.dispatch(in);
    DispatchInput again = x_only(in);
    again.expert_replicas = in.expert_replicas;
    std::string what;
    EXPECT_EQ(code_of([&] { b.dispatch(again, d.handle); }, &what), ErrorCode::invalid_argument);
    EXPECT_THAT(what, HasSubstr("replica choice too"));
  });
}

// max_replicas = 0 means P - E + 1: ranks that write either agree.
TEST(EplbConfig, TheDefaultMaxReplicasAgreesWithItsValue) {
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    BufferConfig c = eplb_config(4, 8, 2);
    c.max_replicas = g.rank() == 0 ? 0 : 5;
    Buffer b(g, c);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// E need not be a multiple of the ranks with EPLB (P must): E = 3 logical experts on P = 4.
TEST(EplbRule, LogicalExpertsNeedNotDivideByTheRanks) {
  std::vector<int32_t> table = {0, 3, 1, -1, 2, -1};  // E = 3, M = 2: rank 0 holds 0, 1; rank 1 holds 2, 3
  BufferConfig cfg = eplb_config(3, 4, 1);
  cfg.max_replicas = 2;
  on_ranks(2, cfg, [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 1, 2, 0};
    const DispatchResult d = b.dispatch(tk.view(4, 1, table, 3, 2));
    const std::vector<int32_t> want = r == 0 ? std::vector<int32_t>{0, 1, 2, 0} : std::vector<int32_t>{3, 1, 2, 3};
    EXPECT_EQ(std::vector<int32_t>(d.topk_physical.data<int32_t>(), d.topk_physical.data<int32_t>() + 4), want);
    // rank 0 receives its own 0, 1, 0 and rank 1's 1; rank 1 rank 0's 2 and its own 3, 2, 3
    EXPECT_EQ(d.num_rows, 4) << "rank " << r;
  });
}

// A config every rank refuses at creation, with the reason.
void expect_config_refused(const BufferConfig& c, const std::string& words) {
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    std::string what;
    EXPECT_EQ(code_of([&] { Buffer b(g, c); }, &what), ErrorCode::invalid_argument);
    EXPECT_THAT(what, HasSubstr(words));
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(EplbConfig, RefusesWhatCannotHoldTheExperts) {
  expect_config_refused(eplb_config(8, 6, 2), "num_physical_experts (6) must be >= num_experts (8)");
  expect_config_refused(eplb_config(8, 9, 2), "num_physical_experts (9) must be a multiple of the group size (2)");
  BufferConfig wide = eplb_config(8, 12, 2);
  wide.max_replicas = 6;
  expect_config_refused(wide, "max_replicas must be in [0, P - E + 1 = 5]");
  BufferConfig off = small_config(64, 8, 8, 2);
  off.max_replicas = 2;
  expect_config_refused(off, "max_replicas goes with num_physical_experts > 0");
}

// expert_load: each local physical expert's received (token, slot) rows, summed over dispatches,
// independent of the layout's padding; a cached dispatch adds nothing; reset clears.
TEST(EplbLoad, AccumulatesOverDispatchesAndResets) {
  std::vector<int32_t> table = {0, 4, 1, -1, 2, -1, 3, 5};  // E = 4, P = 8, M = 2
  std::vector<std::vector<int32_t>> chosen(2);
  std::vector<std::vector<int64_t>> loads(2);
  BufferConfig cfg = eplb_config(4, 8, 2);
  cfg.max_replicas = 2;
  cfg.expert_alignment = 8;  // padding rows are not load
  on_ranks(2, cfg, [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = {0, 1, 0, 3, 2, 3, 0, -1, 1, 0};  // 5 tokens
    const Tensor load = b.expert_load();
    ASSERT_EQ(load.numel(), 4);
    EXPECT_EQ(std::count(load.data<int64_t>(), load.data<int64_t>() + 4, 0), 4);
    const DispatchInput in = tk.view(5, 2, table, 4, 2);
    const DispatchResult d = b.dispatch(in);
    chosen[r].assign(d.topk_physical.data<int32_t>(), d.topk_physical.data<int32_t>() + 10);
    b.dispatch(x_only(in), d.handle);  // cached: not counted
    b.dispatch(in, {Layout::rank_major});
    loads[r].assign(load.data<int64_t>(), load.data<int64_t>() + 4);  // the view shows the counts now
    b.reset_expert_load();
    EXPECT_EQ(std::count(load.data<int64_t>(), load.data<int64_t>() + 4, 0), 4) << "rank " << r;
    b.dispatch(in);
    for (int64_t l = 0; l < 4; ++l)
      EXPECT_EQ(2 * load.data<int64_t>()[l], loads[r][l]) << "one dispatch after the reset, rank " << r;
  });
  for (int d = 0; d < 2; ++d)
    for (int64_t l = 0; l < 4; ++l) {
      int64_t want = 0;
      for (const auto& c : chosen) want += std::count(c.begin(), c.end(), static_cast<int32_t>(d * 4 + l));
      EXPECT_EQ(loads[d][l], 2 * want) << "rank " << d << " local expert " << l;
    }
}

// Dropping happens before counting: the load is what was kept.
TEST(EplbLoad, CountsAfterDropping) {
  std::vector<int32_t> table = {0, 2, 1, 3};  // E = 2, P = 4, M = 2: rank 0 holds 0, 1; rank 1 holds 2, 3
  BufferConfig cfg = eplb_config(2, 4, 1);
  cfg.max_replicas = 2;
  cfg.capacity_factor = 0.5;  // C = ceil(0.5 * 16 * 1 / 4) = 2 per physical expert
  on_ranks(2, cfg, [&](int r, Buffer& b) {
    Tokens tk;
    tk.idx = std::vector<int32_t>(8, 0);  // every token to logical 0: each rank's own replica
    const DispatchResult d = b.dispatch(tk.view(8, 1, table, 2, 2));
    EXPECT_EQ(d.dropped_slots, 6) << "rank " << r;
    EXPECT_EQ(b.expert_load().data<int64_t>()[0], 2) << "rank " << r;
    EXPECT_EQ(b.expert_load().data<int64_t>()[1], 0) << "rank " << r;
  });
}

// Low-latency mode: an EPLB ll_dispatch and ll_combine equal those of a buffer of P experts
// given the physical routing; topk_physical and the load counters as in high-throughput mode.
TEST(EplbLowLatency, EqualsAPlainBufferOfThePhysicalRouting) {
  const int ranks = 4;
  const int64_t experts = 8, physical = 16, topk = 3, hidden = 256, max_tokens = 12;
  for (WireFormat wire : {WireFormat::bf16, WireFormat::fp8}) {
    verify::ProblemSpec spec;
    spec.cfg = small_config(hidden, max_tokens, experts, topk, wire);
    spec.ranks = ranks;
    spec.seed = 23;
    spec.unused_slot_fraction = 0.1;
    const verify::Problem p = verify::make_problem(spec);
    const int64_t width = physical - experts + 1;
    const std::vector<int32_t> table = verify::random_replicas(experts, physical, width, 41);
    const auto phys = verify::physical_routing(p, table, physical, width);
    LowLatencyConfig eplb_cfg = small_ll_config(hidden, max_tokens, experts, topk, wire);
    eplb_cfg.num_physical_experts = physical;
    const LowLatencyConfig plain_cfg = small_ll_config(hidden, max_tokens, physical, topk, wire);
    struct LlRun {
      LowLatencyDispatchResult d;
      Tensor out, load;
    };
    std::vector<LlRun> eplb(ranks), plain(ranks);
    auto errors = verify::run_ranks(ranks, [&](const Group& g) {
      const int r = g.rank();
      const verify::RankInput& in = p.inputs[r];
      int32_t n = static_cast<int32_t>(in.tokens - r);  // the last r rows do not count
      auto run = [&](const LowLatencyConfig& cfg, const int32_t* idx, bool with_table) {
        LowLatencyBuffer b(g, cfg);
        LowLatencyDispatchInput d;
        d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {in.tokens, hidden});
        d.topk_idx = TensorView::of(const_cast<int32_t*>(idx), DType::i32, {in.tokens, topk});
        d.num_tokens = TensorView::of(&n, DType::i32, {1});
        d.topk_weights = TensorView::of(const_cast<float*>(in.weights.data()), DType::f32, {in.tokens, topk});
        if (with_table) d.expert_replicas = TensorView::of(const_cast<int32_t*>(table.data()), DType::i32, {experts, width});
        LlRun out;
        out.d = b.dispatch(d);
        const int64_t rows = out.d.recv_x.size(0) * out.d.recv_x.size(1);
        const auto y = verify::random_bf16(rows * hidden, 500 + r);
        out.out = b.combine({TensorView::of(const_cast<uint16_t*>(y.data()), DType::bf16,
                                            {out.d.recv_x.size(0), out.d.recv_x.size(1), hidden}), {}, true},
                            out.d.handle);
        b.dispatch(d);  // the load counts both
        out.load = b.expert_load();
        return out;
      };
      eplb[r] = run(eplb_cfg, in.idx.data(), true);
      plain[r] = run(plain_cfg, phys[r].data(), false);
    });
    for (int r = 0; r < ranks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
    for (int r = 0; r < ranks; ++r) {
      const LowLatencyDispatchResult &a = eplb[r].d, &b = plain[r].d;
      EXPECT_EQ(same_tensor(a.recv_x, b.recv_x, "recv_x"), "") << wire_name(wire) << " rank " << r;
      EXPECT_EQ(same_tensor(a.recv_scales, b.recv_scales, "recv_scales"), "") << "rank " << r;
      EXPECT_EQ(same_tensor(a.recv_count, b.recv_count, "recv_count"), "") << "rank " << r;
      EXPECT_EQ(same_tensor(a.recv_src, b.recv_src, "recv_src"), "") << "rank " << r;
      EXPECT_EQ(same_tensor(a.recv_layout, b.recv_layout, "recv_layout"), "") << "rank " << r;
      EXPECT_EQ(same_tensor(eplb[r].out, plain[r].out, "ll_combine out"), "") << "rank " << r;
      EXPECT_EQ(same_tensor(eplb[r].load, plain[r].load, "expert_load"), "") << "rank " << r;
      int64_t rows = 0;
      for (int64_t l = 0; l < physical / ranks; ++l) rows += a.recv_count.data<int32_t>()[l];
      int64_t loaded = 0;
      for (int64_t l = 0; l < physical / ranks; ++l) loaded += eplb[r].load.data<int64_t>()[l];
      EXPECT_EQ(loaded, 2 * rows) << "rank " << r;
      ASSERT_TRUE(a.topk_physical.defined());
      std::vector<int32_t> want = phys[r];
      for (int64_t i = (p.inputs[r].tokens - r) * topk; i < static_cast<int64_t>(want.size()); ++i) want[i] = -1;
      EXPECT_TRUE(std::equal(want.begin(), want.end(), a.topk_physical.data<int32_t>())) << "topk_physical, rank " << r;
      EXPECT_FALSE(b.topk_physical.defined());
    }
  }
}

// Low-latency mode: rank 0 passes `table` where rank 1 passes a good one; the call fails on rank r
// with codes[r], naming `words`, and the next one (good tables) works.
void expect_ll_table_refused(const std::vector<int32_t>& table, const ErrorCode (&codes)[2], const std::string& words) {
  LowLatencyConfig cfg = small_ll_config(64, 4, 2, 1);
  cfg.num_physical_experts = 4;
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    LowLatencyBuffer b(g, cfg);
    std::vector<int32_t> good = {0, 2, -1, 1, 3, -1}, mine = g.rank() == 0 ? table : good;
    const auto x = verify::random_bf16(4 * 64, 3);
    std::vector<int32_t> idx = {0, 1, 1, 0};
    LowLatencyDispatchInput d;
    d.x = bf16_view(x, 4, 64);
    d.topk_idx = TensorView::of(idx.data(), DType::i32, {4, 1});
    d.expert_replicas = TensorView::of(mine.data(), DType::i32, {2, 3});
    std::string what;
    EXPECT_EQ(code_of([&] { b.dispatch(d); }, &what), codes[g.rank()]);
    EXPECT_THAT(what, HasSubstr(words));
    d.expert_replicas = TensorView::of(good.data(), DType::i32, {2, 3});
    EXPECT_EQ(b.dispatch(d).topk_physical.numel(), 4);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(EplbLowLatency, ABadTableFailsEveryRank) {
  expect_ll_table_refused({0, 2, -1, 1, 2, -1}, {ErrorCode::invalid_argument, ErrorCode::peer_failed},
                          "ll_dispatch: expert_replicas[1][1] = 2 repeats expert_replicas[0][1]");
}

TEST(EplbLowLatency, TablesThatDifferBetweenRanksFailEveryRank) {
  expect_ll_table_refused({0, 3, -1, 1, 2, -1}, {ErrorCode::config_mismatch, ErrorCode::config_mismatch},
                          "expert_replicas hash");
}

}  // namespace
}  // namespace epx::test
