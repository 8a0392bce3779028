// Buffer::set_stream's ordering of the calls on the new stream after those on the old one.
#pragma once
#include <cuda_runtime.h>

#include "cuda/cuda_check.hpp"

namespace epx::detail {

// Calls enqueued on `next` from now on start after the calls already enqueued on `previous`,
// with no host wait: `next` waits for `event`, recorded on `previous`. A stream being captured
// into a CUDA graph cannot wait for an event recorded outside its capture, so where `next` is
// captured and `previous` is not, the host waits for `previous` instead (torch.cuda.graph
// synchronizes the device before a capture anyway).
inline void order_after(cudaStream_t previous, cudaStream_t next, cudaEvent_t event) {
  if (previous == next) return;
  cudaStreamCaptureStatus prev_capture = cudaStreamCaptureStatusNone, next_capture = cudaStreamCaptureStatusNone;
  EPX_CUDA(cudaStreamIsCapturing(previous, &prev_capture));
  EPX_CUDA(cudaStreamIsCapturing(next, &next_capture));
  if (next_capture != cudaStreamCaptureStatusNone && prev_capture == cudaStreamCaptureStatusNone) {
    EPX_CUDA(cudaStreamSynchronize(previous));
    return;
  }
  EPX_CUDA(cudaEventRecord(event, previous));
  EPX_CUDA(cudaStreamWaitEvent(next, event, 0));
}

}  // namespace epx::detail
