// Input validation, fuzzed, on the CPU backend. Each case draws a small random problem, then
// spoils it on some ranks in one of many ways, each known to be accepted or refused: a config
// field out of range or different across ranks, an expert id out of range, a wrong dtype or shape,
// a null pointer, an option, a handle. A case must end in one of two ways only:
//   - accepted: every rank succeeds and every output matches the reference bit for bit;
//   - refused: every rank fails the same call at once: a spoiled rank with invalid_argument (or
//     every rank with config_mismatch when valid ranks disagree), the others with peer_failed
//     naming a spoiled rank and its reason.
// Never a crash, a hang (every case is timed) or a wrong result. The C ABI gets the same treatment
// with the spoils only it can express (unknown codes, ndim, NULL arguments).
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "core/check.hpp"
#include "epx/epx.h"
#include "harness.hpp"

namespace epx::test {
namespace {

using detail::cat;
using Clock = std::chrono::steady_clock;
using Rng = std::mt19937_64;

constexpr int64_t kTimeoutMs = 5000;                     // a wrongly waiting rank would take this long
constexpr auto kCaseLimit = std::chrono::milliseconds(2000);  // far above a case's time, far below kTimeoutMs
constexpr int kCases = 6000;  // C++ API cases (about two seconds in all)
constexpr int kCApiCases = 2000;

int pick(Rng& rng, int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); }
bool chance(Rng& rng, int percent) { return pick(rng, 100) < percent; }

// What one rank's call ended in.
struct Outcome {
  bool ok = true;
  ErrorCode code = ErrorCode::internal;
  std::string what;
};

Outcome outcome_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return {false, e.code(), e.what()};
  } catch (const std::exception& e) {
    return {false, ErrorCode::internal, std::string("not an epx::Error: ") + e.what()};
  }
  return {};
}

// The verdict on one step of a case (creation or a call), given which ranks were spoiled so that
// they must refuse (`refusing`), or that valid ranks disagree (`disagree`). Empty when right.
std::string judge(const std::vector<Outcome>& got, const std::vector<bool>& refusing, bool disagree,
                  const std::string& step) {
  const int ranks = static_cast<int>(got.size());
  bool any_refusing = false;
  for (bool b : refusing) any_refusing |= b;
  for (int r = 0; r < ranks; ++r) {
    const Outcome& o = got[r];
    const std::string who = cat(step, ", rank ", r, ": ");
    if (!any_refusing && !disagree) {
      if (!o.ok) return who + "refused a valid case: " + o.what;
      continue;
    }
    if (o.ok) return who + "succeeded where every rank must fail";
    if (refusing[r] && o.code != ErrorCode::invalid_argument) return who + "expected invalid_argument, got: " + o.what;
    if (!any_refusing && o.code != ErrorCode::config_mismatch) return who + "expected config_mismatch, got: " + o.what;
    if (any_refusing && !refusing[r]) {
      if (o.code != ErrorCode::peer_failed) return who + "expected peer_failed, got: " + o.what;
      bool quotes = false;  // names a refusing rank and quotes its reason
      for (int s = 0; s < ranks; ++s)
        if (refusing[s] && o.what.find(cat("rank ", s, " re")) != std::string::npos &&
            o.what.find(got[s].what) != std::string::npos)
          quotes = true;
      if (!quotes) return who + "does not name a refusing rank and its reason: " + o.what;
    }
  }
  return "";
}

// Runs fn(r) on every rank's thread; the whole step must end within kCaseLimit.
std::vector<Outcome> on_ranks(int ranks, const std::function<void(int)>& fn, const std::string& step,
                              std::string& timing) {
  std::vector<Outcome> got(ranks);
  const auto start = Clock::now();
  verify::run_threads(ranks, [&](int r) { got[r] = outcome_of([&] { fn(r); }); });
  if (Clock::now() - start > kCaseLimit && timing.empty()) timing = step + ": took longer than the case limit";
  return got;
}

// ---- configs ----

struct ConfigSpoil {
  const char* name;
  bool valid;  // still a valid config (only a difference from the other ranks)
  std::function<void(BufferConfig&)> apply;
  int min_ranks = 1;  // the spoil means what `valid` says only with this many ranks
};

const std::vector<ConfigSpoil>& config_spoils() {
  static const std::vector<ConfigSpoil> spoils = {
      {"hidden 0", false, [](BufferConfig& c) { c.hidden = 0; }},
      {"hidden negative", false, [](BufferConfig& c) { c.hidden = -128; }},
      {"max tokens negative", false, [](BufferConfig& c) { c.max_tokens_per_rank = -1; }},
      {"experts not a multiple of ranks", false, [](BufferConfig& c) { c.num_experts += 1; }, 2},
      {"experts 0", false, [](BufferConfig& c) { c.num_experts = 0; }},
      {"topk 0", false, [](BufferConfig& c) { c.topk = 0; }},
      {"topk above experts", false, [](BufferConfig& c) { c.topk = c.num_experts + 1; }},
      {"fp8 with hidden 200", false, [](BufferConfig& c) { c.hidden = 200, c.wire = WireFormat::fp8; }},
      {"nvfp4 with hidden 40", false, [](BufferConfig& c) { c.hidden = 40, c.wire = WireFormat::nvfp4; }},
      {"alignment 0", false, [](BufferConfig& c) { c.expert_alignment = 0; }},
      {"capacity mode without rows", false, [](BufferConfig& c) { c.mode = CapacityMode::capacity, c.capacity_rows = 0; }},
      {"capacity factor negative", false, [](BufferConfig& c) { c.capacity_factor = -1.0; }},
      {"capacity factor nan", false, [](BufferConfig& c) { c.capacity_factor = std::nan(""); }},
      {"timeout negative", false, [](BufferConfig& c) { c.timeout_ms = -5; }},
      {"num_sms negative", false, [](BufferConfig& c) { c.num_sms = -1; }},
      {"send_blocks negative", false, [](BufferConfig& c) { c.send_blocks = -1; }},
      {"send_blocks not below num_sms", false, [](BufferConfig& c) { c.num_sms = 8, c.send_blocks = 8; }},
      {"unknown wire", false, [](BufferConfig& c) { c.wire = static_cast<WireFormat>(9); }},
      {"unknown mode", false, [](BufferConfig& c) { c.mode = static_cast<CapacityMode>(4); }},
      {"other hidden", true, [](BufferConfig& c) { c.hidden *= 2; }},
      {"other alignment", true, [](BufferConfig& c) { c.expert_alignment += 4; }},
      {"other capacity factor", true, [](BufferConfig& c) { c.capacity_factor += 0.5; }},
  };
  return spoils;
}

BufferConfig random_config(Rng& rng, int ranks) {
  static const WireFormat wires[] = {WireFormat::bf16, WireFormat::fp8, WireFormat::fp8_ue8m0, WireFormat::nvfp4};
  BufferConfig c;
  c.wire = wires[pick(rng, 4)];
  c.hidden = c.wire == WireFormat::bf16 ? 8 * (1 + pick(rng, 24)) : (c.wire == WireFormat::nvfp4 ? 16 * (1 + pick(rng, 8)) : 128 * (1 + pick(rng, 2)));
  c.max_tokens_per_rank = pick(rng, 12);
  c.num_experts = ranks * (1 + pick(rng, 4));
  c.topk = 1 + pick(rng, static_cast<int>(std::min<int64_t>(c.num_experts, 4)));
  c.expert_alignment = chance(rng, 50) ? 1 : 1 + pick(rng, 8);
  if (chance(rng, 20)) c.mode = CapacityMode::capacity, c.capacity_rows = 1 + pick(rng, 40);
  if (chance(rng, 20)) c.capacity_factor = 0.25 * (1 + pick(rng, 8));
  c.timeout_ms = kTimeoutMs;
  return c;
}

// ---- dispatch inputs ----

struct RankData {  // one rank's dispatch input, in arrays this test owns
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  std::vector<int64_t> idx64;
  std::vector<float> w;
  DispatchInput in;
};

struct InputSpoil {
  const char* name;
  bool valid;
  std::function<void(RankData&, const BufferConfig&)> apply;
};

const std::vector<InputSpoil>& input_spoils() {
  static const std::vector<InputSpoil> spoils = {
      {"expert id = E", false, [](RankData& d, const BufferConfig& c) { d.idx[0] = static_cast<int32_t>(c.num_experts); }},
      {"expert id -2", false, [](RankData& d, const BufferConfig&) { d.idx[0] = -2; }},
      {"expert twice in a token", false,
       [](RankData& d, const BufferConfig& c) {
         if (c.topk < 2) d.idx[0] = static_cast<int32_t>(c.num_experts + 3);  // then another bad id
         else d.idx[1] = d.idx[0] = 0;
       }},
      {"x f32", false, [](RankData& d, const BufferConfig&) { d.in.x.dtype = DType::f32; }},
      {"x null", false, [](RankData& d, const BufferConfig&) { d.in.x.data = nullptr; }},
      {"x missing", false, [](RankData& d, const BufferConfig&) { d.in.x = {}; }},
      {"x wrong hidden", false, [](RankData& d, const BufferConfig&) { d.in.x.shape[1] -= 1; }},
      {"x 3-d", false, [](RankData& d, const BufferConfig&) { d.in.x.ndim = 3, d.in.x.shape[2] = 1, d.in.x.strides[2] = 1; }},
      {"x strided last dim", false, [](RankData& d, const BufferConfig&) { d.in.x.strides[1] = 2; }},
      {"x on cuda", false, [](RankData& d, const BufferConfig&) { d.in.x.device = DeviceKind::cuda; }},
      {"idx f32", false, [](RankData& d, const BufferConfig&) { d.in.topk_idx.dtype = DType::f32; }},
      {"idx wrong k", false, [](RankData& d, const BufferConfig&) { d.in.topk_idx.shape[1] += 1; }},
      {"idx other rows", false, [](RankData& d, const BufferConfig&) { d.in.topk_idx.shape[0] += 1; }},
      {"weights bf16", false, [](RankData& d, const BufferConfig&) { d.in.topk_weights.dtype = DType::bf16; }},
      {"weights null", false, [](RankData& d, const BufferConfig&) { d.in.topk_weights.data = nullptr; }},
      {"routing map as well", false, [](RankData& d, const BufferConfig&) { d.in.routing_map = d.in.topk_idx; }},
      {"no routing", false, [](RankData& d, const BufferConfig&) { d.in.topk_idx = {}, d.in.topk_weights = {}; }},
      {"scales with bf16 x", false, [](RankData& d, const BufferConfig&) { d.in.x_scales = d.in.topk_weights; }},
      {"unused slots", true, [](RankData& d, const BufferConfig&) { d.idx[0] = -1; }},
      {"i64 ids", true,
       [](RankData& d, const BufferConfig&) {
         d.idx64.assign(d.idx.begin(), d.idx.end());
         d.in.topk_idx.data = d.idx64.data();
         d.in.topk_idx.dtype = DType::i64;
       }},
      {"no weights", true, [](RankData& d, const BufferConfig&) { d.in.topk_weights = {}; }},
  };
  return spoils;
}

// Random routing for rank r: distinct experts per token, some slots unused.
RankData random_input(Rng& rng, const BufferConfig& c, int64_t tokens) {
  RankData d;
  d.x = verify::random_bf16(tokens * c.hidden, rng());
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> experts(c.num_experts);
    for (int64_t e = 0; e < c.num_experts; ++e) experts[e] = static_cast<int32_t>(e);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t k = 0; k < c.topk; ++k) {
      d.idx.push_back(chance(rng, 15) ? -1 : experts[k]);
      d.w.push_back(0.125f * static_cast<float>(1 + pick(rng, 8)));
    }
  }
  d.in.x = TensorView::of(d.x.data(), DType::bf16, {tokens, c.hidden});
  d.in.topk_idx = TensorView::of(d.idx.data(), DType::i32, {tokens, c.topk});
  d.in.topk_weights = TensorView::of(d.w.data(), DType::f32, {tokens, c.topk});
  return d;
}

// The reference's view of the accepted inputs (after the valid spoils).
verify::Problem problem_of(const BufferConfig& c, const std::vector<RankData>& data) {
  verify::Problem p{c, static_cast<int>(data.size()), false, {}, {}};
  for (const RankData& d : data) {
    verify::RankInput in;
    in.tokens = d.in.x.shape[0];
    in.x = d.x;
    in.idx = d.idx;
    in.weights = d.w;
    in.has_weights = d.in.topk_weights.defined();
    p.inputs.push_back(in);
  }
  return p;
}

// ---- one case through the C++ API ----

struct CaseResult {
  std::string failure;  // empty: the case ended as it must
  std::string kind;     // what was spoiled, for the message and the statistics
};

CaseResult run_case(uint64_t seed) {
  Rng rng(seed);
  const int ranks = 1 + pick(rng, 3);
  const BufferConfig base = random_config(rng, ranks);
  std::vector<BufferConfig> configs(ranks, base);
  std::vector<bool> refusing(ranks, false);
  bool disagree = false;
  std::string kind = "none";
  std::string timing;

  // Step 1: creation, with a spoiled config on some ranks in a third of the cases.
  if (chance(rng, 33)) {
    const ConfigSpoil& s = config_spoils()[pick(rng, static_cast<int>(config_spoils().size()))];
    if (ranks < s.min_ranks) return {"", "skipped"};
    kind = std::string("config: ") + s.name;
    const bool everyone = chance(rng, 25);
    for (int r = 0; r < ranks; ++r)
      if (everyone || r == ranks - 1) {
        s.apply(configs[r]);
        refusing[r] = !s.valid;
      }
    disagree = s.valid && !everyone && ranks > 1;
  }
  std::vector<std::unique_ptr<Buffer>> buffers(ranks);
  const HostWorld world(ranks);
  const auto created = on_ranks(
      ranks, [&](int r) { buffers[r] = std::make_unique<Buffer>(world.group(r), configs[r]); }, "creation", timing);
  std::string verdict = judge(created, refusing, disagree, "creation");
  if (!verdict.empty() || !timing.empty()) return {verdict.empty() ? timing : verdict, kind};
  if (!created[0].ok) return {"", kind};  // refused as it must be
  const BufferConfig& c = configs[0];

  // Step 2: dispatch, with a spoiled input or option on some ranks.
  std::vector<RankData> data;
  for (int r = 0; r < ranks; ++r) data.push_back(random_input(rng, c, pick(rng, static_cast<int>(c.max_tokens_per_rank) + 1)));
  std::vector<DispatchOptions> options(ranks);
  const Layout layout = chance(rng, 50) ? Layout::expert_major : Layout::rank_major;
  for (auto& o : options) o.layout = layout;
  refusing.assign(ranks, false);
  disagree = false;
  const int spoiled = chance(rng, 25) ? -1 : pick(rng, ranks);  // -1: every rank
  const int what = pick(rng, 10);
  if (what < 7) {
    const InputSpoil& s = input_spoils()[pick(rng, static_cast<int>(input_spoils().size()))];
    bool applied = false;
    for (int r = 0; r < ranks; ++r)
      if ((spoiled < 0 || r == spoiled) && !data[r].idx.empty()) {
        s.apply(data[r], c);
        refusing[r] = !s.valid;
        applied = true;
      }
    if (applied) kind = std::string("input: ") + s.name;
  } else if (what == 7) {
    const int r = spoiled < 0 ? 0 : spoiled;
    options[r].nvfp4_global_scale = chance(rng, 50) ? -1.0f : std::nanf("");
    refusing[r] = true;
    kind = "option: bad nvfp4 global scale";
  } else if (what == 8 && ranks > 1) {
    options[ranks - 1].layout = layout == Layout::expert_major ? Layout::rank_major : Layout::expert_major;
    disagree = true;
    kind = "option: layouts differ";
  }
  std::vector<DispatchResult> got(ranks);
  const auto dispatched = on_ranks(
      ranks, [&](int r) { got[r] = buffers[r]->dispatch(data[r].in, options[r]); }, "dispatch", timing);
  verdict = judge(dispatched, refusing, disagree, "dispatch (" + kind + ")");
  if (!verdict.empty() || !timing.empty()) return {verdict.empty() ? timing : verdict, kind};
  if (!dispatched[0].ok) return {"", kind};
  const verify::Problem p = problem_of(c, data);
  const auto kept = verify::kept_routing(p);
  for (int r = 0; r < ranks; ++r) {
    const std::string wrong = verify::check_dispatch(p, kept, r, layout, 0.0f, got[r]);
    if (!wrong.empty()) return {cat("dispatch (", kind, "), rank ", r, ": accepted but wrong: ", wrong), kind};
  }

  // Step 2b: a cached dispatch of the same rows, with a spoiled input or handle on some ranks;
  // accepted, its rows are the dispatch's.
  {
    std::vector<DispatchInput> again(ranks);
    std::vector<Handle> with(ranks);
    for (int q = 0; q < ranks; ++q) {
      again[q] = x_only(data[q].in);
      with[q] = got[q].handle;
    }
    refusing.assign(ranks, false);
    const int q = pick(rng, ranks);
    std::string cached_kind = "cached as is";
    switch (pick(rng, 8)) {
      case 0: again[q].topk_idx = data[q].in.topk_idx, refusing[q] = true, cached_kind = "cached: routing given"; break;
      case 1: again[q].x.shape[0] += 1, refusing[q] = true, cached_kind = "cached: a token too many"; break;
      case 2: again[q].x.dtype = DType::f32, refusing[q] = true, cached_kind = "cached: x f32"; break;
      case 3: with[q] = Handle{}, refusing[q] = true, cached_kind = "cached: empty handle"; break;
      default: break;
    }
    std::vector<DispatchResult> cached(ranks);
    const auto done = on_ranks(
        ranks, [&](int w) { cached[w] = buffers[w]->dispatch(again[w], with[w]); }, "cached dispatch", timing);
    verdict = judge(done, refusing, false, "cached dispatch (" + kind + ", " + cached_kind + ")");
    if (!verdict.empty() || !timing.empty()) return {verdict.empty() ? timing : verdict, kind};
    for (int w = 0; w < ranks && done[0].ok; ++w) {
      const Tensor& a = cached[w].recv_x;
      const Tensor& b = got[w].recv_x;
      if (a.numel() != b.numel() || std::memcmp(a.data<char>(), b.data<char>(), a.numel() * dtype_size(a.dtype())) != 0)
        return {cat("cached dispatch (", kind, "), rank ", w, ": accepted but its rows differ from the dispatch's"), kind};
    }
  }

  // Step 3: combine, with a spoiled input or handle on some ranks.
  bool weighted = layout == Layout::expert_major;  // where every rank has weights
  for (const auto& in : p.inputs) weighted &= in.has_weights;
  std::vector<std::vector<uint16_t>> ys(ranks);
  std::vector<CombineInput> inputs(ranks);
  std::vector<Handle> handles(ranks);
  for (int r = 0; r < ranks; ++r) {
    const int64_t rows = got[r].recv_x.size(0);
    ys[r] = verify::random_bf16((rows + 1) * c.hidden, rng());
    inputs[r].y = bf16_view(ys[r], rows, c.hidden);
    handles[r] = got[r].handle;
  }
  refusing.assign(ranks, false);
  const int r = pick(rng, ranks);
  switch (pick(rng, 6)) {
    case 0: inputs[r].y.shape[0] += 1, refusing[r] = true, kind = "combine: a row too many"; break;
    case 1: inputs[r].y.dtype = DType::f32, refusing[r] = true, kind = "combine: y f32"; break;
    case 2: inputs[r].y = {}, refusing[r] = true, kind = "combine: y missing"; break;
    case 3: handles[r] = Handle{}, refusing[r] = true, kind = "combine: empty handle"; break;
    default: kind += ", combine as is"; break;
  }
  std::vector<CombineResult> out(ranks);
  const auto combined = on_ranks(
      ranks, [&](int q) { out[q] = buffers[q]->combine(inputs[q], handles[q], {weighted}); }, "combine", timing);
  verdict = judge(combined, refusing, false, "combine (" + kind + ")");
  if (!verdict.empty() || !timing.empty()) return {verdict.empty() ? timing : verdict, kind};
  if (!combined[0].ok) return {"", kind};
  std::vector<verify::Expected> layouts;
  for (int q = 0; q < ranks; ++q) layouts.push_back(verify::expected_dispatch(p, kept, q, layout));
  for (int q = 0; q < ranks; ++q) {
    const auto want = verify::expected_combine(p, kept, layouts, ys, q, layout, weighted, nullptr);
    const std::string wrong =
        verify::compare_bits(out[q].out.data<uint16_t>(), want.data(), static_cast<int64_t>(want.size()), 2, "combine out");
    if (!wrong.empty()) return {cat("combine (", kind, "), rank ", q, ": accepted but wrong: ", wrong), kind};
  }
  return {"", kind};
}

TEST(Fuzz, CppApiEndsInVerifiedSuccessOrTheSameErrorOnEveryRank) {
  std::map<std::string, int> kinds;
  int failures = 0;
  for (int i = 0; i < kCases && failures < 10; ++i) {
    const CaseResult result = run_case(0x5eed0000u + static_cast<uint64_t>(i));
    ++kinds[result.kind.substr(0, result.kind.find_first_of(":,"))];
    if (!result.failure.empty()) {
      ADD_FAILURE() << "case " << i << " (" << result.kind << "): " << result.failure;
      ++failures;
    }
  }
  // Every family of spoils came up (the generator works).
  for (const char* family : {"none", "config", "input", "option", "combine"}) EXPECT_GT(kinds[family], 20) << family;
  for (const auto& [family, count] : kinds) std::printf("%-10s %5d cases\n", family.c_str(), count);
}

// ---- the C ABI ----

epx_tensor c_tensor(const TensorView& v) {
  epx_tensor t{};
  if (!v.defined()) return t;
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.ndim = v.ndim;
  for (int d = 0; d < v.ndim; ++d) t.shape[d] = v.shape[d], t.strides[d] = v.strides[d];
  t.device = static_cast<int32_t>(v.device);
  return t;
}

epx_buffer_config c_config(const BufferConfig& c) {
  epx_buffer_config cfg;
  epx_buffer_config_default(&cfg);
  cfg.hidden = c.hidden;
  cfg.max_tokens_per_rank = c.max_tokens_per_rank;
  cfg.num_experts = c.num_experts;
  cfg.topk = c.topk;
  cfg.wire = static_cast<int32_t>(c.wire);
  cfg.expert_alignment = c.expert_alignment;
  cfg.mode = static_cast<int32_t>(c.mode);
  cfg.capacity_rows = c.capacity_rows;
  cfg.capacity_factor = c.capacity_factor;
  cfg.timeout_ms = c.timeout_ms;
  return cfg;
}

// A C call's status as an Outcome (EPX_OK: ok).
Outcome c_outcome(epx_status s) {
  if (s == EPX_OK) return {};
  return {false, static_cast<ErrorCode>(s), epx_last_error()};
}

struct CSpoil {
  const char* name;
  std::function<void(epx_dispatch_args&, epx_result**&)> apply;
};

const std::vector<CSpoil>& c_spoils() {
  static const std::vector<CSpoil> spoils = {
      {"unknown dtype code", [](epx_dispatch_args& a, epx_result**&) { a.x.dtype = 9; }},
      {"negative dtype code", [](epx_dispatch_args& a, epx_result**&) { a.topk_idx.dtype = -1; }},
      {"ndim 5", [](epx_dispatch_args& a, epx_result**&) { a.x.ndim = 5; }},
      {"ndim negative", [](epx_dispatch_args& a, epx_result**&) { a.topk_idx.ndim = -3; }},
      {"unknown device code", [](epx_dispatch_args& a, epx_result**&) { a.x.device = 7; }},
      {"unknown layout code", [](epx_dispatch_args& a, epx_result**&) { a.layout = 2; }},
      {"NULL out", [](epx_dispatch_args&, epx_result**& out) { out = nullptr; }},
      {"null x data", [](epx_dispatch_args& a, epx_result**&) { a.x.data = nullptr; }},
      {"no spoil", [](epx_dispatch_args&, epx_result**&) {}},
  };
  return spoils;
}

// Creation and one dispatch through the C ABI, a spoil on one rank; then a good dispatch on
// every rank, which must pair up and match the reference (the failed call consumed nothing).
std::string run_c_case(uint64_t seed) {
  Rng rng(seed);
  const int ranks = 1 + pick(rng, 3);
  BufferConfig c = random_config(rng, ranks);
  c.max_tokens_per_rank = std::max<int64_t>(c.max_tokens_per_rank, 1);
  epx_world* world = nullptr;
  if (epx_host_world_create(ranks, &world) != EPX_OK) return std::string("world: ") + epx_last_error();
  std::vector<epx_buffer*> buffers(ranks, nullptr);
  std::string timing;
  // Creation, with an unknown wire or mode code on one rank in a fifth of the cases.
  std::vector<epx_buffer_config> configs(ranks, c_config(c));
  std::vector<bool> refusing(ranks, false);
  if (chance(rng, 20)) {
    (chance(rng, 50) ? configs[ranks - 1].wire : configs[ranks - 1].mode) = 7;
    refusing[ranks - 1] = true;
  }
  auto created = on_ranks(
      ranks, [&](int r) { Outcome o = c_outcome(epx_buffer_create(world, r, &configs[r], &buffers[r])); if (!o.ok) throw Error(o.code, o.what); },
      "C creation", timing);
  std::string verdict = judge(created, refusing, false, "C creation");
  if (verdict.empty() && created[0].ok) {
    std::vector<RankData> data;
    for (int r = 0; r < ranks; ++r) data.push_back(random_input(rng, c, 1 + pick(rng, static_cast<int>(c.max_tokens_per_rank))));
    const CSpoil& s = c_spoils()[pick(rng, static_cast<int>(c_spoils().size()))];
    const int bad = pick(rng, ranks);
    refusing.assign(ranks, false);
    refusing[bad] = std::strcmp(s.name, "no spoil") != 0;
    std::vector<epx_result*> results(ranks, nullptr);
    auto dispatch = [&](int r, bool spoil) {
      epx_dispatch_args a{};
      a.x = c_tensor(data[r].in.x);
      a.topk_idx = c_tensor(data[r].in.topk_idx);
      a.topk_weights = c_tensor(data[r].in.topk_weights);
      epx_result** out = &results[r];
      if (spoil) s.apply(a, out);
      const Outcome o = c_outcome(epx_dispatch(buffers[r], &a, out));
      if (!o.ok) throw Error(o.code, o.what);
    };
    auto first = on_ranks(ranks, [&](int r) { dispatch(r, r == bad); }, "C dispatch", timing);
    verdict = judge(first, refusing, false, cat("C dispatch (", s.name, " on rank ", bad, ")"));
    for (auto*& res : results) epx_result_destroy(res), res = nullptr;
    if (verdict.empty()) {
      auto second = on_ranks(ranks, [&](int r) { dispatch(r, false); }, "C dispatch after", timing);
      verdict = judge(second, std::vector<bool>(ranks, false), false, "C dispatch after the spoiled one");
      const verify::Problem p = problem_of(c, data);
      const auto kept = verify::kept_routing(p);
      for (int r = 0; r < ranks && verdict.empty(); ++r) {
        // The C result's tensors, as the C++ DispatchResult the reference checks.
        DispatchResult d;
        auto tensor = [&](const char* name) {
          epx_tensor t{};
          if (epx_result_tensor(results[r], name, &t) != EPX_OK) return Tensor();
          TensorView v;
          v.data = t.data, v.dtype = static_cast<DType>(t.dtype), v.ndim = t.ndim;
          for (int k = 0; k < t.ndim; ++k) v.shape[k] = t.shape[k], v.strides[k] = t.strides[k];
          return Tensor(std::shared_ptr<void>(), v);
        };
        d.recv_x = tensor("recv_x"), d.recv_scales = tensor("recv_scales");
        d.recv_global_scale = tensor("recv_global_scale"), d.recv_src = tensor("recv_src");
        d.recv_weights = tensor("recv_weights"), d.expert_offsets = tensor("expert_offsets");
        d.tokens_per_expert = tensor("tokens_per_expert"), d.rank_offsets = tensor("rank_offsets");
        int64_t overflow = 0;
        epx_result_int(results[r], "num_rows", &d.num_rows);
        epx_result_int(results[r], "overflow", &overflow);
        epx_result_int(results[r], "dropped_slots", &d.dropped_slots);
        d.overflow = overflow != 0;
        const std::string wrong = verify::check_dispatch(p, kept, r, Layout::expert_major, 0.0f, d);
        if (!wrong.empty()) verdict = cat("C dispatch after the spoiled one, rank ", r, ": wrong: ", wrong);
      }
      for (auto* res : results) epx_result_destroy(res);
    }
  }
  for (auto* b : buffers) epx_buffer_destroy(b);
  epx_host_world_destroy(world);
  return verdict.empty() ? timing : verdict;
}

TEST(Fuzz, CApiEndsInVerifiedSuccessOrTheSameErrorOnEveryRank) {
  int failures = 0;
  for (int i = 0; i < kCApiCases && failures < 10; ++i) {
    const std::string failure = run_c_case(0xcab10000u + static_cast<uint64_t>(i));
    if (!failure.empty()) {
      ADD_FAILURE() << "case " << i << ": " << failure;
      ++failures;
    }
  }
}

}  // namespace
}  // namespace epx::test
