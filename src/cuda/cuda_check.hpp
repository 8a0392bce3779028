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
