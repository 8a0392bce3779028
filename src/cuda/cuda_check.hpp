// CUDA and NCCL calls that throw epx::Error with the call and the reason.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/check.hpp"
#include "epx/config.hpp"

#define EPX_CUDA(call)                                                                                  \
  do {                                                                                                  \
    cudaError_t epx_err_ = (call);                                                                      \
    if (epx_err_ != cudaSuccess)                                                                        \
      ::epx::detail::fail(::epx::ErrorCode::internal, #call, " failed: ", cudaGetErrorString(epx_err_), \
                          " (", __FILE__, ":", __LINE__, ")");                                          \
  } while (0)

#define EPX_NCCL(call)                                                                                 \
  do {                                                                                                 \
    ncclResult_t epx_res_ = (call);                                                                    \
    if (epx_res_ != ncclSuccess)                                                                       \
      ::epx::detail::fail(::epx::ErrorCode::internal, #call, " failed: ", ncclGetErrorString(epx_res_), \
                          " (", __FILE__, ":", __LINE__, ")");                                         \
  } while (0)

namespace epx::detail {

// The high-throughput fused shared expert (BufferConfig::shared_expert): the CPU backend's only
// (the CUDA low-latency buffer has it).
inline void refuse_shared_expert(bool shared_expert, const char* what) {
  if (shared_expert)  // a valid config (the CPU backend serves it): unsupported, not invalid
    fail(ErrorCode::unsupported, what, ": the CUDA backend does not have the fused shared expert yet (shared_expert)");
}

}  // namespace epx::detail
