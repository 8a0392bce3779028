// The low-latency buffer: fused and split dispatch and combine. Its outputs on the GPU are views
// of the buffer's receive sets (docs/low-latency.md), exported as they are.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "cuda_support.hpp"
#include "epx/epx.hpp"
#include "handles.hpp"
#include "module.hpp"
#include "tensor_io.hpp"
#include "without_gil.hpp"

namespace epx::python {

namespace py = pybind11;

namespace {

class PyLowLatency {
 public:
  PyLowLatency(const Group& group, const LowLatencyConfig& config)
      : buffer_(std::make_unique<LowLatencyBuffer>(group, config)) {}

  LowLatencyBuffer& buffer() {
    if (!buffer_) throw Error(ErrorCode::invalid_argument, "low-latency buffer: closed (close() was called)");
    return *buffer_;
  }
  void close() {
    py::gil_scoped_release release;
    buffer_.reset();
  }

  void set_stream(std::uintptr_t stream) {
    py::gil_scoped_release release;
    RelaxedCapture relaxed;
    buffer().set_stream(reinterpret_cast<void*>(stream));
  }

  // A refusal of the binding's own checks joins the call (LowLatencyBuffer::reject): every peer's
  // same call fails with the reason too.
  [[noreturn]] void reject_dispatch(const std::string& reason) {
    LowLatencyBuffer& b = buffer();
    py::gil_scoped_release release;
    b.reject(LowLatencyOp::dispatch, reason);
  }

  [[noreturn]] void reject_combine(const std::string& reason) {
    LowLatencyBuffer& b = buffer();
    py::gil_scoped_release release;
    b.reject(LowLatencyOp::combine, reason);
  }

  LowLatencyDispatchInput dispatch_input(py::handle x, py::handle topk_idx, py::handle num_tokens,
                                         py::handle topk_weights, float nvfp4_global_scale, py::handle replicas,
                                         py::handle shared_gate) {
    LowLatencyDispatchInput in;
    try {
      in.x = input_view(x, "ll_dispatch: x");
      in.topk_idx = input_view(topk_idx, "ll_dispatch: topk_idx");
      in.num_tokens = input_view(num_tokens, "ll_dispatch: num_tokens");
      in.topk_weights = input_view(topk_weights, "ll_dispatch: topk_weights");
      in.expert_replicas = input_view(replicas, "ll_dispatch: expert_replicas");
      in.shared_gate = input_view(shared_gate, "ll_dispatch: shared_gate");
    } catch (const BindingError& e) {
      reject_dispatch(e.what());
    }
    in.nvfp4_global_scale = nvfp4_global_scale;
    return in;
  }

  // The handle's box and the combine's input.
  std::shared_ptr<TokenBox> combine_input(LowLatencyCombineInput& in, py::handle y, py::handle token,
                                          py::handle topk_weights, bool weighted) {
    std::shared_ptr<TokenBox> box;
    try {
      box = resolve_token(token, "ll_combine: handle");
      in.y = input_view(y, "ll_combine: y");
      in.topk_weights = input_view(topk_weights, "ll_combine: topk_weights");
    } catch (const BindingError& e) {
      reject_combine(e.what());
    }
    in.weighted = weighted;
    return box;
  }

  int64_t pending_tokens = 0;  // rows of the last dispatch_send's x, for its dispatch_recv's token

 private:
  std::unique_ptr<LowLatencyBuffer> buffer_;
};

// `tokens`: the rows of the dispatch's x (the token's second word).
py::tuple export_dispatch(const LowLatencyDispatchResult& r, int64_t tokens) {
  return py::make_tuple(export_token(r.handle, tokens), export_tensor(r.recv_x), export_tensor(r.recv_scales),
                        export_tensor(r.recv_global_scale), export_tensor(r.recv_count), export_tensor(r.recv_src),
                        export_tensor(r.recv_layout), export_tensor(r.topk_physical));
}

LowLatencyConfig make_config(int64_t hidden, int64_t max_tokens_per_rank, int64_t num_experts, int64_t topk, int wire,
                             int64_t timeout_ms, bool check_finite, bool shared_expert, int combine_wire,
                             int64_t num_physical_experts, int64_t max_replicas) {
  LowLatencyConfig c;
  c.hidden = hidden;
  c.max_tokens_per_rank = max_tokens_per_rank;
  c.num_experts = num_experts;
  c.topk = topk;
  c.wire = static_cast<WireFormat>(wire);  // epx refuses unknown codes, on every rank
  c.timeout_ms = timeout_ms;
  c.check_finite = check_finite;
  c.shared_expert = shared_expert;
  c.combine_wire = static_cast<WireFormat>(combine_wire);  // refused, on every rank, when unknown
  c.num_physical_experts = num_physical_experts;
  c.max_replicas = max_replicas;
  return c;
}

}  // namespace

void bind_low_latency(py::module_& m) {
  py::class_<LowLatencyConfig>(m, "LowLatencyConfig")
      .def(py::init(&make_config), py::kw_only(), py::arg("hidden"), py::arg("max_tokens_per_rank"),
           py::arg("num_experts"), py::arg("topk"), py::arg("wire") = 0, py::arg("timeout_ms") = 0,
           py::arg("check_finite") = false, py::arg("shared_expert") = false, py::arg("combine_wire") = 0,
           py::arg("num_physical_experts") = 0, py::arg("max_replicas") = 0)
      .def_readonly("hidden", &LowLatencyConfig::hidden)
      .def_readonly("max_tokens_per_rank", &LowLatencyConfig::max_tokens_per_rank)
      .def_readonly("num_experts", &LowLatencyConfig::num_experts)
      .def_readonly("topk", &LowLatencyConfig::topk)
      .def_property_readonly("wire", [](const LowLatencyConfig& c) { return static_cast<int>(c.wire); })
      .def_readonly("timeout_ms", &LowLatencyConfig::timeout_ms)
      .def_readonly("check_finite", &LowLatencyConfig::check_finite)
      .def_readonly("shared_expert", &LowLatencyConfig::shared_expert)
      .def_property_readonly("combine_wire", [](const LowLatencyConfig& c) { return static_cast<int>(c.combine_wire); })
      .def_readonly("num_physical_experts", &LowLatencyConfig::num_physical_experts)
      .def_readonly("max_replicas", &LowLatencyConfig::max_replicas)
      .def("__repr__", [](const LowLatencyConfig& c) { return describe(c); });

  py::class_<PyLowLatency, HolderWithoutGil<PyLowLatency>>(m, "LowLatencyBuffer")
      .def(py::init([](const Group& group, const LowLatencyConfig& config) {
             py::gil_scoped_release release;  // collective
             return new PyLowLatency(group, config);
           }),
           py::arg("group"), py::arg("config"))
      .def_property_readonly("config", [](PyLowLatency& b) { return b.buffer().config(); })
      .def("close", &PyLowLatency::close)
      .def("set_stream", &PyLowLatency::set_stream, py::arg("stream"))
      .def("synchronize", [](PyLowLatency& b) {
        py::gil_scoped_release release;
        b.buffer().synchronize();
      })
      .def("reject_dispatch", [](PyLowLatency& b, const std::string& reason) {
        b.reject_dispatch(reason);
      })
      .def("reject_combine", [](PyLowLatency& b, const std::string& reason) {
        b.reject_combine(reason);
      })
      .def("expert_load", [](PyLowLatency& b) { return export_tensor(b.buffer().expert_load()); })
      .def("reset_expert_load", [](PyLowLatency& b) { b.buffer().reset_expert_load(); })
      .def("dispatch", [](PyLowLatency& b, py::handle x, py::handle idx, py::handle num_tokens, py::handle weights,
                          float gscale, py::handle replicas, py::handle gate) {
        const LowLatencyDispatchInput in = b.dispatch_input(x, idx, num_tokens, weights, gscale, replicas, gate);
        LowLatencyDispatchResult r;
        {
          py::gil_scoped_release release;
          r = b.buffer().dispatch(in);
        }
        return export_dispatch(r, in.x.shape[0]);
      })
      .def("dispatch_send", [](PyLowLatency& b, py::handle x, py::handle idx, py::handle num_tokens,
                               py::handle weights, float gscale, py::handle replicas, py::handle gate) {
        const LowLatencyDispatchInput in = b.dispatch_input(x, idx, num_tokens, weights, gscale, replicas, gate);
        py::gil_scoped_release release;
        b.buffer().dispatch_send(in);
        b.pending_tokens = in.x.shape[0];
      })
      .def("dispatch_recv", [](PyLowLatency& b) {
        LowLatencyDispatchResult r;
        {
          py::gil_scoped_release release;
          r = b.buffer().dispatch_recv();
        }
        return export_dispatch(r, b.pending_tokens);
      })
      .def("combine", [](PyLowLatency& b, py::handle y, py::handle token, py::handle weights, bool weighted) {
        LowLatencyCombineInput in;
        const auto box = b.combine_input(in, y, token, weights, weighted);
        Tensor out;
        {
          py::gil_scoped_release release;
          out = b.buffer().combine(in, box->ll_handle);
        }
        return export_tensor(out);
      })
      .def("combine_send", [](PyLowLatency& b, py::handle y, py::handle token, py::handle weights, bool weighted) {
        LowLatencyCombineInput in;
        const auto box = b.combine_input(in, y, token, weights, weighted);
        py::gil_scoped_release release;
        b.buffer().combine_send(in, box->ll_handle);
      })
      .def("combine_recv", [](PyLowLatency& b) {
        Tensor out;
        {
          py::gil_scoped_release release;
          out = b.buffer().combine_recv();
        }
        return export_tensor(out);
      });
}

}  // namespace epx::python
