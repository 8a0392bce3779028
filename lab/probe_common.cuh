// What the probes of the shared-GPU hold-back share (queue_probe.cu, sync_probe.cu, call_probe.cu;
// docs/cuda.md): the device timer, a kernel that spins on a flag with a timeout (the "peer's
// waiting kernel"), the kernel that sets the flag, and an error check that names the probe.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace probe {

__device__ inline unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag == want; after timeout_ns sets *timed_out and gives up. *began (if given): when
// the spin began, on the device timer.
__global__ void wait_flag(volatile int* flag, int want, unsigned long long timeout_ns, int* timed_out,
                          unsigned long long* began = nullptr) {
  const unsigned long long start = now_ns();
  if (began) *began = start;
  while (*flag != want)
    if (now_ns() - start > timeout_ns) {
      *timed_out = 1;
      return;
    }
}

__global__ void set_flag(volatile int* flag, int value) { *flag = value; }

// Exits with the probe's name and CUDA's words on an error.
inline void check(const char* probe, cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s: %s\n", probe, what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace probe
