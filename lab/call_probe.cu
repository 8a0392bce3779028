// The shape of a high-throughput dispatch on the shared-GPU test transport, without epx (docs/cuda.md,
// the hold-back): with CUDA_DEVICE_MAX_CONNECTIONS=8 one rank's plan-exchange kernel often begins only
// when its peers' waits for it time out, although its host launched it in time. Each rank is a host
// thread with two streams, as a rank's buffer has, and makes `calls` calls of:
//   main stream: a short kernel (routing, positions), the plan exchange (post this rank's word, wait
//                for every rank's), the senders (set this rank's data word);
//   side stream: an event wait for the exchange, an allocation from a pool and a memset of it (the
//                outputs and their poison), the receiver (wait for every rank's data word).
// Every wait gives up after the timeout; the probe counts the waits that did. Variants leave one part
// out, to find the one that holds the kernel back:
//   nomemset (no memset), nopool (the outputs allocated once, not per call), noevent (the receiver not
//   ordered after the exchange), onestream (the receiver on the main stream, after the senders).
//   usage: epx-call-probe [ranks (8)] [calls (20)] [timeout ms (200)] [variant ...]
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "probe_common.cuh"

namespace {

using probe::now_ns;

__device__ void store_release(int* word, int value) { asm volatile("st.release.sys.b32 [%0], %1;" ::"l"(word), "r"(value)); }

__device__ int load_acquire(const int* word) {
  int v;
  asm volatile("ld.acquire.sys.b32 %0, [%1];" : "=r"(v) : "l"(word));
  return v;
}

// Thread 0 waits until every rank's word reached epoch; counts a timeout.
__device__ void wait_words(const int* words, int ranks, int epoch, unsigned long long timeout_ns, int* timeouts) {
  if (threadIdx.x != 0) return;
  const unsigned long long start = now_ns();
  for (int p = 0; p < ranks; ++p)
    while (load_acquire(words + p) < epoch)
      if (now_ns() - start > timeout_ns) {
        atomicAdd(timeouts, 1);
        return;
      }
}

__global__ void short_work(float* scratch) {  // a few microseconds of work that waits for nobody
  float v = threadIdx.x;
  for (int i = 0; i < 200; ++i) v = v * 1.0001f + 0.5f;
  if (v < 0.0f) scratch[threadIdx.x] = v;
}

__global__ void exchange(int* plan, int rank, int ranks, int epoch, unsigned long long timeout_ns, int* timeouts) {
  if (threadIdx.x == 0) store_release(plan + rank, epoch);
  wait_words(plan, ranks, epoch, timeout_ns, timeouts);
}

__global__ void send(int* data, int rank, int epoch) {
  __syncthreads();
  if (threadIdx.x == 0 && blockIdx.x == 0) store_release(data + rank, epoch);
}

__global__ void receive(const int* data, int ranks, int epoch, unsigned long long timeout_ns, int* timeouts) {
  if (blockIdx.x == 0) wait_words(data, ranks, epoch, timeout_ns, timeouts);
}

// The rank threads meet here (the .cu files are C++17: no std::barrier).
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const long generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  long generation_ = 0;
};

void check(cudaError_t e, const char* what) { probe::check("epx-call-probe", e, what); }

}  // namespace

int main(int argc, char** argv) {
  const int ranks = argc > 1 ? std::atoi(argv[1]) : 8;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 20;
  const unsigned long long timeout_ns = (argc > 3 ? std::atoll(argv[3]) : 200) * 1000000ull;
  const std::set<std::string> variant(argv + std::min(argc, 4), argv + argc);
  const bool memset = !variant.count("nomemset"), per_call_pool = !variant.count("nopool");
  const bool event = !variant.count("noevent"), one_stream = variant.count("onestream") > 0;
  constexpr size_t kOutputBytes = size_t{1} << 20;
  int *plan = nullptr, *data = nullptr, *timeouts = nullptr;
  float* scratch = nullptr;
  check(cudaMalloc(&plan, ranks * sizeof(int)), "cudaMalloc");
  check(cudaMalloc(&data, ranks * sizeof(int)), "cudaMalloc");
  check(cudaMalloc(&scratch, 1024 * sizeof(float)), "cudaMalloc");
  check(cudaMallocManaged(&timeouts, sizeof(int)), "cudaMallocManaged");
  check(cudaMemset(plan, 0, ranks * sizeof(int)), "cudaMemset");
  check(cudaMemset(data, 0, ranks * sizeof(int)), "cudaMemset");
  *timeouts = 0;
  cudaFuncAttributes attributes;  // every kernel loaded before any waits (lazy loading)
  check(cudaFuncGetAttributes(&attributes, short_work), "load");
  check(cudaFuncGetAttributes(&attributes, exchange), "load");
  check(cudaFuncGetAttributes(&attributes, send), "load");
  check(cudaFuncGetAttributes(&attributes, receive), "load");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  Barrier ready(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      check(cudaSetDevice(0), "cudaSetDevice");
      cudaStream_t main_stream = nullptr, side = nullptr;
      check(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking), "cudaStreamCreate");
      if (one_stream) side = main_stream;
      else check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
      cudaEvent_t fork = nullptr;
      check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "cudaEventCreate");
      cudaMemPool_t pool = nullptr;
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
      void* kept = nullptr;
      if (!per_call_pool) check(cudaMalloc(&kept, kOutputBytes), "cudaMalloc");
      ready.arrive_and_wait();  // as after a buffer's collective creation
      for (int call = 0; call < calls; ++call) {
        const int epoch = call + 1;
        short_work<<<4, 512, 0, main_stream>>>(scratch);
        exchange<<<1, 512, 0, main_stream>>>(plan, r, ranks, epoch, timeout_ns, timeouts);
        if (event && !one_stream) {
          check(cudaEventRecord(fork, main_stream), "cudaEventRecord");
          check(cudaStreamWaitEvent(side, fork, 0), "cudaStreamWaitEvent");
        }
        void* outputs = kept;
        if (per_call_pool) check(cudaMallocFromPoolAsync(&outputs, kOutputBytes, pool, side), "alloc");
        if (memset) check(cudaMemsetAsync(outputs, 0xa5, kOutputBytes, side), "cudaMemsetAsync");
        if (one_stream) send<<<4, 512, 0, main_stream>>>(data, r, epoch);
        receive<<<4, 512, 0, side>>>(data, ranks, epoch, timeout_ns, timeouts);
        if (!one_stream) send<<<4, 512, 0, main_stream>>>(data, r, epoch);
        if (per_call_pool) check(cudaFreeAsync(outputs, side), "cudaFreeAsync");
        check(cudaStreamSynchronize(main_stream), "sync");
        check(cudaStreamSynchronize(side), "sync");
      }
      ready.arrive_and_wait();  // no rank frees while a peer is inside a call
      if (kept) cudaFree(kept);
      cudaMemPoolDestroy(pool);
      cudaEventDestroy(fork);
      cudaStreamDestroy(main_stream);
      if (!one_stream) cudaStreamDestroy(side);
    });
  for (auto& t : threads) t.join();
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  std::string name;
  for (const auto& v : variant) name += " " + v;
  std::printf("CUDA_DEVICE_MAX_CONNECTIONS=%s, %d ranks x %d calls, variant:%s: %d waits timed out\n",
              connections ? connections : "(unset: 8)", ranks, calls, name.empty() ? " (all parts)" : name.c_str(),
              *timeouts);
  return 0;
}
