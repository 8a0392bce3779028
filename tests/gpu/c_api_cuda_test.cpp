// The C ABI on the CUDA backend: groups joined by an NCCL id (epx_nccl_unique_id +
// epx_cuda_group_init_rank) or made over the caller's communicator (epx_cuda_group_from_comm),
// buffers in them, dispatch and weighted combine of device tensors on the buffer's stream (or the
// caller's, epx_buffer_set_stream), results copied back after epx_buffer_synchronize and checked
// bit for bit against the host C ABI on the same inputs and against the closed form; and a refused
// argument through the C ABI, on one rank and with a peer.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>
#include <vector>

#include "cuda_harness.hpp"
#include "epx/epx.h"

namespace epx::test {
namespace {

constexpr int64_t kT = 32, kH = 256, kE = 8, kK = 4;
enum : int32_t { kBf16 = 0, kF32 = 1, kI32 = 4, kI64 = 5 };  // epx_tensor dtype codes

epx_buffer_config c_config(int64_t experts) {
  epx_buffer_config cfg;
  epx_buffer_config_default(&cfg);
  cfg.hidden = kH;
  cfg.max_tokens_per_rank = kT;
  cfg.num_experts = experts;
  cfg.topk = kK;
  cfg.expert_alignment = 4;
  cfg.timeout_ms = 60000;
  cfg.num_sms = 8;
  return cfg;
}

epx_tensor c_tensor(const void* data, int32_t dtype, int64_t rows, int64_t cols, int gpu) {
  epx_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.strides[0] = cols;
  t.strides[1] = 1;
  t.device = gpu >= 0 ? 1 : 0;
  t.device_index = gpu >= 0 ? gpu : 0;
  return t;
}

uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // exact for the small values used here
}

// One rank's inputs: bf16 x of small integers, distinct experts per token (the last slot unused
// on every fourth token), weights 0.5 and 0.25. Every weighted sum is exact in any order, so
// out[t] = x[t] * (the sum of its used weights) bit for bit.
struct Inputs {
  std::vector<uint16_t> x;
  std::vector<int32_t> idx;
  std::vector<float> w;
};

Inputs make_inputs(int rank, int64_t experts) {
  Inputs in;
  for (int64_t t = 0; t < kT; ++t) {
    for (int64_t h = 0; h < kH; ++h) in.x.push_back(bf16_bits(static_cast<float>(1 + (t * 3 + h + rank) % 7)));
    for (int64_t k = 0; k < kK; ++k) {
      const bool unused = k == kK - 1 && t % 4 == 0;
      in.idx.push_back(unused ? -1 : static_cast<int32_t>((t + k * 3 + rank) % experts));
      in.w.push_back(k % 2 == 0 ? 0.5f : 0.25f);
    }
  }
  return in;
}

// The closed form of the weighted combine of y = recv_x.
std::vector<uint16_t> expected_out(const Inputs& in) {
  std::vector<uint16_t> out(kT * kH);
  for (int64_t t = 0; t < kT; ++t) {
    float sum = 0.0f;
    for (int64_t k = 0; k < kK; ++k)
      if (in.idx[t * kK + k] >= 0) sum += in.w[t * kK + k];
    for (int64_t h = 0; h < kH; ++h) {
      uint32_t u = static_cast<uint32_t>(in.x[t * kH + h]) << 16;
      float x;
      std::memcpy(&x, &u, 4);
      out[t * kH + h] = bf16_bits(x * sum);
    }
  }
  return out;
}

// A host copy of a result tensor (device tensors copied after epx_buffer_synchronize).
template <typename T>
std::vector<T> fetch(const epx_result* r, const char* name, int expect_device) {
  epx_tensor t;
  const epx_status st = epx_result_tensor(r, name, &t);
  EXPECT_EQ(st, EPX_OK) << epx_last_error();
  if (st != EPX_OK) return {};
  EXPECT_EQ(t.device, expect_device) << name;
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
  std::vector<T> v(n);
  if (t.device == 1)
    EXPECT_EQ(cudaMemcpy(v.data(), t.data, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess) << name;
  else
    std::memcpy(v.data(), t.data, n * sizeof(T));
  return v;
}

// What a dispatch + weighted combine returned, on the host.
struct Outcome {
  int64_t num_rows = -1;
  std::vector<uint16_t> recv_x, out;
  std::vector<int32_t> recv_src;
  std::vector<float> recv_weights;
  std::vector<int64_t> expert_offsets, tokens_per_expert;
};

// Through the C ABI on `buffer`: an expert-major dispatch of `in` (copied to GPU `gpu`, or on the
// host when gpu < 0), then the weighted combine of y = recv_x.
Outcome run(epx_buffer* buffer, const Inputs& in, int gpu) {
  Outcome o;
  std::vector<DeviceArray> on_gpu;  // freed after the results, which are destroyed below
  const void* x = in.x.data();
  const void* idx = in.idx.data();
  const void* w = in.w.data();
  if (gpu >= 0) {
    on_gpu.emplace_back(in.x);
    on_gpu.emplace_back(in.idx);
    on_gpu.emplace_back(in.w);
    x = on_gpu[0].get();
    idx = on_gpu[1].get();
    w = on_gpu[2].get();
  }
  epx_dispatch_args args;
  std::memset(&args, 0, sizeof args);
  args.x = c_tensor(x, kBf16, kT, kH, gpu);
  args.topk_idx = c_tensor(idx, kI32, kT, kK, gpu);
  args.topk_weights = c_tensor(w, kF32, kT, kK, gpu);
  epx_result* d = nullptr;
  EXPECT_EQ(epx_dispatch(buffer, &args, &d), EPX_OK) << epx_last_error();
  if (!d) return o;
  epx_tensor recv_x;
  EXPECT_EQ(epx_result_tensor(d, "recv_x", &recv_x), EPX_OK) << epx_last_error();
  EXPECT_EQ(epx_result_int(d, "num_rows", &o.num_rows), EPX_OK) << epx_last_error();
  epx_result* c = nullptr;
  EXPECT_EQ(epx_combine(buffer, d, &recv_x, nullptr, 1, &c), EPX_OK) << epx_last_error();
  EXPECT_EQ(epx_buffer_synchronize(buffer), EPX_OK) << epx_last_error();
  const int device = gpu >= 0 ? 1 : 0;
  o.recv_x = fetch<uint16_t>(d, "recv_x", device);
  o.recv_src = fetch<int32_t>(d, "recv_src", device);
  o.recv_weights = fetch<float>(d, "recv_weights", device);
  o.expert_offsets = fetch<int64_t>(d, "expert_offsets", device);
  o.tokens_per_expert = fetch<int64_t>(d, "tokens_per_expert", device);
  if (c) o.out = fetch<uint16_t>(c, "out", device);
  epx_result_destroy(c);
  epx_result_destroy(d);
  return o;
}

// The same inputs through the host C ABI, on a one-rank host world.
Outcome on_host(const Inputs& in) {
  epx_world* world = nullptr;
  EXPECT_EQ(epx_host_world_create(1, &world), EPX_OK) << epx_last_error();
  const epx_buffer_config cfg = c_config(kE);
  epx_buffer* buffer = nullptr;
  EXPECT_EQ(epx_buffer_create(world, 0, &cfg, &buffer), EPX_OK) << epx_last_error();
  Outcome o;
  if (buffer) o = run(buffer, in, -1);
  epx_buffer_destroy(buffer);
  epx_host_world_destroy(world);
  return o;
}

void expect_same(const Outcome& gpu, const Outcome& host) {
  EXPECT_GT(host.num_rows, 0);
  EXPECT_EQ(gpu.num_rows, host.num_rows);
  EXPECT_EQ(gpu.recv_x, host.recv_x);
  EXPECT_EQ(gpu.recv_src, host.recv_src);
  EXPECT_EQ(gpu.recv_weights, host.recv_weights);
  EXPECT_EQ(gpu.expert_offsets, host.expert_offsets);
  EXPECT_EQ(gpu.tokens_per_expert, host.tokens_per_expert);
  EXPECT_EQ(gpu.out, host.out);
}

// A refused argument of a one-rank CUDA buffer (the CUDA backend's rejection, through the C ABI):
// EPX_ERR_INVALID_ARGUMENT naming it; the buffer stays usable (the caller's next run checks that).
void expect_refused(epx_buffer* buffer) {
  epx_dispatch_args args;
  std::memset(&args, 0, sizeof args);
  args.x = c_tensor(nullptr, 9, kT, kH, 0);
  epx_result* d = nullptr;
  EXPECT_EQ(epx_dispatch(buffer, &args, &d), EPX_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(epx_last_error(), testing::HasSubstr("epx_dispatch: args->x: unknown dtype code 9"));
  EXPECT_EQ(d, nullptr);
}

TEST(CApiCuda, OneRankGroupJoinedByIdMatchesTheHostAbi) {
  char id[EPX_NCCL_UNIQUE_ID_BYTES];
  ASSERT_EQ(epx_nccl_unique_id(id, sizeof id), EPX_OK) << epx_last_error();
  epx_group* group = nullptr;
  ASSERT_EQ(epx_cuda_group_init_rank(id, sizeof id, 0, 1, 0, &group), EPX_OK) << epx_last_error();
  const epx_buffer_config cfg = c_config(kE);
  epx_buffer* buffer = nullptr;
  const epx_status created = epx_buffer_create_in_group(group, &cfg, &buffer);
  epx_group_destroy(group);  // the buffer keeps what it needs
  ASSERT_EQ(created, EPX_OK) << epx_last_error();
  const Inputs in = make_inputs(0, kE);
  expect_refused(buffer);
  const Outcome gpu = run(buffer, in, 0);
  epx_buffer_destroy(buffer);
  expect_same(gpu, on_host(in));
  EXPECT_EQ(gpu.out, expected_out(in));
}

TEST(CApiCuda, GroupOverTheCallersCommunicatorOnTheCallersStream) {
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm = nullptr;
  int device = 0;
  ASSERT_EQ(ncclCommInitAll(&comm, 1, &device), ncclSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Inputs in = make_inputs(0, kE);
  Outcome gpu;
  epx_group* group = nullptr;
  EXPECT_EQ(epx_cuda_group_from_comm(comm, 0, &group), EPX_OK) << epx_last_error();
  if (group) {
    const epx_buffer_config cfg = c_config(kE);
    epx_buffer* buffer = nullptr;
    EXPECT_EQ(epx_buffer_create_in_group(group, &cfg, &buffer), EPX_OK) << epx_last_error();
    epx_group_destroy(group);
    if (buffer) {
      EXPECT_EQ(epx_buffer_set_stream(buffer, stream), EPX_OK) << epx_last_error();
      gpu = run(buffer, in, 0);
      EXPECT_EQ(epx_buffer_set_stream(buffer, nullptr), EPX_OK) << epx_last_error();  // back to its own
      expect_refused(buffer);
      const Outcome again = run(buffer, in, 0);
      EXPECT_EQ(again.out, gpu.out);
      epx_buffer_destroy(buffer);
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);  // after the buffer and every output on it
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);      // after every group and buffer over it
  expect_same(gpu, on_host(in));
  EXPECT_EQ(gpu.out, expected_out(in));
}

// Two ranks, one GPU each, joined by id from a thread each (as processes would): rank 1's refused
// argument fails both ranks' dispatch at once, then both ranks' next calls work.
TEST(CApiCuda, RefusedArgumentOnOneRankFailsBothRanksOfACudaGroup) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  constexpr int kRanks = 2;
  constexpr int64_t kExperts = 2 * kE;
  char id[EPX_NCCL_UNIQUE_ID_BYTES];
  ASSERT_EQ(epx_nccl_unique_id(id, sizeof id), EPX_OK) << epx_last_error();
  std::vector<epx_status> joined(kRanks), created(kRanks), refused(kRanks);
  std::vector<std::string> refusal(kRanks);
  std::vector<Outcome> outcomes(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      epx_group* group = nullptr;
      joined[r] = epx_cuda_group_init_rank(id, sizeof id, r, kRanks, r, &group);
      if (joined[r] != EPX_OK) return;
      const epx_buffer_config cfg = c_config(kExperts);
      epx_buffer* buffer = nullptr;
      created[r] = epx_buffer_create_in_group(group, &cfg, &buffer);
      epx_group_destroy(group);
      if (created[r] != EPX_OK) return;
      const Inputs in = make_inputs(r, kExperts);
      {
        DeviceArray x(in.x), idx(in.idx);
        epx_dispatch_args args;
        std::memset(&args, 0, sizeof args);
        args.x = c_tensor(x.get(), r == 1 ? 9 : kBf16, kT, kH, r);
        args.topk_idx = c_tensor(idx.get(), kI32, kT, kK, r);
        epx_result* d = nullptr;
        refused[r] = epx_dispatch(buffer, &args, &d);
        refusal[r] = epx_last_error();
        epx_result_destroy(d);
        epx_buffer_synchronize(buffer);
      }
      outcomes[r] = run(buffer, in, r);
      epx_buffer_destroy(buffer);
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(joined[r], EPX_OK) << "rank " << r;
    ASSERT_EQ(created[r], EPX_OK) << "rank " << r;
  }
  const std::string reason = "epx_dispatch: args->x: unknown dtype code 9";
  EXPECT_EQ(refused[1], EPX_ERR_INVALID_ARGUMENT) << refusal[1];
  EXPECT_THAT(refusal[1], testing::HasSubstr(reason));
  EXPECT_EQ(refused[0], EPX_ERR_PEER_FAILED) << refusal[0];
  EXPECT_THAT(refusal[0], testing::HasSubstr("rank 1 "));
  EXPECT_THAT(refusal[0], testing::HasSubstr(reason));
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(outcomes[r].out, expected_out(make_inputs(r, kExperts))) << "rank " << r;
}

}  // namespace
}  // namespace epx::test
