// One host thread, every local rank: the calls of several buffers of one group (the ranks this
// process drives, e.g. every GPU of a single-process server, as Modular MAX's ep_dispatch_all)
// made with one call each, one input per buffer, results in the buffers' order.
//
// The CUDA backend makes the ranks' calls from the calling thread, one after another: each returns
// once its work is enqueued and the ranks' kernels meet on the devices. So these need calls that
// never wait on the host: capacity mode for Buffer (blocking mode reads sizes and its plan check on
// the host, where rank 0 would wait for rank 1's call that this thread has not made yet: refused),
// and the low-latency calls. The CPU backend's ranks compute on the host and wait for each other,
// so there each rank's call runs on a thread of its own for the duration of the call.
//
// Every buffer must be of one single-process group (a CudaWorld, the shared GPU, a HostWorld), a
// distinct rank each, and all made by one collective creation (the n-th buffer of each rank pair
// up): checked on the CPU backend; on the CUDA backend a mix of other buffers is not detected and
// fails by timeout. A rank's failure fails the call as it would with one thread per rank (every
// rank fails it; on CUDA in capacity mode the refusing rank's next call raises it again, as with
// one thread per rank); the error thrown is the first rank's own cause (not a peer_failed echo of
// it), in buffer order. The CUDA path leaves the last buffer's device current. Creating and
// destroying the buffers stays one thread per rank (creation is a collective that waits for every
// rank on the host).
#pragma once
#include <span>
#include <vector>

#include "epx/buffer.hpp"
#include "epx/low_latency.hpp"

namespace epx {

std::vector<DispatchResult> dispatch_all(std::span<Buffer* const> buffers, std::span<const DispatchInput> inputs,
                                         const DispatchOptions& opt = {});
std::vector<CombineResult> combine_all(std::span<Buffer* const> buffers, std::span<const CombineInput> inputs,
                                       std::span<const Handle> handles, const CombineOptions& opt = {});
std::vector<LowLatencyDispatchResult> ll_dispatch_all(std::span<LowLatencyBuffer* const> buffers,
                                                      std::span<const LowLatencyDispatchInput> inputs);
std::vector<Tensor> ll_combine_all(std::span<LowLatencyBuffer* const> buffers,
                                   std::span<const LowLatencyCombineInput> inputs,
                                   std::span<const LowLatencyHandle> handles);

}  // namespace epx
