// What the binding itself does with CUDA streams (empty in a build without CUDA).
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "epx/tensor.hpp"

namespace epx::python {

// The stream a buffer's calls run on now (what the binding last gave Buffer::set_stream), shared
// with the release guards of that buffer's outputs, which outlive it.
using StreamCell = std::shared_ptr<std::atomic<void*>>;

// Where a call's CUDA outputs go when released: their memory returns to epx's pool on the stream
// the call ran on (`producer`), or to the buffer's block cache for its next call, on the buffer's
// stream then (`buffer_stream`). Torch used them on `consumer` (its current stream at the call). A
// release must be ordered after that use, as torch's record_stream does for its own allocations.
struct StreamOrder {
  int device = 0;
  void* consumer = nullptr;
  void* producer = nullptr;
  StreamCell buffer_stream;
};

// Owns a call's CUDA outputs. When the last of their tensors goes, it records an event on the
// consumer stream and makes the producer and the buffer's stream wait for it (where they differ
// from the consumer) before it releases them. Nothing to order (the usual case: every call on
// torch's current stream) costs no CUDA call. A consumer stream being captured is skipped: its
// release inside a capture belongs to the graph.
std::shared_ptr<void> guard_outputs(std::vector<Tensor> outputs, const StreamOrder& order);

// Lets this thread make calls CUDA forbids during a global-mode stream capture (a set_stream's
// synchronize of the previous, uncaptured stream), for its lifetime.
class RelaxedCapture {
 public:
  RelaxedCapture();
  ~RelaxedCapture();
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace epx::python
