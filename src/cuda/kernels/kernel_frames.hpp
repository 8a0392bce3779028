// The largest stack frame (per-thread local memory) of epx's kernels, noted as they are preloaded
// (device_common.cuh's preload). A kernel whose frame outgrows the device's local-memory
// reservation (cudaLimitStackSize, 1024 bytes by default) makes its first launch grow the
// reservation, which waits for every running kernel: on the shared GPU a peer's waiting kernel,
// so every rank would time out (docs/cuda.md, hangs item 1). The GPU tests hold the frames under it.
#pragma once
#include <cstddef>

namespace epx::detail {

void note_kernel_frame(size_t bytes);
size_t largest_kernel_frame();  // 0 until a kernel is preloaded

}  // namespace epx::detail
