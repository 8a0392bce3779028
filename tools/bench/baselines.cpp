#include "bench/baselines.hpp"

#include <algorithm>
#include <cstdio>
#include <thread>

#ifdef EPX_HAS_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include "bench/local_copy.hpp"
#endif

namespace epx::bench {

#ifdef EPX_HAS_CUDA
namespace {

#define BENCH_CHECK(call)                                                               \
  do {                                                                                  \
    if ((call) != 0) throw std::runtime_error(std::string("baseline: ") + #call + " failed"); \
  } while (0)

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Record record(const Options& o, const char* op, const std::vector<double>& times, double bytes, double wire_bytes,
              int ranks) {
  Record r;
  r.op = op;
  r.dtype = "bf16";
  r.layout = "none";
  r.ranks = ranks;
  r.tokens = o.tokens;
  r.hidden = o.hidden;
  r.topk = o.topk;
  r.experts = o.experts;
  r.backend = "cuda";
  r.time_us = median(times);
  r.min_us = *std::min_element(times.begin(), times.end());
  r.max_us = *std::max_element(times.begin(), times.end());
  r.sms = 0;  // copy engines (peer copy) or NCCL's own choice
  r.iters = o.iters;
  r.logical_bytes = bytes;
  r.logical_gbps = bytes / (r.time_us * 1e3);
  r.wire_gbps = wire_bytes / (r.time_us * 1e3);
  r.verified = false;  // a reference point, nothing to verify
  r.git_commit = EPX_GIT_COMMIT;
  return r;
}

// GPU0 -> GPU1 and GPU1 -> GPU0 at once, `bytes` each way, copy engines, in `pieces` copies each
// followed by a 4-byte copy (as a copy-engine dispatch flags its pieces); GB/s per direction.
Record peer_copy(const Options& o, const char* name, size_t bytes, int pieces) {
  void* buf[2][2] = {};
  cudaStream_t stream[2];
  cudaEvent_t start[2], stop[2];
  for (int d = 0; d < 2; ++d) {
    BENCH_CHECK(cudaSetDevice(d));
    cudaDeviceEnablePeerAccess(1 - d, 0);
    cudaGetLastError();  // already enabled is fine
    BENCH_CHECK(cudaMalloc(&buf[d][0], bytes));
    BENCH_CHECK(cudaMalloc(&buf[d][1], bytes + 16));  // + a piece's flag
    BENCH_CHECK(cudaStreamCreateWithFlags(&stream[d], cudaStreamNonBlocking));
    BENCH_CHECK(cudaEventCreate(&start[d]));
    BENCH_CHECK(cudaEventCreate(&stop[d]));
  }
  std::vector<double> times;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    for (int d = 0; d < 2; ++d) {
      BENCH_CHECK(cudaSetDevice(d));
      BENCH_CHECK(cudaEventRecord(start[d], stream[d]));
      const size_t piece = (bytes / pieces + 15) / 16 * 16;
      for (size_t at = 0; at < bytes; at += piece) {
        const auto* from = static_cast<const char*>(buf[d][0]);
        auto* to = static_cast<char*>(buf[1 - d][1]);
        BENCH_CHECK(cudaMemcpyPeerAsync(to + at, 1 - d, from + at, d, std::min(piece, bytes - at), stream[d]));
        if (pieces > 1) BENCH_CHECK(cudaMemcpyPeerAsync(to + bytes, 1 - d, from + at, d, 4, stream[d]));
      }
      BENCH_CHECK(cudaEventRecord(stop[d], stream[d]));
    }
    double slowest = 0;
    for (int d = 0; d < 2; ++d) {
      float ms = 0;
      BENCH_CHECK(cudaEventSynchronize(stop[d]));
      BENCH_CHECK(cudaEventElapsedTime(&ms, start[d], stop[d]));
      slowest = std::max(slowest, 1000.0 * ms);
    }
    if (i >= o.warmup) times.push_back(slowest);
  }
  for (int d = 0; d < 2; ++d) {
    cudaSetDevice(d);
    cudaFree(buf[d][0]);
    cudaFree(buf[d][1]);
    cudaStreamDestroy(stream[d]);
    cudaEventDestroy(start[d]);
    cudaEventDestroy(stop[d]);
  }
  return record(o, name, times, static_cast<double>(bytes), static_cast<double>(bytes), 2);
}

// ncclSend/ncclRecv of bytes_to[s][d] between every pair (self included), one comm per GPU.
Record nccl_alltoall(const Options& o, const std::vector<std::vector<double>>& bytes_to) {
  const int n = static_cast<int>(bytes_to.size());
  std::vector<ncclComm_t> comms(n);
  std::vector<int> devs(n);
  for (int d = 0; d < n; ++d) devs[d] = d;
  BENCH_CHECK(ncclCommInitAll(comms.data(), n, devs.data()));
  std::vector<void*> send(n), recv(n);
  std::vector<cudaStream_t> streams(n);
  std::vector<cudaEvent_t> start(n), stop(n);
  double max_bytes = 0;
  for (const auto& row : bytes_to)
    for (double b : row) max_bytes = std::max(max_bytes, b);
  const size_t chunk = static_cast<size_t>(max_bytes) + 16;
  for (int d = 0; d < n; ++d) {
    BENCH_CHECK(cudaSetDevice(d));
    BENCH_CHECK(cudaMalloc(&send[d], chunk * n));
    BENCH_CHECK(cudaMalloc(&recv[d], chunk * n));
    BENCH_CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    BENCH_CHECK(cudaEventCreate(&start[d]));
    BENCH_CHECK(cudaEventCreate(&stop[d]));
  }
  std::vector<double> times;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    for (int d = 0; d < n; ++d) {
      BENCH_CHECK(cudaSetDevice(d));
      BENCH_CHECK(cudaEventRecord(start[d], streams[d]));
    }
    BENCH_CHECK(ncclGroupStart());
    for (int s = 0; s < n; ++s)
      for (int d = 0; d < n; ++d) {
        const size_t b = static_cast<size_t>(bytes_to[s][d]);
        BENCH_CHECK(ncclSend(static_cast<char*>(send[s]) + d * chunk, b, ncclChar, d, comms[s], streams[s]));
        BENCH_CHECK(ncclRecv(static_cast<char*>(recv[d]) + s * chunk, b, ncclChar, s, comms[d], streams[d]));
      }
    BENCH_CHECK(ncclGroupEnd());
    double slowest = 0;
    for (int d = 0; d < n; ++d) {
      BENCH_CHECK(cudaSetDevice(d));
      BENCH_CHECK(cudaEventRecord(stop[d], streams[d]));
    }
    for (int d = 0; d < n; ++d) {
      float ms = 0;
      BENCH_CHECK(cudaEventSynchronize(stop[d]));
      BENCH_CHECK(cudaEventElapsedTime(&ms, start[d], stop[d]));
      slowest = std::max(slowest, 1000.0 * ms);
    }
    if (i >= o.warmup) times.push_back(slowest);
  }
  double received = 0, crossed = 0;  // per rank: as DeepEP counts it (own tokens included), and from other ranks
  for (int d = 0; d < n; ++d)
    for (int s = 0; s < n; ++s) {
      received += bytes_to[s][d];
      if (s != d) crossed += bytes_to[s][d];
    }
  for (int d = 0; d < n; ++d) {
    cudaSetDevice(d);
    cudaFree(send[d]);
    cudaFree(recv[d]);
    cudaStreamDestroy(streams[d]);
    cudaEventDestroy(start[d]);
    cudaEventDestroy(stop[d]);
    ncclCommDestroy(comms[d]);
  }
  return record(o, "nccl_alltoall", times, received / n, crossed / n, n);
}

// A copy within GPU 0 of the bytes a rank's dispatch receives (bytes_to's column 0): by the SM
// budget's blocks, by every SM, and by the copy engines ("local_copy", sms = blocks, 0: engines).
std::vector<Record> local_copies(const Options& o, const std::vector<std::vector<double>>& bytes_to) {
  double received = 0;
  for (const auto& row : bytes_to) received += row[0];
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int budget = o.sms > 0 ? o.sms : 24;
  // On the shared GPU every rank's blocks run on GPU 0: the floors take the rates of all of them.
  const int all_ranks = o.shared_gpu ? std::min(budget * o.ranks, sms) : budget;
  std::vector<Record> out;
  auto add = [&](const char* op, const std::vector<LocalCopyTime>& times, double bytes) {
    for (const LocalCopyTime& t : times) {
      Record r = record(o, op, t.times, bytes, 0.0, 1);
      r.sms = t.blocks;
      out.push_back(r);
    }
  };
  std::vector<int> copy_blocks{budget, all_ranks, sms};
  std::sort(copy_blocks.begin(), copy_blocks.end());
  copy_blocks.erase(std::unique(copy_blocks.begin(), copy_blocks.end()), copy_blocks.end());
  add("local_copy", time_local_copies(static_cast<size_t>(received), copy_blocks, o.warmup, o.iters), received);
  // Reads of 4x those bytes (about what the expert-major partials read at two ranks: ~4 expert
  // rows per received token), by 8 and 16 SMs, the budget and every SM: how a read-bound sum's
  // rate grows with the SMs given to it; then writes of as many bytes (about what an
  // expert-major receiver writes at two ranks).
  std::vector<int> block_counts{8, 16, budget, all_ranks, sms};
  std::sort(block_counts.begin(), block_counts.end());
  block_counts.erase(std::unique(block_counts.begin(), block_counts.end()), block_counts.end());
  const double expert_row_bytes = 4 * received;
  const auto expert_bytes = static_cast<size_t>(expert_row_bytes);
  add("local_read", time_local_reads(expert_bytes, block_counts, o.warmup, o.iters), expert_row_bytes);
  add("local_write", time_local_writes(expert_bytes, block_counts, o.warmup, o.iters), expert_row_bytes);
  return out;
}

}  // namespace
#endif

std::vector<Record> measure_baselines(const Options& o, const std::vector<std::vector<double>>& bytes_to) {
  std::vector<Record> out;
#ifdef EPX_HAS_CUDA
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1 || o.backend != "cuda") return out;
  try {
    if (gpus >= 2) {
      out.push_back(peer_copy(o, "peer_copy", size_t{256} << 20, 1));
      // A bf16 dispatch's rows of one rank, as the copy-engine dispatch sends them (four pieces).
      out.push_back(peer_copy(o, "peer_copy_rows", static_cast<size_t>(o.tokens) * o.hidden * 2, 4));
      out.push_back(nccl_alltoall(o, bytes_to));
    }
    for (Record& r : local_copies(o, bytes_to)) out.push_back(std::move(r));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-bench: %s (baselines skipped)\n", e.what());
  }
#else
  (void)o;
  (void)bytes_to;
#endif
  return out;
}

}  // namespace epx::bench
