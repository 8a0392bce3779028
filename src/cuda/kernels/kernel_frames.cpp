// The largest kernel stack frame seen (kernel_frames.hpp).
#include "cuda/kernels/kernel_frames.hpp"

#include <atomic>

namespace epx::detail {

namespace {
std::atomic<size_t> largest{0};
}  // namespace

void note_kernel_frame(size_t bytes) {
  size_t seen = largest.load();
  while (bytes > seen && !largest.compare_exchange_weak(seen, bytes)) {
  }
}

size_t largest_kernel_frame() { return largest.load(); }

}  // namespace epx::detail
