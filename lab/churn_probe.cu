// The shared-GPU hold-back without epx (docs/cuda.md, "Known gaps", hangs items 7-11): rank
// threads on one GPU, each with its own stream, call in rounds. A round on every rank: a kernel
// that marks this rank arrived and waits (up to a timeout) until every rank has, then a kernel
// behind it on the same stream (it waits for the first in stream order: a split call's receive
// half), then the host synchronizes the stream and meets the other threads. If two ranks' streams
// share a hardware queue and one rank's second kernel is queued ahead of the other rank's first,
// the other's first kernel cannot start until the waits give up: a timeout, as in epx's tests.
// Modes: keep (each thread makes its stream once), churn (a new stream every round, destroyed
// after it: as each epx test makes its buffer's streams), churn-busy (churn, and each thread also
// makes `extra` other streams that get work once, as a buffer's copy streams do), leak (a new
// stream every round, never destroyed), pool (each round takes a stream from a process-wide pool
// of streams made once and gives it back after: no stream is destroyed, any thread may get any).
// Prints the rounds, the timeouts, and the first rounds that timed out.
//   usage: epx-churn-probe [ranks (4)] [rounds (2000)] [timeout ms (50)] [keep|churn|churn-busy|leak|pool] [extra (1)]
//          [before (0): streams each thread makes, uses and destroys before the rounds]
#include <atomic>
#include <chrono>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "probe_common.cuh"

namespace {

__global__ void arrive_and_wait(volatile unsigned* arrived, int rank, int ranks, unsigned round,
                                unsigned long long timeout_ns, unsigned* timeouts) {
  if (threadIdx.x != 0) return;
  arrived[rank] = round;
  __threadfence_system();
  const unsigned long long start = probe::now_ns();
  for (int p = 0; p < ranks; ++p)
    while (arrived[p] < round)
      if (probe::now_ns() - start > timeout_ns) {
        atomicAdd(timeouts, 1u);
        return;
      }
}

__global__ void behind() {}

void check(cudaError_t e, const char* what) { probe::check("epx-churn-probe", e, what); }

// The rank threads meet before each round's launches (a reusable spinning barrier).
struct Meet {
  explicit Meet(int n) : n(n) {}
  void arrive_and_wait() {
    const int g = generation.load();
    if (count.fetch_add(1) + 1 == n) {
      count = 0;
      generation.fetch_add(1);
      return;
    }
    while (generation.load() == g) std::this_thread::yield();
  }
  const int n;
  std::atomic<int> count{0}, generation{0};
};

}  // namespace

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 4;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 2000;
  const unsigned long long timeout_ns = (argc > 3 ? std::atoll(argv[3]) : 50) * 1000000ull;
  const std::string mode = argc > 4 ? argv[4] : "churn";
  const int extra = argc > 5 ? std::atoi(argv[5]) : 1;
  const int before = argc > 6 ? std::atoi(argv[6]) : 0;
  const bool busy = mode == "churn-busy", leak = mode == "leak", pooled = mode == "pool";
  const bool churn = mode != "keep" && !pooled;
  std::mutex pool_mutex;
  std::vector<cudaStream_t> pool;  // pool: streams that a round gave back, taken by any thread
  check(cudaSetDevice(0), "cudaSetDevice");
  unsigned* arrived = nullptr;
  unsigned* timeouts = nullptr;
  check(cudaMalloc(&arrived, ranks * sizeof(unsigned)), "cudaMalloc");
  check(cudaMemset(arrived, 0, ranks * sizeof(unsigned)), "cudaMemset");
  check(cudaMallocManaged(&timeouts, rounds * sizeof(unsigned)), "cudaMallocManaged");
  for (int i = 0; i < rounds; ++i) timeouts[i] = 0;
  check(cudaDeviceSynchronize(), "sync");
  Meet meet(ranks);
  const auto began = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      check(cudaSetDevice(0), "cudaSetDevice");
      for (int i = 0; i < before; ++i) {  // a process's history: streams made, used and gone
        cudaStream_t old = nullptr;
        check(cudaStreamCreateWithFlags(&old, cudaStreamNonBlocking), "cudaStreamCreate");
        behind<<<1, 32, 0, old>>>();
        check(cudaStreamSynchronize(old), "cudaStreamSynchronize");
        check(cudaStreamDestroy(old), "cudaStreamDestroy");
      }
      meet.arrive_and_wait();
      cudaStream_t s = nullptr;
      std::vector<cudaStream_t> side(busy ? extra : 0);
      if (!churn) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      for (int i = 0; i < rounds; ++i) {
        if (pooled) {
          std::lock_guard lock(pool_mutex);
          if (pool.empty()) {
            check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
          } else {
            s = pool.back();
            pool.pop_back();
          }
        }
        if (churn) {
          check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
          for (auto& x : side) {
            check(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), "cudaStreamCreate");
            behind<<<1, 32, 0, x>>>();  // a side stream that got work once
          }
        }
        meet.arrive_and_wait();
        arrive_and_wait<<<1, 32, 0, s>>>(arrived, r, ranks, static_cast<unsigned>(i + 1), timeout_ns, timeouts + i);
        behind<<<1, 32, 0, s>>>();
        check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
        if (pooled) {
          meet.arrive_and_wait();  // every thread's round done: the streams go back in a new order
          std::lock_guard lock(pool_mutex);
          pool.insert(pool.begin() + static_cast<long>((r * 7 + i) % (pool.size() + 1)), s);
        }
        if (churn && !leak) {
          check(cudaStreamDestroy(s), "cudaStreamDestroy");
          for (auto& x : side) {
            check(cudaStreamSynchronize(x), "cudaStreamSynchronize");
            check(cudaStreamDestroy(x), "cudaStreamDestroy");
          }
        }
      }
      if (!churn) check(cudaStreamDestroy(s), "cudaStreamDestroy");
    });
  for (auto& t : threads) t.join();
  int failed = 0;
  std::string first;
  for (int i = 0; i < rounds; ++i)
    if (timeouts[i]) {
      if (++failed <= 10) first += " " + std::to_string(i) + "(" + std::to_string(timeouts[i]) + ")";
    }
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
  std::printf("CUDA_DEVICE_MAX_CONNECTIONS=%s, %d ranks, %d rounds, mode %s (extra %d): %d rounds timed out in %.0f ms; "
              "first:%s\n",
              connections ? connections : "(unset: 8)", ranks, rounds, mode.c_str(), extra, failed, ms, first.c_str());
  cudaFree(arrived);
  cudaFree(timeouts);
  return 0;
}
