// Every check takes part in the collective: a call or a creation that one rank refuses fails on
// every rank at once with that rank's reason, and handles of different dispatches never mix.
#include <chrono>
#include <thread>

#include "harness.hpp"

namespace epx::test {
namespace {

using testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// Long enough that a rank left waiting for its timeout would fail the time checks below.
constexpr int64_t kTimeoutMs = 20000;
constexpr auto kPrompt = std::chrono::seconds(3);

BufferConfig config(int64_t hidden, int64_t tokens, int64_t experts, int64_t topk) {
  BufferConfig c = small_config(hidden, tokens, experts, topk);
  c.timeout_ms = kTimeoutMs;
  return c;
}

// Rows of 1.0 with `used` of their `topk` slots set: token t picks experts (t + j) % E for j < used
// (weights 0.5), the other slots are -1.
struct Routing {
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  std::vector<float> w;
  DispatchInput view(int64_t tokens, int64_t hidden, int64_t topk) const {
    DispatchInput in;
    in.x = TensorView::of(const_cast<uint16_t*>(x.data()), DType::bf16, {tokens, hidden});
    in.topk_idx = TensorView::of(const_cast<int32_t*>(idx.data()), DType::i32, {tokens, topk});
    in.topk_weights = TensorView::of(const_cast<float*>(w.data()), DType::f32, {tokens, topk});
    return in;
  }
};

Routing routing(int64_t tokens, int64_t hidden, int64_t topk, int64_t experts, int64_t used) {
  Routing r;
  r.x.assign(tokens * hidden, 0x3f80);  // 1.0
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < topk; ++j) {
      r.idx.push_back(j < used ? static_cast<int32_t>((t + j) % experts) : -1);
      r.w.push_back(j < used ? 0.5f : 0.0f);
    }
  return r;
}

// The issue's case: dispatches A (16 rows, 2 experts a token) and B (8 rows, 1 expert) on one
// buffer; rank 0 combines with B's handle, rank 1 with A's. Both must refuse, not sum wrong rows.
TEST(Agreement, HandlesOfDifferentDispatchesFailEveryRank) {
  const BufferConfig c = config(128, 16, 8, 2);
  const Routing a = routing(16, 128, 2, 8, 2), b = routing(8, 128, 2, 8, 1);
  std::vector<ErrorCode> codes(2);
  std::vector<std::string> words(2);
  std::vector<float> after(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    Buffer buffer(g, c);
    DispatchResult da = buffer.dispatch(a.view(16, 128, 2));
    DispatchResult db = buffer.dispatch(b.view(8, 128, 2));
    const DispatchResult& mine = r == 0 ? db : da;
    std::vector<uint16_t> y(mine.recv_x.numel(), 0x3f80);
    codes[r] = code_of([&] { buffer.combine({bf16_view(y, mine.recv_x.size(0), 128), {}}, mine.handle, {true}); },
                       &words[r]);
    // The buffer goes on: both ranks now combine A's dispatch, each expert row 1.0, weights 0.5.
    std::vector<uint16_t> ya(da.recv_x.numel(), 0x3f80);
    CombineResult out = buffer.combine({bf16_view(ya, da.recv_x.size(0), 128), {}}, da.handle, {true});
    after[r] = bf16_to_float(out.out.data<uint16_t>()[0]);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(codes[r], ErrorCode::config_mismatch) << "rank " << r << ": " << words[r];
    EXPECT_THAT(words[r], HasSubstr("handle of dispatch #"));
    EXPECT_EQ(after[r], 1.0f) << "rank " << r;  // 0.5 * 1 + 0.5 * 1
  }
}

TEST(Agreement, HandlesOfDifferentCallsWithTheSameRoutingFailEveryRank) {
  const BufferConfig c = config(128, 16, 8, 2);
  const Routing a = routing(16, 128, 2, 8, 2);
  std::vector<ErrorCode> codes(2);
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    Buffer buffer(g, c);
    DispatchResult first = buffer.dispatch(a.view(16, 128, 2));
    DispatchResult second = buffer.dispatch(a.view(16, 128, 2));
    const DispatchResult& mine = g.rank() == 0 ? first : second;
    std::vector<uint16_t> y(mine.recv_x.numel(), 0x3f80);
    codes[g.rank()] = code_of([&] { buffer.combine({bf16_view(y, mine.recv_x.size(0), 128), {}}, mine.handle); });
    // dispatch_backward and combine_backward check the same.
    EXPECT_EQ(code_of([&] { buffer.dispatch_backward({bf16_view(y, mine.recv_x.size(0), 128), {}}, mine.handle); }),
              ErrorCode::config_mismatch);
    std::vector<uint16_t> grad(16 * 128, 0x3f80);
    EXPECT_EQ(code_of([&] { buffer.combine_backward({bf16_view(grad, 16, 128), bf16_view(y, mine.recv_x.size(0), 128)}, mine.handle); }),
              ErrorCode::config_mismatch);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(codes[r], ErrorCode::config_mismatch) << "rank " << r;
  }
}

// The issue's case: fp8 with hidden 200 on rank 1 only (invalid), bf16 on rank 0.
TEST(Agreement, AConfigRefusedOnOneRankFailsEveryRankAtOnce) {
  std::vector<std::string> words(2);
  std::vector<ErrorCode> codes(2);
  const auto start = Clock::now();
  auto errors = verify::run_ranks(2, [&](const Group& g) {
    BufferConfig c = config(200, 16, 8, 2);
    if (g.rank() == 1) c.wire = WireFormat::fp8;
    codes[g.rank()] = code_of([&] { Buffer b(g, c); }, &words[g.rank()]);
  });
  EXPECT_LT(Clock::now() - start, kPrompt);
  EXPECT_EQ(codes[1], ErrorCode::invalid_argument);
  EXPECT_THAT(words[1], HasSubstr("needs hidden to be a multiple of 128"));
  EXPECT_EQ(codes[0], ErrorCode::peer_failed);
  EXPECT_THAT(words[0], HasSubstr("rank 1 refused its config"));
  EXPECT_THAT(words[0], HasSubstr("needs hidden to be a multiple of 128"));
  // The group goes on: the next buffer of every rank pairs up as before.
  errors = verify::run_ranks(2, [&](const Group& g) { Buffer b(g, config(128, 16, 8, 2)); });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Agreement, ALowLatencyConfigRefusedOnOneRankFailsEveryRankAtOnce) {
  std::vector<std::string> words(2);
  std::vector<ErrorCode> codes(2);
  const auto start = Clock::now();
  HostWorld world(2);
  verify::run_threads(2, [&](int r) {
    LowLatencyConfig c{128, 16, 8, 2, WireFormat::bf16, kTimeoutMs};
    if (r == 1) c.topk = 99;
    codes[r] = code_of([&] { LowLatencyBuffer b(world.group(r), c); }, &words[r]);
  });
  EXPECT_LT(Clock::now() - start, kPrompt);
  EXPECT_EQ(codes[1], ErrorCode::invalid_argument);
  EXPECT_EQ(codes[0], ErrorCode::peer_failed);
  EXPECT_THAT(words[0], HasSubstr("topk must be in"));
  // Then both create a good one and use it.
  auto errors = verify::run_threads(2, [&](int r) {
    LowLatencyBuffer b(world.group(r), LowLatencyConfig{128, 16, 8, 2, WireFormat::bf16, kTimeoutMs});
    const Routing in = routing(16, 128, 2, 8, 2);
    LowLatencyDispatchInput d;
    d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {16, 128});
    d.topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {16, 2});
    b.dispatch(d);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A front end's own refusal (a binding that cannot even build the input) joins the call.
TEST(Agreement, RejectFailsThePeersSameCall) {
  const BufferConfig c = config(128, 16, 8, 2);
  const Routing a = routing(16, 128, 2, 8, 2);
  for (Op op : {Op::dispatch, Op::combine, Op::dispatch_backward, Op::combine_backward, Op::cached_dispatch}) {
    std::vector<std::string> words(2);
    std::vector<ErrorCode> codes(2);
    const auto start = Clock::now();
    auto errors = verify::run_ranks(2, [&](const Group& g) {
      Buffer buffer(g, c);
      DispatchResult d = buffer.dispatch(a.view(16, 128, 2));
      std::vector<uint16_t> y(d.recv_x.numel(), 0x3f80), grad(16 * 128, 0x3f80);
      const TensorView yv = bf16_view(y, d.recv_x.size(0), 128);
      auto call = [&] {
        if (g.rank() == 1) buffer.reject(op, "binding: x is not contiguous");
        switch (op) {
          case Op::dispatch: buffer.dispatch(a.view(16, 128, 2)); break;
          case Op::combine: buffer.combine({yv, {}}, d.handle); break;
          case Op::dispatch_backward: buffer.dispatch_backward({yv, {}}, d.handle); break;
          case Op::combine_backward: buffer.combine_backward({bf16_view(grad, 16, 128), yv}, d.handle); break;
          case Op::cached_dispatch: buffer.dispatch(x_only(a.view(16, 128, 2)), d.handle); break;
        }
      };
      codes[g.rank()] = code_of(call, &words[g.rank()]);
      buffer.combine({yv, {}}, d.handle);  // still usable, and the calls still pair up
    });
    EXPECT_LT(Clock::now() - start, kPrompt) << op_name(op);
    EXPECT_EQ(errors[0], "") << op_name(op);
    EXPECT_EQ(errors[1], "") << op_name(op);
    EXPECT_EQ(codes[1], ErrorCode::invalid_argument) << op_name(op);
    EXPECT_EQ(words[1], "binding: x is not contiguous");
    EXPECT_EQ(codes[0], ErrorCode::peer_failed) << op_name(op);
    EXPECT_THAT(words[0], HasSubstr(std::string(op_name(op)) + " #"));
    EXPECT_THAT(words[0], HasSubstr("rank 1 rejected its input, so the group stops: binding: x is not contiguous"));
  }
}


// LowLatencyBuffer::reject joins the next call of its kind: the peers fail with the reason, and the
// buffer goes on (the next calls pair up).
TEST(Agreement, LowLatencyRejectFailsThePeersSameCall) {
  for (LowLatencyOp op : {LowLatencyOp::dispatch, LowLatencyOp::combine}) {
    std::vector<ErrorCode> codes(2);
    std::vector<std::string> words(2);
    const auto start = Clock::now();
    auto errors = verify::run_ranks(2, [&](const Group& g) {
      LowLatencyBuffer b(g, LowLatencyConfig{128, 16, 8, 2, WireFormat::bf16, kTimeoutMs});
      const Routing in = routing(16, 128, 2, 8, 2);
      LowLatencyDispatchInput d;
      d.x = TensorView::of(const_cast<uint16_t*>(in.x.data()), DType::bf16, {16, 128});
      d.topk_idx = TensorView::of(const_cast<int32_t*>(in.idx.data()), DType::i32, {16, 2});
      d.topk_weights = TensorView::of(const_cast<float*>(in.w.data()), DType::f32, {16, 2});
      const LowLatencyDispatchResult first = b.dispatch(d);
      std::vector<uint16_t> y(first.recv_x.numel(), 0x3f80);
      LowLatencyCombineInput c;
      c.y = TensorView::of(y.data(), DType::bf16, {first.recv_x.size(0), first.recv_x.size(1), 128});
      auto call = [&] {
        if (g.rank() == 1) b.reject(op, "binding: y is not contiguous");
        if (op == LowLatencyOp::dispatch) b.dispatch(d);
        else b.combine(c, first.handle);
      };
      codes[g.rank()] = code_of(call, &words[g.rank()]);
      const LowLatencyDispatchResult again = b.dispatch(d);  // still usable
      b.combine(c, again.handle);
    });
    const char* name = op == LowLatencyOp::dispatch ? "dispatch" : "combine";
    EXPECT_LT(Clock::now() - start, kPrompt) << name;
    EXPECT_EQ(errors[0], "") << name;
    EXPECT_EQ(errors[1], "") << name;
    EXPECT_EQ(codes[1], ErrorCode::invalid_argument) << name;
    EXPECT_EQ(words[1], "binding: y is not contiguous") << name;
    EXPECT_EQ(codes[0], ErrorCode::peer_failed) << name;
    EXPECT_THAT(words[0], HasSubstr("rank 1 rejected its input, so the group stops: binding: y is not contiguous"))
        << name;
  }
}

// A cached dispatch refuses routing, another T, and a handle of another buffer on every rank at
// once; ranks in different calls (one cached, one not) or on handles of different dispatches fail
// with config_mismatch. The buffer goes on after each.
TEST(Agreement, CachedDispatchRefusalsFailEveryRank) {
  const BufferConfig c = config(128, 16, 8, 2);
  const Routing a = routing(16, 128, 2, 8, 2), b = routing(8, 128, 2, 8, 1);
  struct Case {
    const char* name;
    ErrorCode bad_rank_code, peer_code;
    const char* words;  // in the failing rank's message
  };
  const Case cases[] = {
      {"routing given", ErrorCode::invalid_argument, ErrorCode::peer_failed, "takes the routing of its handle"},
      {"other T", ErrorCode::invalid_argument, ErrorCode::peer_failed, "the handle's dispatch had 16"},
      {"other buffer's handle", ErrorCode::invalid_argument, ErrorCode::peer_failed, "another buffer"},
      {"full dispatch on the peer", ErrorCode::config_mismatch, ErrorCode::config_mismatch, "cached_dispatch"},
      {"handle of another dispatch", ErrorCode::config_mismatch, ErrorCode::config_mismatch, "disagree"},
  };
  for (const Case& k : cases) {
    std::vector<ErrorCode> codes(2);
    std::vector<std::string> words(2);
    const auto start = Clock::now();
    auto errors = verify::run_ranks(2, [&](const Group& g) {
      Buffer buffer(g, c), other(g, c);
      DispatchResult da = buffer.dispatch(a.view(16, 128, 2));
      DispatchResult db = buffer.dispatch(b.view(8, 128, 2));
      DispatchResult dother = other.dispatch(a.view(16, 128, 2));
      const DispatchInput xa = x_only(a.view(16, 128, 2)), xb = x_only(b.view(8, 128, 2));
      auto call = [&] {
        const bool bad = g.rank() == 1;
        const std::string name = k.name;
        if (bad && name == "routing given") buffer.dispatch(a.view(16, 128, 2), da.handle);
        else if (bad && name == "other T") buffer.dispatch(xb, da.handle);
        else if (bad && name == "other buffer's handle") buffer.dispatch(xa, dother.handle);
        else if (bad && name == "full dispatch on the peer") buffer.dispatch(a.view(16, 128, 2));
        else if (bad && name == "handle of another dispatch") buffer.dispatch(xb, db.handle);
        else buffer.dispatch(xa, da.handle);
      };
      codes[g.rank()] = code_of(call, &words[g.rank()]);
      DispatchResult again = buffer.dispatch(xa, da.handle);  // still usable, the calls still pair up
      EXPECT_EQ(again.recv_x.numel(), da.recv_x.numel());
    });
    EXPECT_LT(Clock::now() - start, kPrompt) << k.name;
    EXPECT_EQ(errors[0], "") << k.name;
    EXPECT_EQ(errors[1], "") << k.name;
    EXPECT_EQ(codes[1], k.bad_rank_code) << k.name << ": " << words[1];
    EXPECT_EQ(codes[0], k.peer_code) << k.name << ": " << words[0];
    EXPECT_THAT(words[1], HasSubstr(k.words)) << k.name;
  }
}

// Group::all_gather: every rank's record in rank order; a record too long on one rank fails every
// rank at once, and the group goes on (the next gather pairs up).
TEST(Agreement, GroupAllGatherSharesRecordsAndRefusalsEveryRank) {
  std::vector<std::vector<std::string>> got(3);
  std::vector<ErrorCode> codes(3);
  std::vector<std::string> words(3);
  const auto start = Clock::now();
  auto errors = verify::run_ranks(3, [&](const Group& g) {
    got[g.rank()] = g.all_gather(std::string(g.rank() + 1, static_cast<char>('a' + g.rank())), kTimeoutMs);
    const std::string record = g.rank() == 2 ? std::string(Group::kMaxRecordBytes + 1, 'x') : "fine";
    codes[g.rank()] = code_of([&] { g.all_gather(record, kTimeoutMs); }, &words[g.rank()]);
    EXPECT_EQ(g.all_gather("again", kTimeoutMs).size(), 3u);
  });
  EXPECT_LT(Clock::now() - start, kPrompt);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "");
    EXPECT_EQ(got[r], (std::vector<std::string>{"a", "bb", "ccc"}));
  }
  EXPECT_EQ(codes[2], ErrorCode::invalid_argument);
  EXPECT_EQ(codes[0], ErrorCode::peer_failed);
  EXPECT_THAT(words[0], HasSubstr("rank 2 failed: group all_gather: a record holds at most 1024 bytes"));
}

// A rank that arrives after its peers gave up on the creation fails too (it must not create a
// buffer they never made, or every later buffer would pair with the wrong one); the next buffers
// of every rank pair up and work.
TEST(Agreement, ALateRankFailsTheCreationItsPeersGaveUpOn) {
  BufferConfig c = config(128, 16, 8, 2);
  c.timeout_ms = 300;
  std::vector<ErrorCode> codes(2);
  HostWorld world(2);
  verify::run_threads(2, [&](int r) {
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
    codes[r] = code_of([&] { Buffer b(world.group(r), c); });
  });
  EXPECT_EQ(codes[0], ErrorCode::timeout);
  EXPECT_EQ(codes[1], ErrorCode::peer_failed);
  const Routing a = routing(16, 128, 2, 8, 2);
  std::vector<float> out(2);
  auto errors = verify::run_threads(2, [&](int r) {
    Buffer b(world.group(r), config(128, 16, 8, 2));
    DispatchResult d = b.dispatch(a.view(16, 128, 2));
    std::vector<uint16_t> y(d.recv_x.numel(), 0x3f80);
    out[r] = bf16_to_float(b.combine({bf16_view(y, d.recv_x.size(0), 128), {}}, d.handle).out.data<uint16_t>()[0]);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(out[r], 1.0f) << "rank " << r;
  }
}

}  // namespace
}  // namespace epx::test
