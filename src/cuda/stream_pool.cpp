// The process-wide pool of epx's CUDA streams (stream_pool.hpp says why).
#include "cuda/stream_pool.hpp"

#include <map>
#include <mutex>
#include <vector>

#include "cuda/cuda_check.hpp"

namespace epx::detail {

namespace {

struct Pool {
  std::mutex mutex;
  std::map<int, std::vector<cudaStream_t>> idle;  // per device
};

// Never destroyed: a buffer may give its stream back during the process's exit, after the
// statics, and the driver releases the streams with the process.
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

cudaStream_t take_stream(int device) {
  {
    std::lock_guard lock(pool().mutex);
    auto& idle = pool().idle[device];
    if (!idle.empty()) {
      cudaStream_t s = idle.back();
      idle.pop_back();
      return s;
    }
  }
  cudaStream_t s = nullptr;
  EPX_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void give_back_stream(int device, cudaStream_t stream) {
  if (!stream) return;
  std::lock_guard lock(pool().mutex);
  pool().idle[device].push_back(stream);
}

}  // namespace epx::detail
