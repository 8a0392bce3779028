// Which CUDA streams share a hardware queue (docs/cuda.md, the shared-GPU hold-back): the runtime
// maps streams onto CUDA_DEVICE_MAX_CONNECTIONS queues. Kernels of different streams in one queue
// start in turn without waiting for each other, but a queued item that depends on an unfinished
// kernel of its own stream stops the queue until that kernel ends. For each pair (first, k) of
// streams, made and first used in a row: a kernel on stream `first` waits (up to a timeout) for a
// flag, a second kernel on `first` (which must wait for the first) is queued behind it, and then a
// kernel on stream k sets the flag. If the two streams share a queue, the setter sits behind the
// second kernel and the wait times out. (Without the second kernel nothing shows: the form of this
// probe before 2026-12-01 had none, and found no sharing.) Prints the streams that share stream
// first's queue.
//   usage: epx-queue-probe [streams (default 40)] [first (default 0)] [timeout ms (default 50)] [threads|event|busy]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "probe_common.cuh"

namespace {

using probe::set_flag;
using probe::wait_flag;

__global__ void touch() {}

void check(cudaError_t e, const char* what) { probe::check("epx-queue-probe", e, what); }

}  // namespace

int main(int argc, char** argv) {
  const int count = argc > 1 ? std::atoi(argv[1]) : 40;
  const int first = argc > 2 ? std::atoi(argv[2]) : 0;
  const unsigned long long timeout_ns = (argc > 3 ? std::atoll(argv[3]) : 50) * 1000000ull;
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  // "threads": 8 threads make the streams and use each once, all at the same time (as the ranks of
  // the shared-GPU transport do), instead of one thread in a row.
  const std::string mode = argc > 4 ? argv[4] : "";
  const bool threads = mode == "threads";
  // "event": the waiting kernel runs on a stream of its own, made first, and stream `first` waits
  // for it through an event (cudaStreamWaitEvent), as a rank's side stream waits for its main one.
  const bool event_wait = mode == "event";
  // "busy": the first count-1 streams busy at once, then a launch on the last one (see below).
  const bool busy = mode == "busy";
  cudaStream_t spinner = nullptr;
  cudaEvent_t spun = nullptr;
  if (event_wait) {
    check(cudaStreamCreateWithFlags(&spinner, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming), "cudaEventCreate");
  }
  std::vector<cudaStream_t> streams(count);
  if (threads) {
    constexpr int kThreads = 8;
    std::vector<std::thread> makers;
    for (int t = 0; t < kThreads; ++t)
      makers.emplace_back([&, t] {
        check(cudaSetDevice(0), "cudaSetDevice");
        for (int i = t; i < count; i += kThreads) {
          check(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking), "cudaStreamCreate");
          touch<<<1, 1, 0, streams[i]>>>();
        }
      });
    for (auto& m : makers) m.join();
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  } else {
    for (auto& s : streams) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  int *flag = nullptr, *timed_out = nullptr;
  check(cudaMallocManaged(&flag, sizeof(int)), "cudaMallocManaged");
  check(cudaMallocManaged(&timed_out, sizeof(int)), "cudaMallocManaged");
  int* scratch = nullptr;
  check(cudaMalloc(&scratch, sizeof(int)), "cudaMalloc");
  // Both kernels loaded (a lazy module load waits for running kernels), then every stream used
  // once, in order, while the GPU is idle (in case streams take their queue at first use).
  wait_flag<<<1, 1, 0, streams[0]>>>(flag, 0, timeout_ns, timed_out);
  set_flag<<<1, 1, 0, streams[0]>>>(flag, 0);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (auto& s : streams) {
    set_flag<<<1, 1, 0, s>>>(flag, 0);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  if (busy) {
    // Streams 0..count-2 each hold a waiting kernel with one that must follow it; then the last
    // stream sets the flag they wait for. If the queues are handed out as streams get work, the
    // setter shares a queue with a waiting stream only once more streams are busy than queues.
    *flag = 0;
    *timed_out = 0;
    for (int k = 0; k + 1 < count; ++k) {
      wait_flag<<<1, 1, 0, streams[k]>>>(flag, 1, timeout_ns, timed_out);
      set_flag<<<1, 1, 0, streams[k]>>>(scratch, 0);
    }
    set_flag<<<1, 1, 0, streams[count - 1]>>>(flag, 1);
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::printf("CUDA_DEVICE_MAX_CONNECTIONS=%s, %d streams busy with a waiting kernel and one behind it: the "
                "setter on stream %d %s\n",
                connections ? connections : "(unset: 8)", count - 1, count - 1,
                *timed_out ? "WAS HELD BACK (the waits timed out)" : "ran");
  } else {
    std::printf("CUDA_DEVICE_MAX_CONNECTIONS=%s, %d streams made and used %s%s; streams sharing stream %d's queue:",
                connections ? connections : "(unset: 8)", count, threads ? "by 8 threads at once" : "in a row",
                event_wait ? ", the wait behind an event" : "", first);
    int shared = 0;
    for (int k = 0; k < count; ++k) {
      if (k == first) continue;
      *flag = 0;
      *timed_out = 0;
      if (event_wait) {  // the wait on a stream of its own; stream first waits for it by an event
        wait_flag<<<1, 1, 0, spinner>>>(flag, k + 1, timeout_ns, timed_out);
        check(cudaEventRecord(spun, spinner), "cudaEventRecord");
        check(cudaStreamWaitEvent(streams[first], spun, 0), "cudaStreamWaitEvent");
      } else {
        wait_flag<<<1, 1, 0, streams[first]>>>(flag, k + 1, timeout_ns, timed_out);
      }
      set_flag<<<1, 1, 0, streams[first]>>>(scratch, 0);  // waits for the wait, in stream order
      set_flag<<<1, 1, 0, streams[k]>>>(flag, k + 1);
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      if (*timed_out) {
        std::printf(" %d", k);
        ++shared;
      }
    }
    std::printf("%s\n", shared ? "" : " none");
  }
  for (auto& s : streams) cudaStreamDestroy(s);
  if (event_wait) {
    cudaStreamDestroy(spinner);
    cudaEventDestroy(spun);
  }
  cudaFree(flag);
  cudaFree(timed_out);
  cudaFree(scratch);
  return 0;
}
