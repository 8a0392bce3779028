// The high-throughput Buffer: dispatch, combine and both backward passes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda_support.hpp"
#include "epx/epx.hpp"
#include "handles.hpp"
#include "module.hpp"
#include "tensor_io.hpp"
#include "without_gil.hpp"

namespace epx::python {

namespace py = pybind11;

namespace {

// A Buffer and the stream its calls run on now (shared with its outputs' release guards).
class PyBuffer {
 public:
  PyBuffer(const Group& group, const BufferConfig& config)
      : buffer_(std::make_unique<Buffer>(group, config)),
        device_(group_device(group)),
        stream_(std::make_shared<std::atomic<void*>>(nullptr)) {}

  Buffer& buffer() {
    if (!buffer_) throw Error(ErrorCode::invalid_argument, "buffer: closed (Buffer.close() was called)");
    return *buffer_;
  }
  // Destroys the buffer now (outputs stay valid); later calls raise.
  void close() {
    py::gil_scoped_release release;
    buffer_.reset();
  }
  bool cuda() const { return device_ >= 0; }
  int device() const { return device_; }

  // Collective calls wait for the peers: the GIL is released for them (ranks may be threads).
  void set_stream(std::uintptr_t stream) {
    py::gil_scoped_release release;
    RelaxedCapture relaxed;  // its synchronize of the previous stream, also during a capture
    buffer().set_stream(reinterpret_cast<void*>(stream));
    stream_->store(reinterpret_cast<void*>(stream));
  }

  // Builds a call's input; a refusal of the binding's own checks joins the call as a rejection,
  // so every peer's same call fails too (Buffer::reject always throws).
  template <typename Build>
  void build(Op op, Build&& build_input) {
    std::string refused;
    try {
      build_input();
      return;
    } catch (const BindingError& e) {
      refused = e.what();
    }
    Buffer& b = buffer();
    py::gil_scoped_release release;
    b.reject(op, refused);
  }

  [[noreturn]] void reject(int op, const std::string& reason) {
    if (op < 0 || op > 4) throw py::value_error("reject: unknown op code " + std::to_string(op));
    Buffer& b = buffer();
    py::gil_scoped_release release;
    b.reject(static_cast<Op>(op), reason);
  }

  // A call's outputs as capsules. CUDA outputs share one guard, which orders their release after
  // torch's use on `consumer` (cuda_support.hpp); host outputs own their memory each.
  std::vector<py::object> export_all(const std::vector<const Tensor*>& outputs, std::uintptr_t consumer) {
    std::shared_ptr<void> guard;
    if (cuda()) {
      std::vector<Tensor> kept;
      for (const Tensor* t : outputs)
        if (t->defined()) kept.push_back(*t);
      guard = guard_outputs(std::move(kept), {device_, reinterpret_cast<void*>(consumer), stream_->load(), stream_});
    }
    std::vector<py::object> exported;
    for (const Tensor* t : outputs) exported.push_back(export_tensor(*t, guard));
    return exported;
  }

 private:
  std::unique_ptr<Buffer> buffer_;
  int device_;
  StreamCell stream_;
};

Layout layout_of(int code) {
  if (code != 0 && code != 1)
    throw BindingError("layout: unknown code " + std::to_string(code) + "; use 0 expert_major or 1 rank_major");
  return static_cast<Layout>(code);
}

py::tuple dispatch(PyBuffer& self, py::handle x, py::handle x_scales, py::handle topk_idx, py::handle topk_weights,
                   py::handle routing_map, py::handle probs, py::handle shared_gate, int layout,
                   float nvfp4_global_scale, std::uintptr_t consumer, py::handle expert_replicas) {
  DispatchInput in;
  DispatchOptions opt;
  self.build(Op::dispatch, [&] {
    in.x = input_view(x, "dispatch: x");
    in.x_scales = input_view(x_scales, "dispatch: x_scales");
    in.topk_idx = input_view(topk_idx, "dispatch: topk_idx");
    in.topk_weights = input_view(topk_weights, "dispatch: topk_weights");
    in.routing_map = input_view(routing_map, "dispatch: routing_map");
    in.probs = input_view(probs, "dispatch: probs");
    in.shared_gate = input_view(shared_gate, "dispatch: shared_gate");
    in.expert_replicas = input_view(expert_replicas, "dispatch: expert_replicas");
    opt.layout = layout_of(layout);
    opt.nvfp4_global_scale = nvfp4_global_scale;
  });
  DispatchResult r;
  {
    py::gil_scoped_release release;
    r = self.buffer().dispatch(in, opt);
  }
  std::vector<py::object> out =
      self.export_all({&r.recv_x, &r.recv_scales, &r.recv_global_scale, &r.recv_src, &r.recv_weights, &r.recv_topk_idx,
                       &r.recv_topk_weights, &r.expert_offsets, &r.tokens_per_expert, &r.rank_offsets, &r.recv_info,
                       &r.topk_physical},
                      consumer);
  py::tuple result(out.size() + 1);
  result[0] = export_token(r.handle, r.num_rows, r.overflow, r.dropped_slots);
  for (size_t i = 0; i < out.size(); ++i) result[i + 1] = out[i];
  return result;
}

// Cached dispatch: (recv_x, recv_scales, recv_global_scale) in the layout of the token's dispatch.
py::tuple cached_dispatch(PyBuffer& self, py::handle x, py::handle x_scales, py::handle token,
                          float nvfp4_global_scale, std::uintptr_t consumer) {
  DispatchInput in;
  std::shared_ptr<TokenBox> box;
  self.build(Op::cached_dispatch, [&] {
    box = resolve_token(token, "cached_dispatch: handle");
    in.x = input_view(x, "cached_dispatch: x");
    in.x_scales = input_view(x_scales, "cached_dispatch: x_scales");
  });
  DispatchResult r;
  {
    py::gil_scoped_release release;
    r = self.buffer().dispatch(in, box->handle, {nvfp4_global_scale});
  }
  auto out = self.export_all({&r.recv_x, &r.recv_scales, &r.recv_global_scale}, consumer);
  return py::make_tuple(out[0], out[1], out[2]);
}

py::tuple combine(PyBuffer& self, py::handle y, py::handle token, py::handle shared_out, bool weighted,
                  std::uintptr_t consumer) {
  CombineInput in;
  std::shared_ptr<TokenBox> box;
  self.build(Op::combine, [&] {
    box = resolve_token(token, "combine: handle");
    in.y = input_view(y, "combine: y");
    in.shared_out = input_view(shared_out, "combine: shared_out");
  });
  CombineResult r;
  {
    py::gil_scoped_release release;
    r = self.buffer().combine(in, box->handle, {weighted});
  }
  return py::make_tuple(self.export_all({&r.out}, consumer)[0], r.overflow);
}

py::tuple dispatch_backward(PyBuffer& self, py::handle grad_recv_x, py::handle grad_recv_weights, py::handle token,
                            std::uintptr_t consumer) {
  DispatchBackwardInput in;
  std::shared_ptr<TokenBox> box;
  self.build(Op::dispatch_backward, [&] {
    box = resolve_token(token, "dispatch_backward: handle");
    in.grad_recv_x = input_view(grad_recv_x, "dispatch_backward: grad_recv_x");
    in.grad_recv_weights = input_view(grad_recv_weights, "dispatch_backward: grad_recv_weights");
  });
  DispatchBackwardResult r;
  {
    py::gil_scoped_release release;
    r = self.buffer().dispatch_backward(in, box->handle);
  }
  auto out = self.export_all({&r.grad_x, &r.grad_topk_weights, &r.grad_shared_gate}, consumer);
  return py::make_tuple(out[0], out[1], out[2]);
}

py::tuple combine_backward(PyBuffer& self, py::handle grad_out, py::handle y, py::handle token, bool weighted,
                           std::uintptr_t consumer) {
  CombineBackwardInput in;
  std::shared_ptr<TokenBox> box;
  self.build(Op::combine_backward, [&] {
    box = resolve_token(token, "combine_backward: handle");
    in.grad_out = input_view(grad_out, "combine_backward: grad_out");
    in.y = input_view(y, "combine_backward: y");
  });
  CombineBackwardResult r;
  {
    py::gil_scoped_release release;
    r = self.buffer().combine_backward(in, box->handle, {weighted});
  }
  auto out = self.export_all({&r.grad_y, &r.grad_topk_weights, &r.grad_shared_gate}, consumer);
  return py::make_tuple(out[0], out[1], out[2]);
}

BufferConfig make_config(int64_t hidden, int64_t max_tokens_per_rank, int64_t num_experts, int64_t topk, int wire,
                         int64_t expert_alignment, int mode, int64_t capacity_rows, double capacity_factor,
                         int64_t timeout_ms, int64_t num_sms, bool check_finite, int64_t send_blocks,
                         bool shared_expert, int combine_wire, int64_t num_physical_experts,
                         int64_t max_replicas) {
  BufferConfig c;
  c.hidden = hidden;
  c.max_tokens_per_rank = max_tokens_per_rank;
  c.num_experts = num_experts;
  c.topk = topk;
  c.wire = static_cast<WireFormat>(wire);  // epx refuses unknown codes, on every rank
  c.expert_alignment = expert_alignment;
  c.mode = static_cast<CapacityMode>(mode);
  c.capacity_rows = capacity_rows;
  c.capacity_factor = capacity_factor;
  c.timeout_ms = timeout_ms;
  c.num_sms = num_sms;
  c.check_finite = check_finite;
  c.send_blocks = send_blocks;
  c.shared_expert = shared_expert;
  c.combine_wire = static_cast<WireFormat>(combine_wire);  // refused, on every rank, when unknown
  c.num_physical_experts = num_physical_experts;
  c.max_replicas = max_replicas;
  return c;
}

}  // namespace

void bind_buffer(py::module_& m) {
  py::class_<BufferConfig>(m, "BufferConfig")
      .def(py::init(&make_config), py::kw_only(), py::arg("hidden"), py::arg("max_tokens_per_rank"),
           py::arg("num_experts"), py::arg("topk"), py::arg("wire") = 0, py::arg("expert_alignment") = 1,
           py::arg("mode") = 0, py::arg("capacity_rows") = 0, py::arg("capacity_factor") = 0.0,
           py::arg("timeout_ms") = 0, py::arg("num_sms") = 0, py::arg("check_finite") = false,
           py::arg("send_blocks") = 0, py::arg("shared_expert") = false, py::arg("combine_wire") = 0,
           py::arg("num_physical_experts") = 0, py::arg("max_replicas") = 0)
      .def_readonly("hidden", &BufferConfig::hidden)
      .def_readonly("max_tokens_per_rank", &BufferConfig::max_tokens_per_rank)
      .def_readonly("num_experts", &BufferConfig::num_experts)
      .def_readonly("topk", &BufferConfig::topk)
      .def_property_readonly("wire", [](const BufferConfig& c) { return static_cast<int>(c.wire); })
      .def_readonly("expert_alignment", &BufferConfig::expert_alignment)
      .def_property_readonly("mode", [](const BufferConfig& c) { return static_cast<int>(c.mode); })
      .def_readonly("capacity_rows", &BufferConfig::capacity_rows)
      .def_readonly("capacity_factor", &BufferConfig::capacity_factor)
      .def_readonly("timeout_ms", &BufferConfig::timeout_ms)
      .def_readonly("num_sms", &BufferConfig::num_sms)
      .def_readonly("check_finite", &BufferConfig::check_finite)
      .def_readonly("send_blocks", &BufferConfig::send_blocks)
      .def_readonly("shared_expert", &BufferConfig::shared_expert)
      .def_property_readonly("combine_wire", [](const BufferConfig& c) { return static_cast<int>(c.combine_wire); })
      .def_readonly("num_physical_experts", &BufferConfig::num_physical_experts)
      .def_readonly("max_replicas", &BufferConfig::max_replicas)
      .def("__repr__", [](const BufferConfig& c) { return describe(c); });

  py::class_<PyBuffer, HolderWithoutGil<PyBuffer>>(m, "Buffer")
      .def(py::init([](const Group& group, const BufferConfig& config) {
             py::gil_scoped_release release;  // collective: every rank constructs one
             return new PyBuffer(group, config);
           }),
           py::arg("group"), py::arg("config"))
      .def_property_readonly("config", [](PyBuffer& b) { return b.buffer().config(); })
      .def_property_readonly("group", [](PyBuffer& b) { return b.buffer().group(); })
      .def_property_readonly("device", &PyBuffer::device)
      .def("close", &PyBuffer::close)
      .def("set_stream", &PyBuffer::set_stream, py::arg("stream"))
      .def("synchronize", [](PyBuffer& b) {
        py::gil_scoped_release release;
        b.buffer().synchronize();
      })
      .def("wait_event", [](PyBuffer& b, std::uintptr_t e) { b.buffer().wait_event(reinterpret_cast<void*>(e)); })
      .def("record_event", [](PyBuffer& b, std::uintptr_t e) { b.buffer().record_event(reinterpret_cast<void*>(e)); })
      .def("reject", &PyBuffer::reject, py::arg("op"), py::arg("reason"))
      // A view of the buffer's counters (the tensor shares their memory; the CUDA backend refuses).
      .def("expert_load", [](PyBuffer& b) { return export_tensor(b.buffer().expert_load()); })
      .def("reset_expert_load", [](PyBuffer& b) { b.buffer().reset_expert_load(); })
      .def("dispatch", &dispatch)
      .def("cached_dispatch", &cached_dispatch)
      .def("combine", &combine)
      .def("dispatch_backward", &dispatch_backward)
      .def("combine_backward", &combine_backward);
}

}  // namespace epx::python
