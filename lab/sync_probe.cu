// Which host calls wait for kernels that are already running (docs/cuda.md, the shared-GPU
// hold-back). Ranks that share one GPU share one CUDA context. If a rank's host makes a call that
// waits for the context's running kernels while a peer's kernel spins waiting for this rank, the
// call returns only when the peer gives up: this rank's next kernel is held back for the whole
// timeout. For each call below, a kernel on one stream spins (up to the timeout) for a flag; the
// host then makes the call and launches, on a second stream, the kernel that sets the flag. A call
// that waits for running kernels makes the spin time out and takes about the timeout itself.
//   usage: epx-sync-probe [timeout ms (default 300)] [reserve: set the stack limit again first]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "probe_common.cuh"

namespace {

using probe::now_ns;
using probe::set_flag;
using probe::wait_flag;

// When the spin began, and when the kernel a case launches began (0: not yet).
__device__ unsigned long long spin_began, case_began;

// Launched for the first time inside a case: loaded then (lazy loading).
__global__ void never_loaded(int* p) {
  if (p) *p = 0;
}
// Loaded by cudaFuncGetAttributes before the cases, first launched inside one.
__global__ void preloaded(int* p) {
  if (p) *p = 1;
}
// Launched before the cases: what the first use of a stream, an event or a thread costs.
__global__ void touch(int* p) {
  if (p) *p = 2;
}
// First launched inside a case: a kernel that needs 200 KiB of dynamic shared memory, and one
// with a 16 KiB local array per thread (a larger local-memory reservation).
__global__ void big_shared(int* p) {
  extern __shared__ int words[];
  words[threadIdx.x] = threadIdx.x;
  __syncthreads();
  case_began = now_ns();
  if (p) *p = words[(threadIdx.x + 1) % blockDim.x];
}
template <int kWords>
__global__ void stack_of(int* p, int i) {
  volatile int local[kWords];
  for (int k = 0; k < kWords; k += 7) local[k] = k;
  case_began = now_ns();
  if (p) *p = local[i % kWords];
}

void check(cudaError_t e, const char* what) { probe::check("epx-sync-probe", e, what); }

struct Case {
  const char* name;
  std::function<void()> call;
};

}  // namespace

int main(int argc, char** argv) {
  const long long timeout_ms = argc > 1 ? std::atoll(argv[1]) : 300;
  const bool reserve = argc > 2 && std::string(argv[2]) == "reserve";
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  cudaStream_t waiting = nullptr, setting = nullptr, other = nullptr;
  for (cudaStream_t* s : {&waiting, &setting, &other}) check(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), "cudaStreamCreate");
  int *flag = nullptr, *timed_out = nullptr;
  check(cudaMallocManaged(&flag, sizeof(int)), "cudaMallocManaged");
  check(cudaMallocManaged(&timed_out, sizeof(int)), "cudaMallocManaged");
  // The probe's own two kernels loaded before any case.
  unsigned long long* spin_start = nullptr;  // where the spin notes when it began
  check(cudaGetSymbolAddress(reinterpret_cast<void**>(&spin_start), spin_began), "cudaGetSymbolAddress");
  wait_flag<<<1, 1, 0, waiting>>>(flag, 0, 1000000, timed_out, spin_start);
  set_flag<<<1, 1, 0, setting>>>(flag, 0);
  touch<<<1, 1, 0, setting>>>(nullptr);
  cudaFuncAttributes attributes;
  check(cudaFuncGetAttributes(&attributes, preloaded), "cudaFuncGetAttributes");
  constexpr int kBigShared = 200 * 1024;
  check(cudaFuncSetAttribute(big_shared, cudaFuncAttributeMaxDynamicSharedMemorySize, kBigShared), "attr");
  check(cudaFuncGetAttributes(&attributes, stack_of<120>), "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, stack_of<4096>), "cudaFuncGetAttributes");
  if (reserve) {  // the default stack limit set again: does it reserve local memory now?
    size_t stack = 0;
    check(cudaDeviceGetLimit(&stack, cudaLimitStackSize), "cudaDeviceGetLimit");
    check(cudaDeviceSetLimit(cudaLimitStackSize, stack), "cudaDeviceSetLimit");
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  constexpr size_t kMiB = size_t{1} << 20;
  void *dev = nullptr, *dev_freed = nullptr, *pool_block = nullptr, *host = nullptr, *host_freed = nullptr;
  std::vector<char> pageable(16 * kMiB, 1);
  check(cudaMalloc(&dev, 16 * kMiB), "cudaMalloc");
  check(cudaMalloc(&dev_freed, kMiB), "cudaMalloc");
  check(cudaHostAlloc(&host_freed, kMiB, cudaHostAllocDefault), "cudaHostAlloc");
  cudaMemPool_t pool = nullptr, pool_destroyed = nullptr;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  check(cudaMemPoolCreate(&pool_destroyed, &props), "cudaMemPoolCreate");
  uint64_t keep = UINT64_MAX;
  cudaStream_t made = nullptr, destroyed = nullptr, unused = nullptr;
  check(cudaStreamCreateWithFlags(&destroyed, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaStreamCreateWithFlags(&unused, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t event = nullptr, unrecorded = nullptr;
  check(cudaEventCreateWithFlags(&unrecorded, cudaEventDisableTiming), "event");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check(cudaStreamBeginCapture(other, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  set_flag<<<1, 1, 0, other>>>(flag + 0, 0);
  check(cudaStreamEndCapture(other, &graph), "cudaStreamEndCapture");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");

  // Starts `waits` on another thread, then (20 ms later) launches the setting kernel from this one.
  int next_want = 0;
  auto launch_beside = [&](const std::function<void()>& waits) {
    std::thread t([&] {
      check(cudaSetDevice(0), "cudaSetDevice");
      waits();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    set_flag<<<1, 1, 0, setting>>>(flag, next_want);
    t.join();
  };
  void *dev_freed2 = nullptr, *host_freed2 = nullptr;
  check(cudaMalloc(&dev_freed2, kMiB), "cudaMalloc");
  check(cudaHostAlloc(&host_freed2, kMiB, cudaHostAllocDefault), "cudaHostAlloc");

  // In this order: the first memset and the first launches come before any other call.
  const std::vector<Case> cases = {
      {"nothing (must not wait)", [] {}},
      {"first cudaMemsetAsync on another stream", [&] { check(cudaMemsetAsync(dev, 0, kMiB, other), "memset"); }},
      {"first launch of a kernel not loaded yet", [&] { never_loaded<<<1, 1, 0, other>>>(nullptr); }},
      {"first launch of a kernel loaded by cudaFuncGetAttributes", [&] { preloaded<<<1, 1, 0, other>>>(nullptr); }},
      {"first launch needing 200 KiB of shared memory", [&] { big_shared<<<1, 256, kBigShared, other>>>(nullptr); }},
      {"first launch of a kernel with a 480-byte stack frame", [&] { stack_of<120><<<132, 1024, 0, other>>>(nullptr, 0); }},
      {"first launch of a kernel with a 16 KiB stack frame", [&] { stack_of<4096><<<132, 1024, 0, other>>>(nullptr, 0); }},
      {"the 16 KiB-frame kernel again", [&] { stack_of<4096><<<132, 1024, 0, other>>>(nullptr, 0); }},
      {"cudaFuncSetAttribute (loaded kernel)", [&] {
         check(cudaFuncSetAttribute(touch, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024), "attr"); }},
      {"first launch on a stream made before the spin", [&] { touch<<<1, 1, 0, unused>>>(nullptr); }},
      {"first cudaEventRecord of an event, cudaStreamWaitEvent", [&] {
         check(cudaEventRecord(unrecorded, other), "record");
         check(cudaStreamWaitEvent(unused, unrecorded), "wait event"); }},
      {"a new host thread: cudaSetDevice, a launch", [&] {
         std::thread t([&] { check(cudaSetDevice(0), "cudaSetDevice"); touch<<<1, 1, 0, other>>>(nullptr); });
         t.join(); }},
      {"a new host thread: cudaStreamPerThread copy", [&] {
         std::thread t([&] { check(cudaSetDevice(0), "cudaSetDevice");
           check(cudaMemcpyAsync(pageable.data(), dev, 4096, cudaMemcpyDeviceToHost, cudaStreamPerThread), "copy");
           check(cudaStreamSynchronize(cudaStreamPerThread), "sync"); });
         t.join(); }},
      {"cudaMemsetAsync on another stream", [&] { check(cudaMemsetAsync(dev, 1, kMiB, other), "memset"); }},
      {"cudaMemcpyAsync device to device", [&] { check(cudaMemcpyAsync(dev, (char*)dev + 8 * kMiB, kMiB, cudaMemcpyDeviceToDevice, other), "copy"); }},
      {"cudaMemset (legacy stream) 1 MiB", [&] { check(cudaMemset(dev, 0, kMiB), "cudaMemset"); }},
      {"cudaMemcpy host to device, pageable", [&] { check(cudaMemcpy(dev, pageable.data(), kMiB, cudaMemcpyHostToDevice), "cudaMemcpy"); }},
      {"cudaMemcpy device to host, pageable", [&] { check(cudaMemcpy(pageable.data(), dev, kMiB, cudaMemcpyDeviceToHost), "cudaMemcpy"); }},
      {"cudaMalloc 1 MiB", [&] { void* p = nullptr; check(cudaMalloc(&p, kMiB), "cudaMalloc"); }},
      {"cudaMalloc 256 MiB", [&] { void* p = nullptr; check(cudaMalloc(&p, 256 * kMiB), "cudaMalloc"); }},
      {"cudaFree", [&] { check(cudaFree(dev_freed), "cudaFree"); }},
      {"cudaHostAlloc 1 MiB", [&] { check(cudaHostAlloc(&host, kMiB, cudaHostAllocDefault), "cudaHostAlloc"); }},
      {"cudaHostAlloc mapped 4 KiB", [&] { void* p = nullptr; check(cudaHostAlloc(&p, 4096, cudaHostAllocMapped), "cudaHostAlloc"); }},
      {"cudaFreeHost", [&] { check(cudaFreeHost(host_freed), "cudaFreeHost"); }},
      {"cudaMemPoolCreate", [&] { check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
                                   check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "attr"); }},
      {"cudaMallocFromPoolAsync 64 MiB, the pool grows", [&] { check(cudaMallocFromPoolAsync(&pool_block, 64 * kMiB, pool, other), "alloc"); }},
      {"cudaFreeAsync to the pool", [&] { check(cudaFreeAsync(pool_block, other), "cudaFreeAsync"); }},
      {"cudaMallocFromPoolAsync 64 MiB, the pool's kept memory", [&] { check(cudaMallocFromPoolAsync(&pool_block, 64 * kMiB, pool, other), "alloc"); }},
      {"cudaMallocAsync 64 MiB, default pool", [&] { void* p = nullptr; check(cudaMallocAsync(&p, 64 * kMiB, other), "alloc"); }},
      {"cudaMemPoolDestroy", [&] { check(cudaMemPoolDestroy(pool_destroyed), "cudaMemPoolDestroy"); }},
      {"cudaStreamCreateWithFlags", [&] { check(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking), "create"); }},
      {"cudaStreamCreate and a first launch on it", [&] {
         cudaStream_t s = nullptr;
         check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "create");
         touch<<<1, 1, 0, s>>>(nullptr); }},
      {"cudaStreamDestroy (idle stream)", [&] { check(cudaStreamDestroy(destroyed), "cudaStreamDestroy"); }},
      {"cudaEventCreateWithFlags", [&] { check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event"); }},
      {"cudaGraphInstantiate", [&] { check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate"); }},
      {"cudaGraphUpload", [&] { check(cudaGraphUpload(exec, other), "cudaGraphUpload"); }},
      {"cudaStreamSynchronize (another, idle stream)", [&] { check(cudaStreamSynchronize(other), "sync"); }},
      {"cudaDeviceSynchronize (must wait)", [&] { check(cudaDeviceSynchronize(), "sync"); }},
      {"the 16 KiB-frame kernel after the frees", [&] { stack_of<4096><<<132, 1024, 0, other>>>(nullptr, 0); }},
      // A call that waits, made by another thread: does it also hold back this thread's launch?
      {"this thread's launch while another waits in cudaFree", [&] { launch_beside([&] { cudaFree(dev_freed2); }); }},
      {"this thread's launch while another waits in cudaFreeHost", [&] { launch_beside([&] { cudaFreeHost(host_freed2); }); }},
      {"this thread's launch while another waits in cudaDeviceSynchronize", [&] { launch_beside([] { cudaDeviceSynchronize(); }); }},
  };
  std::printf("CUDA_MODULE_LOADING=%s, timeout %lld ms%s\n", loading ? loading : "(unset: lazy)", timeout_ms,
              reserve ? ", the stack limit set again before the cases" : "");
  for (size_t i = 0; i < cases.size(); ++i) {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    *flag = 0;
    *timed_out = 0;
    const unsigned long long zero = 0;
    check(cudaMemcpyToSymbol(case_began, &zero, sizeof zero), "cudaMemcpyToSymbol");
    const int want = static_cast<int>(i) + 1;
    next_want = want;
    wait_flag<<<1, 1, 0, waiting>>>(flag, want, static_cast<unsigned long long>(timeout_ms) * 1000000ull, timed_out,
                                    spin_start);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the spin has begun
    const auto start = std::chrono::steady_clock::now();
    cases[i].call();
    const double call_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    set_flag<<<1, 1, 0, setting>>>(flag, want);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    unsigned long long spin = 0, began = 0;
    check(cudaMemcpyFromSymbol(&spin, spin_began, sizeof spin), "cudaMemcpyFromSymbol");
    check(cudaMemcpyFromSymbol(&began, case_began, sizeof began), "cudaMemcpyFromSymbol");
    std::printf("%-55s call %8.2f ms  %s", cases[i].name, call_ms, *timed_out ? "WAITS for running kernels" : "does not wait");
    if (began) std::printf(" (its kernel began %.2f ms into the spin)", (began - spin) / 1e6);
    std::printf("\n");
  }
  return 0;
}
