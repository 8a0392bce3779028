// Whether ranks that share one GPU as processes (not threads) meet in a kernel, and whether they
// still do under compute-sanitizer (docs/cuda.md, hangs item 12: in one process the sanitizer runs
// one kernel at a time, so a rank's kernel that waits for a peer's never sees it). Each process is
// one rank: rank 0 allocates two flags, writes their CUDA IPC handle to a file, rank 1 opens it.
// Then each rank's kernel sets its own flag and spins (up to the timeout) for its peer's, rounds
// times; the GPU time-slices the two processes' contexts, so the spins meet if slices alternate.
//   usage: epx-ipc-probe <rank 0|1> <handle file> [rounds (default 20)] [timeout ms (default 5000)]
//          epx-ipc-probe fork <handle file> [rounds] [timeout ms]: forks both ranks (CUDA starts
//          in the children only), as epx-bench --processes does
//   e.g.:  epx-ipc-probe 0 /tmp/h & epx-ipc-probe 1 /tmp/h; wait
//          (each under `compute-sanitizer --tool memcheck` or `--tool racecheck`), and
//          compute-sanitizer --target-processes all --tool memcheck epx-ipc-probe fork /tmp/h
// Prints per rank: rounds met, rounds timed out, the slowest round's wait on the device timer.
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "probe_common.cuh"

namespace {

using probe::check;
using probe::now_ns;

// flags[r]: how many rounds rank r has begun. result[0]: rounds timed out, result[1]: the
// slowest wait in ns.
__global__ void meet(int* flags, int rank, int round, unsigned long long timeout_ns, unsigned long long* result) {
  if (threadIdx.x != 0) return;
  atomicExch(&flags[rank], round);
  __threadfence();
  const unsigned long long start = now_ns();
  volatile int* peer = &flags[1 - rank];
  while (*peer < round)
    if (now_ns() - start > timeout_ns) {
      result[0] += 1;
      return;
    }
  const unsigned long long waited = now_ns() - start;
  if (waited > result[1]) result[1] = waited;
}

constexpr const char* kProbe = "epx-ipc-probe";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <rank 0|1|fork> <handle file> [rounds] [timeout ms]\n", argv[0]);
    return 2;
  }
  int rank = 0;
  if (std::string(argv[1]) == "fork") {
    pid_t children[2];
    for (int r = 0; r < 2; ++r)
      if ((children[r] = fork()) == 0) {
        rank = r;
        break;
      }
    if (rank == 0 && children[0] != 0) {  // the parent
      int failed = 0;
      for (pid_t child : children) {
        int status = 0;
        waitpid(child, &status, 0);
        failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      }
      std::printf("%s fork: %d of 2 ranks failed\n", kProbe, failed);
      return failed ? 1 : 0;
    }
  } else {
    rank = std::atoi(argv[1]);
  }
  const std::string path = argv[2];
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 20;
  const unsigned long long timeout_ns = (argc > 4 ? std::atoll(argv[4]) : 5000) * 1000000ull;
  int* flags = nullptr;
  if (rank == 0) {
    check(kProbe, cudaMalloc(&flags, 2 * sizeof(int)), "cudaMalloc");
    check(kProbe, cudaMemset(flags, 0, 2 * sizeof(int)), "cudaMemset");
    check(kProbe, cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cudaIpcMemHandle_t handle;
    check(kProbe, cudaIpcGetMemHandle(&handle, flags), "cudaIpcGetMemHandle");
    const std::string partial = path + ".partial";
    std::ofstream(partial, std::ios::binary).write(reinterpret_cast<const char*>(&handle), sizeof handle);
    std::rename(partial.c_str(), path.c_str());  // rank 1 sees the whole handle or none
  } else {
    cudaIpcMemHandle_t handle;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
      std::ifstream in(path, std::ios::binary);
      if (in.read(reinterpret_cast<char*>(&handle), sizeof handle)) break;
      if (std::chrono::steady_clock::now() > deadline) {
        std::fprintf(stderr, "%s: rank 1: no handle in %s after 60 s\n", kProbe, path.c_str());
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    check(kProbe, cudaIpcOpenMemHandle(reinterpret_cast<void**>(&flags), handle, cudaIpcMemLazyEnablePeerAccess),
          "cudaIpcOpenMemHandle");
  }
  unsigned long long* result = nullptr;
  check(kProbe, cudaMalloc(&result, 2 * sizeof(unsigned long long)), "cudaMalloc result");
  check(kProbe, cudaMemset(result, 0, 2 * sizeof(unsigned long long)), "cudaMemset result");
  const auto began = std::chrono::steady_clock::now();
  for (int round = 1; round <= rounds; ++round) meet<<<1, 32>>>(flags, rank, round, timeout_ns, result);
  check(kProbe, cudaGetLastError(), "launch");
  check(kProbe, cudaDeviceSynchronize(), "synchronize");
  const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
  unsigned long long host_result[2];
  check(kProbe, cudaMemcpy(host_result, result, sizeof host_result, cudaMemcpyDeviceToHost), "copy back");
  std::printf("%s rank %d: %llu of %d rounds met, %llu timed out, slowest wait %.3f ms, all rounds %.1f ms\n", kProbe,
              rank, rounds - host_result[0], rounds, host_result[0], host_result[1] / 1e6, host_ms);
  // rank 1 closes its mapping before rank 0 frees: rank 0 waits until rank 1's last round began,
  // then a moment more (a probe, not a protocol).
  if (rank == 1) check(kProbe, cudaIpcCloseMemHandle(flags), "cudaIpcCloseMemHandle");
  if (rank == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    cudaFree(flags);
    std::remove(path.c_str());
  }
  return host_result[0] == 0 ? 0 : 1;
}
