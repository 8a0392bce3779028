// The C ABI over the C++ objects: conversion, exception-to-status, thread-local last error.
#include "epx/epx.h"

#include <map>
#include <string>

#include "core/check.hpp"
#include "epx/epx.hpp"

struct epx_world {
  epx::HostWorld world;
};
struct epx_buffer {
  epx::Buffer buffer;
};
struct epx_result {
  std::map<std::string, epx::Tensor> tensors;
  std::map<std::string, int64_t> ints;
  epx::Handle handle;
};

namespace {

thread_local std::string last_error;

template <typename F>
epx_status guard(F&& body) {
  try {
    body();
    last_error.clear();
    return EPX_OK;
  } catch (const epx::Error& e) {
    last_error = e.what();
    return static_cast<epx_status>(e.code());
  } catch (const std::exception& e) {
    last_error = std::string("epx internal error: ") + e.what();
    return EPX_ERR_INTERNAL;
  }
}

void need(const void* p, const char* what) { epx::detail::require(p != nullptr, what, " must not be NULL"); }

epx::TensorView view_of(const epx_tensor* t) {
  epx::TensorView v;
  if (!t) return v;
  epx::detail::require(t->ndim >= 0 && t->ndim <= epx::TensorView::kMaxDims, "epx_tensor: ndim must be in [0, 4], got ",
                       t->ndim);
  epx::detail::require(t->dtype >= 0 && t->dtype <= 6, "epx_tensor: unknown dtype code ", t->dtype);
  v.data = t->data;
  v.dtype = static_cast<epx::DType>(t->dtype);
  v.ndim = t->ndim;
  for (int d = 0; d < 4; ++d) {
    v.shape[d] = t->shape[d];
    v.strides[d] = t->strides[d];
  }
  v.device = static_cast<epx::DeviceKind>(t->device);
  v.device_index = t->device_index;
  return v;
}

epx_tensor tensor_of(const epx::TensorView& v) {
  epx_tensor t{};
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.ndim = v.ndim;
  for (int d = 0; d < 4; ++d) {
    t.shape[d] = v.shape[d];
    t.strides[d] = v.strides[d];
  }
  t.device = static_cast<int32_t>(v.device);
  t.device_index = v.device_index;
  return t;
}

void put(epx_result& r, const char* name, const epx::Tensor& t) {
  if (t.defined()) r.tensors[name] = t;
}

const epx::Handle& handle_of(const epx_result* dispatched) {
  need(dispatched, "dispatched");
  epx::detail::require(dispatched->handle.valid(), "dispatched: not the result of epx_dispatch");
  return dispatched->handle;
}

}  // namespace

extern "C" {

const char* epx_last_error(void) { return last_error.c_str(); }

void epx_buffer_config_default(epx_buffer_config* cfg) {
  if (!cfg) return;
  *cfg = epx_buffer_config{};
  cfg->expert_alignment = 1;
}

epx_status epx_host_world_create(int32_t ranks, epx_world** out) {
  return guard([&] {
    need(out, "out");
    *out = new epx_world{epx::HostWorld(ranks)};
  });
}

void epx_host_world_destroy(epx_world* world) { delete world; }

epx_status epx_buffer_create(epx_world* world, int32_t rank, const epx_buffer_config* cfg, epx_buffer** out) {
  return guard([&] {
    need(world, "world");
    need(cfg, "cfg");
    need(out, "out");
    epx::BufferConfig c;
    c.hidden = cfg->hidden;
    c.max_tokens_per_rank = cfg->max_tokens_per_rank;
    c.num_experts = cfg->num_experts;
    c.topk = cfg->topk;
    epx::detail::require(cfg->wire >= 0 && cfg->wire <= 3, "epx_buffer_config: unknown wire code ", cfg->wire);
    epx::detail::require(cfg->mode == 0 || cfg->mode == 1, "epx_buffer_config: unknown mode code ", cfg->mode);
    c.wire = static_cast<epx::WireFormat>(cfg->wire);
    c.expert_alignment = cfg->expert_alignment;
    c.mode = static_cast<epx::CapacityMode>(cfg->mode);
    c.capacity_rows = cfg->capacity_rows;
    c.capacity_factor = cfg->capacity_factor;
    c.timeout_ms = cfg->timeout_ms;
    *out = new epx_buffer{epx::Buffer(world->world.group(rank), c)};
  });
}

void epx_buffer_destroy(epx_buffer* buffer) { delete buffer; }

epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, epx_result** out) {
  return guard([&] {
    need(buffer, "buffer");
    need(args, "args");
    need(out, "out");
    epx::DispatchInput in{view_of(&args->x), view_of(&args->x_scales), view_of(&args->topk_idx),
                          view_of(&args->topk_weights), view_of(&args->routing_map), view_of(&args->probs)};
    epx::detail::require(args->layout == 0 || args->layout == 1, "epx_dispatch_args: unknown layout code ", args->layout);
    epx::DispatchOptions opt;
    opt.layout = static_cast<epx::Layout>(args->layout);
    opt.nvfp4_global_scale = args->nvfp4_global_scale;
    epx::DispatchResult d = buffer->buffer.dispatch(in, opt);
    auto r = std::make_unique<epx_result>();
    put(*r, "recv_x", d.recv_x);
    put(*r, "recv_scales", d.recv_scales);
    put(*r, "recv_global_scale", d.recv_global_scale);
    put(*r, "recv_src", d.recv_src);
    put(*r, "recv_weights", d.recv_weights);
    put(*r, "recv_topk_idx", d.recv_topk_idx);
    put(*r, "recv_topk_weights", d.recv_topk_weights);
    put(*r, "expert_offsets", d.expert_offsets);
    put(*r, "tokens_per_expert", d.tokens_per_expert);
    put(*r, "rank_offsets", d.rank_offsets);
    r->ints = {{"num_rows", d.num_rows}, {"overflow", d.overflow}, {"dropped_slots", d.dropped_slots}};
    r->handle = d.handle;
    *out = r.release();
  });
}

epx_status epx_combine(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* y,
                       const epx_tensor* shared_out, int32_t weighted, epx_result** out) {
  return guard([&] {
    need(buffer, "buffer");
    need(y, "y");
    need(out, "out");
    epx::CombineOptions opt;
    opt.weighted = weighted != 0;
    epx::CombineResult c = buffer->buffer.combine({view_of(y), view_of(shared_out)}, handle_of(dispatched), opt);
    auto r = std::make_unique<epx_result>();
    put(*r, "out", c.out);
    r->ints = {{"overflow", c.overflow}};
    *out = r.release();
  });
}

epx_status epx_dispatch_backward(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* grad_recv_x,
                                 const epx_tensor* grad_recv_weights, epx_result** out) {
  return guard([&] {
    need(buffer, "buffer");
    need(grad_recv_x, "grad_recv_x");
    need(out, "out");
    epx::DispatchBackwardResult b =
        buffer->buffer.dispatch_backward({view_of(grad_recv_x), view_of(grad_recv_weights)}, handle_of(dispatched));
    auto r = std::make_unique<epx_result>();
    put(*r, "grad_x", b.grad_x);
    put(*r, "grad_topk_weights", b.grad_topk_weights);
    *out = r.release();
  });
}

epx_status epx_combine_backward(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* grad_out,
                                const epx_tensor* y, int32_t weighted, epx_result** out) {
  return guard([&] {
    need(buffer, "buffer");
    need(grad_out, "grad_out");
    need(out, "out");
    epx::CombineOptions opt;
    opt.weighted = weighted != 0;
    epx::CombineBackwardResult b =
        buffer->buffer.combine_backward({view_of(grad_out), view_of(y)}, handle_of(dispatched), opt);
    auto r = std::make_unique<epx_result>();
    put(*r, "grad_y", b.grad_y);
    put(*r, "grad_topk_weights", b.grad_topk_weights);
    *out = r.release();
  });
}

epx_status epx_result_tensor(const epx_result* result, const char* name, epx_tensor* out) {
  return guard([&] {
    need(result, "result");
    need(name, "name");
    need(out, "out");
    auto it = result->tensors.find(name);
    epx::detail::require(it != result->tensors.end(), "epx_result_tensor: this result has no tensor '", name, "'");
    *out = tensor_of(it->second.view());
  });
}

epx_status epx_result_int(const epx_result* result, const char* name, int64_t* out) {
  return guard([&] {
    need(result, "result");
    need(name, "name");
    need(out, "out");
    auto it = result->ints.find(name);
    epx::detail::require(it != result->ints.end(), "epx_result_int: this result has no value '", name, "'");
    *out = it->second;
  });
}

void epx_result_destroy(epx_result* result) { delete result; }

}  // extern "C"
