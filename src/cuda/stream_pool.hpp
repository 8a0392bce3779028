// epx's own CUDA streams (a buffer's call stream, its copy stream, the NCCL transport's all-gather
// stream) come from a process-wide pool per device and go back to it; none is ever destroyed.
// Why: streams made while a process runs share the GPU's hardware queues with each other (measured:
// `lab/churn_probe.cu`, docs/cuda.md "Known gaps", hangs item 13): rank threads on one GPU that
// each made a new stream per round timed out in ~98% of rounds, because one rank's kernel sat in
// a queue behind a peer's kernel that waited for it; with streams made once and reused, whichever
// thread takes which, none did. Reuse also spares a buffer's creation the stream calls.
#pragma once
#include <cuda_runtime.h>

namespace epx::detail {

// One of the device's idle pooled streams (non-blocking), or a new one when none is idle. The
// caller's device must be `device`.
cudaStream_t take_stream(int device);

// Back to the pool. Work still queued on it runs before its next user's (the stream's order).
void give_back_stream(int device, cudaStream_t stream);

}  // namespace epx::detail
