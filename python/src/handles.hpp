// Handles as tensors. A dispatch's handle crosses into Python as a small host int64 tensor (the
// "token") whose memory is the handle's holder: torch keeps it alive as long as any reference to
// the token (autograd's saved tensors, a compiled graph's buffers), and its words carry what the
// Python layer reads without a call. combine and the backward passes find the handle again from
// the token's first word, its id.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "epx/low_latency.hpp"
#include "epx/ops.hpp"

namespace epx::python {

namespace py = pybind11;

struct TokenBox {
  // The token tensor's data: [id, then per kind: high-throughput num_rows, overflow, dropped_slots;
  // low-latency: tokens of the dispatch, then the call number the Python layer writes, 0].
  int64_t words[4] = {};
  Handle handle;
  LowLatencyHandle ll_handle;
  ~TokenBox();
};

// A new token tensor (a "dltensor" capsule of [4] int64 on the host) holding the handle.
py::object export_token(const Handle& h, int64_t num_rows, bool overflow, int64_t dropped_slots);
py::object export_token(const LowLatencyHandle& h, int64_t tokens);

// The token passed as an input (None or (capsule, dtype), as tensor_io.hpp's inputs) back to its
// box. Throws BindingError naming `what` when it is missing or its handle is gone.
std::shared_ptr<TokenBox> resolve_token(py::handle arg, const char* what);

}  // namespace epx::python
