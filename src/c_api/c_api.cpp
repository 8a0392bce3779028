// The C ABI over the C++ objects: conversion, exception-to-status, thread-local last error.
// A refused argument of a collective call takes part in that call (Buffer::reject, or the
// creation's agreement on the config), so every rank fails the same call at once.
#include "epx/epx.h"

#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "core/check.hpp"
#include "core/creation.hpp"
#include "epx/epx.hpp"
#ifdef EPX_HAS_CUDA
#include <nccl.h>

#include "epx/cuda.hpp"
static_assert(sizeof(ncclUniqueId) == EPX_NCCL_UNIQUE_ID_BYTES, "EPX_NCCL_UNIQUE_ID_BYTES is not NCCL's id size");
#endif

struct epx_world {
  epx::HostWorld world;
};
struct epx_group {
  epx::Group group;
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

using epx::detail::cat;
using epx::detail::require;

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

void need(const void* p, const std::string& what) { require(p != nullptr, what, " must not be NULL"); }

// Runs `convert`, which turns the C arguments of this rank's next collective call `op` into C++
// ones. When it refuses one, this rank takes part in that call as a rank whose input is bad, so
// every rank fails it at once (Buffer::reject throws). A NULL buffer leaves nothing to take part
// with: it fails this rank only.
template <typename F>
auto converted(epx_buffer* buffer, const char* fn, epx::Op op, F&& convert) {
  need(buffer, cat(fn, ": buffer"));
  try {
    return convert();
  } catch (const epx::Error& e) {
    buffer->buffer.reject(op, e.what());
  }
}

epx::TensorView view_of(const epx_tensor* t, const std::string& what) {
  epx::TensorView v;
  if (!t) return v;
  require(t->ndim >= 0 && t->ndim <= epx::TensorView::kMaxDims, what, ": ndim must be in [0, 4], got ", t->ndim);
  require(t->dtype >= 0 && t->dtype <= 6, what, ": unknown dtype code ", t->dtype);
  require(t->device == 0 || t->device == 1, what, ": unknown device code ", t->device, " (0 host, 1 cuda)");
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

const epx::Handle& handle_of(const epx_result* dispatched, const char* fn) {
  need(dispatched, cat(fn, ": dispatched"));
  require(dispatched->handle.valid(), fn, ": dispatched is not a result of epx_dispatch (it holds no handle)");
  return dispatched->handle;
}

// This rank's buffer in `group`. A NULL cfg or out takes part in the creation's agreement on the
// config (as the Buffer constructor's own checks do), so every rank fails the creation at once;
// wire, combine_wire and mode codes go to the Buffer as they are, and its config checks refuse
// unknown ones.
void create(const epx::Group& group, const epx_buffer_config* cfg, epx_buffer** out, const char* fn) {
  epx::BufferConfig c;
  if (cfg) {
    c.hidden = cfg->hidden;
    c.max_tokens_per_rank = cfg->max_tokens_per_rank;
    c.num_experts = cfg->num_experts;
    c.topk = cfg->topk;
    c.wire = static_cast<epx::WireFormat>(cfg->wire);
    c.expert_alignment = cfg->expert_alignment;
    c.mode = static_cast<epx::CapacityMode>(cfg->mode);
    c.capacity_rows = cfg->capacity_rows;
    c.capacity_factor = cfg->capacity_factor;
    c.timeout_ms = cfg->timeout_ms;
    c.num_sms = cfg->num_sms;
    c.check_finite = cfg->check_finite != 0;
    c.send_blocks = cfg->send_blocks;
    c.shared_expert = cfg->shared_expert != 0;
    c.combine_wire = static_cast<epx::WireFormat>(cfg->combine_wire);
    c.num_physical_experts = cfg->num_physical_experts;
    c.max_replicas = cfg->max_replicas;
  }
  if (const char* missing = !cfg ? "cfg" : !out ? "out" : nullptr)
    epx::detail::agree_on_creation(group, "buffer", epx::describe(c), cat(fn, ": ", missing, " must not be NULL"),
                                   c.timeout_ms);  // throws
  *out = new epx_buffer{epx::Buffer(group, c)};
}

#ifdef EPX_HAS_CUDA
void need_gpu(const char* fn) {
  if (!epx::cuda_available()) epx::detail::fail(epx::ErrorCode::unsupported, fn, ": no GPU is visible to this process");
}
#else
// The CUDA functions of a build without the CUDA backend (their arguments go unused).
template <typename... Args>
[[noreturn]] void no_cuda(const char* fn, const Args&...) {
  epx::detail::fail(epx::ErrorCode::unsupported, fn,
                    ": this build of epx has no CUDA backend (it was built without CUDA); only host worlds "
                    "(epx_host_world_create) are available");
}
#endif

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

epx_status epx_host_world_group(epx_world* world, int32_t rank, epx_group** out) {
  return guard([&] {
    need(world, "epx_host_world_group: world");
    need(out, "epx_host_world_group: out");
    *out = new epx_group{world->world.group(rank)};
  });
}

epx_status epx_nccl_unique_id(char* out, size_t size) {
  return guard([&] {
#ifdef EPX_HAS_CUDA
    need(out, "epx_nccl_unique_id: out");
    require(size >= EPX_NCCL_UNIQUE_ID_BYTES, "epx_nccl_unique_id: size must be at least EPX_NCCL_UNIQUE_ID_BYTES (",
            EPX_NCCL_UNIQUE_ID_BYTES, "), got ", size);
    const std::string id = epx::nccl_unique_id();
    std::memcpy(out, id.data(), id.size());
#else
    no_cuda("epx_nccl_unique_id", out, size);
#endif
  });
}

epx_status epx_cuda_group_init_rank(const char* id, size_t id_size, int32_t rank, int32_t size, int32_t device,
                                    epx_group** out) {
  return guard([&] {
#ifdef EPX_HAS_CUDA
    need(id, "epx_cuda_group_init_rank: id");
    need(out, "epx_cuda_group_init_rank: out");
    require(id_size == EPX_NCCL_UNIQUE_ID_BYTES, "epx_cuda_group_init_rank: id_size must be EPX_NCCL_UNIQUE_ID_BYTES (",
            EPX_NCCL_UNIQUE_ID_BYTES, "), the bytes epx_nccl_unique_id wrote; got ", id_size);
    require(size >= 1 && rank >= 0 && rank < size,
            "epx_cuda_group_init_rank: rank must be in [0, size) with size >= 1, got rank ", rank, " of size ", size);
    require(device >= 0, "epx_cuda_group_init_rank: device must be >= 0, got ", device);
    need_gpu("epx_cuda_group_init_rank");
    *out = new epx_group{epx::cuda_group_init_rank(std::string(id, id_size), rank, size, device)};
#else
    no_cuda("epx_cuda_group_init_rank", id, id_size, rank, size, device, out);
#endif
  });
}

epx_status epx_cuda_group_from_comm(void* nccl_comm, int32_t device, epx_group** out) {
  return guard([&] {
#ifdef EPX_HAS_CUDA
    need(nccl_comm, "epx_cuda_group_from_comm: nccl_comm");
    need(out, "epx_cuda_group_from_comm: out");
    require(device >= 0, "epx_cuda_group_from_comm: device must be >= 0, got ", device);
    need_gpu("epx_cuda_group_from_comm");
    *out = new epx_group{epx::cuda_group_from_comm(nccl_comm, device)};
#else
    no_cuda("epx_cuda_group_from_comm", nccl_comm, device, out);
#endif
  });
}

void epx_group_destroy(epx_group* group) { delete group; }

epx_status epx_buffer_create(epx_world* world, int32_t rank, const epx_buffer_config* cfg, epx_buffer** out) {
  return guard([&] {
    need(world, "epx_buffer_create: world");
    create(world->world.group(rank), cfg, out, "epx_buffer_create");
  });
}

epx_status epx_buffer_create_in_group(const epx_group* group, const epx_buffer_config* cfg, epx_buffer** out) {
  return guard([&] {
    need(group, "epx_buffer_create_in_group: group");
    create(group->group, cfg, out, "epx_buffer_create_in_group");
  });
}

void epx_buffer_destroy(epx_buffer* buffer) { delete buffer; }

epx_status epx_buffer_set_stream(epx_buffer* buffer, void* stream) {
  return guard([&] {
    need(buffer, "epx_buffer_set_stream: buffer");
    buffer->buffer.set_stream(stream);
  });
}

epx_status epx_buffer_synchronize(epx_buffer* buffer) {
  return guard([&] {
    need(buffer, "epx_buffer_synchronize: buffer");
    buffer->buffer.synchronize();
  });
}

epx_status epx_buffer_expert_load(const epx_buffer* buffer, epx_tensor* out) {
  return guard([&] {
    need(buffer, "epx_buffer_expert_load: buffer");
    need(out, "epx_buffer_expert_load: out");
    *out = tensor_of(buffer->buffer.expert_load().view());  // the buffer keeps the counters
  });
}

epx_status epx_buffer_reset_expert_load(epx_buffer* buffer) {
  return guard([&] {
    need(buffer, "epx_buffer_reset_expert_load: buffer");
    buffer->buffer.reset_expert_load();
  });
}

epx_status epx_dispatch(epx_buffer* buffer, const epx_dispatch_args* args, epx_result** out) {
  return guard([&] {
    const auto [in, opt] = converted(buffer, "epx_dispatch", epx::Op::dispatch, [&] {
      need(args, "epx_dispatch: args");
      need(out, "epx_dispatch: out");
      epx::DispatchInput in{view_of(&args->x, "epx_dispatch: args->x"),
                            view_of(&args->x_scales, "epx_dispatch: args->x_scales"),
                            view_of(&args->topk_idx, "epx_dispatch: args->topk_idx"),
                            view_of(&args->topk_weights, "epx_dispatch: args->topk_weights"),
                            view_of(&args->routing_map, "epx_dispatch: args->routing_map"),
                            view_of(&args->probs, "epx_dispatch: args->probs"),
                            view_of(&args->shared_gate, "epx_dispatch: args->shared_gate"),
                            view_of(&args->expert_replicas, "epx_dispatch: args->expert_replicas")};
      require(args->layout == 0 || args->layout == 1, "epx_dispatch: args->layout: unknown layout code ", args->layout,
              " (0 expert_major, 1 rank_major)");
      epx::DispatchOptions opt;
      opt.layout = static_cast<epx::Layout>(args->layout);
      opt.nvfp4_global_scale = args->nvfp4_global_scale;
      return std::pair{in, opt};
    });
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
    put(*r, "topk_physical", d.topk_physical);
    r->ints = {{"num_rows", d.num_rows}, {"overflow", d.overflow}, {"dropped_slots", d.dropped_slots}};
    r->handle = d.handle;
    *out = r.release();
  });
}

epx_status epx_dispatch_cached(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* x,
                               const epx_tensor* x_scales, float nvfp4_global_scale, epx_result** out) {
  return guard([&] {
    const auto [in, handle] = converted(buffer, "epx_dispatch_cached", epx::Op::cached_dispatch, [&] {
      need(x, "epx_dispatch_cached: x");
      need(out, "epx_dispatch_cached: out");
      epx::DispatchInput in;
      in.x = view_of(x, "epx_dispatch_cached: x");
      in.x_scales = view_of(x_scales, "epx_dispatch_cached: x_scales");
      return std::pair{in, handle_of(dispatched, "epx_dispatch_cached")};
    });
    epx::DispatchResult d = buffer->buffer.dispatch(in, handle, {nvfp4_global_scale});
    auto r = std::make_unique<epx_result>();
    put(*r, "recv_x", d.recv_x);
    put(*r, "recv_scales", d.recv_scales);
    put(*r, "recv_global_scale", d.recv_global_scale);
    r->handle = d.handle;
    *out = r.release();
  });
}

epx_status epx_combine(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* y,
                       const epx_tensor* shared_out, int32_t weighted, epx_result** out) {
  return guard([&] {
    const auto [in, handle] = converted(buffer, "epx_combine", epx::Op::combine, [&] {
      need(y, "epx_combine: y");
      need(out, "epx_combine: out");
      epx::CombineInput in{view_of(y, "epx_combine: y"), view_of(shared_out, "epx_combine: shared_out")};
      return std::pair{in, handle_of(dispatched, "epx_combine")};
    });
    epx::CombineOptions opt;
    opt.weighted = weighted != 0;
    epx::CombineResult c = buffer->buffer.combine(in, handle, opt);
    auto r = std::make_unique<epx_result>();
    put(*r, "out", c.out);
    r->ints = {{"overflow", c.overflow}};
    *out = r.release();
  });
}

epx_status epx_dispatch_backward(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* grad_recv_x,
                                 const epx_tensor* grad_recv_weights, epx_result** out) {
  return guard([&] {
    const auto [in, handle] = converted(buffer, "epx_dispatch_backward", epx::Op::dispatch_backward, [&] {
      need(grad_recv_x, "epx_dispatch_backward: grad_recv_x");
      need(out, "epx_dispatch_backward: out");
      epx::DispatchBackwardInput in{view_of(grad_recv_x, "epx_dispatch_backward: grad_recv_x"),
                                    view_of(grad_recv_weights, "epx_dispatch_backward: grad_recv_weights")};
      return std::pair{in, handle_of(dispatched, "epx_dispatch_backward")};
    });
    epx::DispatchBackwardResult b = buffer->buffer.dispatch_backward(in, handle);
    auto r = std::make_unique<epx_result>();
    put(*r, "grad_x", b.grad_x);
    put(*r, "grad_topk_weights", b.grad_topk_weights);
    put(*r, "grad_shared_gate", b.grad_shared_gate);
    *out = r.release();
  });
}

epx_status epx_combine_backward(epx_buffer* buffer, const epx_result* dispatched, const epx_tensor* grad_out,
                                const epx_tensor* y, int32_t weighted, epx_result** out) {
  return guard([&] {
    const auto [in, handle] = converted(buffer, "epx_combine_backward", epx::Op::combine_backward, [&] {
      need(grad_out, "epx_combine_backward: grad_out");
      need(out, "epx_combine_backward: out");
      epx::CombineBackwardInput in{view_of(grad_out, "epx_combine_backward: grad_out"),
                                   view_of(y, "epx_combine_backward: y")};
      return std::pair{in, handle_of(dispatched, "epx_combine_backward")};
    });
    epx::CombineOptions opt;
    opt.weighted = weighted != 0;
    epx::CombineBackwardResult b = buffer->buffer.combine_backward(in, handle, opt);
    auto r = std::make_unique<epx_result>();
    put(*r, "grad_y", b.grad_y);
    put(*r, "grad_topk_weights", b.grad_topk_weights);
    put(*r, "grad_shared_gate", b.grad_shared_gate);
    *out = r.release();
  });
}

epx_status epx_result_tensor(const epx_result* result, const char* name, epx_tensor* out) {
  return guard([&] {
    need(result, "result");
    need(name, "name");
    need(out, "out");
    auto it = result->tensors.find(name);
    require(it != result->tensors.end(), "epx_result_tensor: this result has no tensor '", name, "'");
    *out = tensor_of(it->second.view());
  });
}

epx_status epx_result_int(const epx_result* result, const char* name, int64_t* out) {
  return guard([&] {
    need(result, "result");
    need(name, "name");
    need(out, "out");
    auto it = result->ints.find(name);
    require(it != result->ints.end(), "epx_result_int: this result has no value '", name, "'");
    *out = it->second;
  });
}

void epx_result_destroy(epx_result* result) { delete result; }

}  // extern "C"
