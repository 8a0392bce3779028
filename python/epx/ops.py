"""epx's calls as torch operators: torch.ops.epx.*, registered with torch.library.

torch.compile traces them as single operators (no graph breaks): their real kernels call the
buffer (found by its int id: a schema has no type for a Python object), their fake kernels give
the outputs' shapes from the buffer's configuration. A dispatch's handle travels as its token
tensor, optional outputs as empty tensors (the ``present`` tables below say which are real). The
ops run on torch's current stream.

Fake kernels: ``torch.library.register_fake`` (torch >= 2.4), else ``impl_abstract`` (2.1 - 2.3),
else a Meta kernel (older torch: no torch.compile, but the ops still run and meta tensors get
shapes). Blocking mode's row count is data-dependent: under torch.compile it is an unbacked size
(``new_dynamic_size``, torch >= 2.1); capacity mode and the low-latency calls have static shapes.
"""

import torch
from torch.library import Library

from . import registry
from .config import Layout, WireFormat
from .errors import Unsupported
from .tensors import fp8_dtype

_lib = Library("epx", "DEF")

_lib.define("dispatch(int buffer, Tensor x, Tensor? x_scales, Tensor? topk_idx, Tensor? topk_weights, "
            "Tensor? routing_map, Tensor? probs, int layout, float nvfp4_global_scale, "
            "Tensor? expert_replicas=None, Tensor? shared_gate=None) -> Tensor[]")
_lib.define("combine(int buffer, Tensor y, Tensor handle, Tensor? shared_out, bool weighted, SymInt tokens) -> Tensor")
_lib.define("dispatch_backward(int buffer, Tensor grad_recv_x, Tensor? grad_recv_weights, Tensor handle, "
            "SymInt tokens) -> Tensor[]")
_lib.define("combine_backward(int buffer, Tensor grad_out, Tensor? y, Tensor handle, bool weighted, "
            "SymInt rows) -> Tensor[]")
_lib.define("ll_dispatch(int buffer, Tensor x, Tensor topk_idx, Tensor? num_tokens, Tensor? topk_weights, "
            "float nvfp4_global_scale, Tensor? expert_replicas=None, Tensor? shared_gate=None) -> Tensor[]")
_lib.define("ll_combine(int buffer, Tensor y, Tensor handle, Tensor? topk_weights, bool weighted, "
            "SymInt tokens) -> Tensor")


# --- output shapes (the fake kernels, and which optional outputs exist) ------------------------

def _topk_physical(buffer, tokens):
    """EPLB's topk_physical [T, K] int32 (None without EPLB)."""
    return ((tokens, buffer.topk), torch.int32) if buffer.eplb else None


def dispatch_outputs(buffer, layout, rows, tokens=0):
    """(shape, dtype) of each tensor of the dispatch op after the token (outputs.DISPATCH_TENSORS order, then
    topk_physical), None where the configuration gives none."""
    h, k, local, ranks, wire = buffer.hidden, buffer.topk, buffer.num_local_experts, buffer.num_ranks, buffer.wire_code
    expert_major = layout == Layout.expert_major
    segments = local + (1 if buffer.shared_expert else 0)  # shared_expert: its segment comes first
    if wire == WireFormat.bf16:
        x, scales = ((rows, h), torch.bfloat16), None
    elif wire == WireFormat.nvfp4:
        x, scales = ((rows, h // 2), torch.uint8), ((rows, h // 16), fp8_dtype())
    else:
        x, scales = ((rows, h), fp8_dtype()), ((rows, h // 128), torch.float32)
    return [x, scales, ((rows,), torch.float32) if wire == WireFormat.nvfp4 else None,
            ((rows, 2), torch.int32),
            ((rows,), torch.float32) if expert_major else None,
            None if expert_major else ((rows, k), torch.int32),
            None if expert_major else ((rows, k), torch.float32),
            ((segments + 1,), torch.int64) if expert_major else None,
            ((segments,), torch.int64), ((ranks + 1,), torch.int64), ((4,), torch.int64),
            _topk_physical(buffer, tokens)]


def ll_dispatch_outputs(buffer, tokens=0):
    """(shape, dtype) of each tensor of the ll_dispatch op after the token, None where absent."""
    h, wire = buffer.hidden, buffer.wire_code
    local = buffer.num_local_experts + (1 if buffer.shared_expert else 0)  # shared_expert: its expert first
    slots = buffer.num_ranks * buffer.max_tokens_per_rank
    if wire == WireFormat.bf16:
        x, scales = ((local, slots, h), torch.bfloat16), None
    elif wire == WireFormat.nvfp4:
        x, scales = ((local, slots, h // 2), torch.uint8), ((local, slots, h // 16), fp8_dtype())
    else:
        x, scales = ((local, slots, h), fp8_dtype()), ((local, slots, h // 128), torch.float32)
    return [x, scales, ((local, slots), torch.float32) if wire == WireFormat.nvfp4 else None,
            ((local,), torch.int32), ((local, slots, 2), torch.int32), ((local, buffer.num_ranks, 2), torch.int32),
            _topk_physical(buffer, tokens)]


def present(outputs):
    return [spec is not None for spec in outputs]


def _empty(dtype, device):
    return torch.empty(0, dtype=dtype, device=device)


def _fill(tensors, specs, device):
    """Real outputs with empty tensors where the configuration gives none (an op returns no None)."""
    out = []
    for t, spec in zip(tensors, specs):
        out.append(t if t is not None else _empty(spec[1] if spec else torch.float32, device))
    return out


def _token_device(device):
    return device if device.type == "meta" else torch.device("cpu")


def _dynamic_rows():
    try:
        ctx = torch.library.get_ctx()
    except AttributeError:
        ctx = None
    for name in ("new_dynamic_size", "create_unbacked_symint"):
        if ctx is not None and hasattr(ctx, name):
            return getattr(ctx, name)()
    raise Unsupported("epx.dispatch in blocking mode has a data-dependent row count, which this torch cannot "
                      "trace; use capacity mode (Buffer(..., capacity_rows=...)) under torch.compile")


# --- real kernels --------------------------------------------------------------------------

def _dispatch(buffer_id, x, x_scales, topk_idx, topk_weights, routing_map, probs, layout, nvfp4_global_scale,
              expert_replicas=None, shared_gate=None):
    buffer = registry.get(buffer_id)
    d = buffer.dispatch(x, topk_idx, topk_weights, x_scales=x_scales, routing_map=routing_map, probs=probs,
                        layout=layout, nvfp4_global_scale=nvfp4_global_scale, expert_replicas=expert_replicas,
                        shared_gate=shared_gate)
    specs = dispatch_outputs(buffer, layout, 0, x.shape[0])
    return [d.handle.token] + _fill(list(d[:11]) + [d.topk_physical], specs, x.device)


def _combine(buffer_id, y, token, shared_out, weighted, tokens):
    buffer = registry.get(buffer_id)
    return buffer.combine(y, _handle(buffer, token, tokens, weighted), shared_out=shared_out, weighted=weighted).out


def _dispatch_backward(buffer_id, grad_recv_x, grad_recv_weights, token, tokens):
    buffer = registry.get(buffer_id)
    g = buffer.dispatch_backward(grad_recv_x, _handle(buffer, token, tokens, False), grad_recv_weights)
    gate = _gate_grad(buffer, g.grad_shared_gate, grad_recv_weights is not None, tokens, grad_recv_x.device)
    return [g.grad_x] + _fill([g.grad_topk_weights, gate], [None, None], grad_recv_x.device)


def _combine_backward(buffer_id, grad_out, y, token, weighted, rows):
    buffer = registry.get(buffer_id)
    g = buffer.combine_backward(grad_out, _handle(buffer, token, grad_out.shape[0], weighted), y, weighted=weighted)
    gate = _gate_grad(buffer, g.grad_shared_gate, weighted, grad_out.shape[0], grad_out.device)
    return [g.grad_y] + _fill([g.grad_topk_weights, gate], [None, None], grad_out.device)


def _gate_grad(buffer, grad, flows, tokens, device):
    """grad_shared_gate as the fake kernels shape it: [T] wherever the buffer has the shared expert and a
    weight gradient flows (zeros where the dispatch had no gate), else none."""
    if grad is None and flows and buffer.shared_expert:
        return torch.zeros(tokens, dtype=torch.float32, device=device)
    return grad


def _ll_dispatch(buffer_id, x, topk_idx, num_tokens, topk_weights, nvfp4_global_scale, expert_replicas=None,
                 shared_gate=None):
    buffer = registry.get(buffer_id)
    d = buffer.dispatch(x, topk_idx, num_tokens=num_tokens, topk_weights=topk_weights,
                        nvfp4_global_scale=nvfp4_global_scale, expert_replicas=expert_replicas, shared_gate=shared_gate)
    return [d.handle.token] + _fill(list(d[:6]) + [d.topk_physical], ll_dispatch_outputs(buffer, x.shape[0]), x.device)


def _ll_combine(buffer_id, y, token, topk_weights, weighted, tokens):
    from .low_latency import LowLatencyHandle

    buffer = registry.get(buffer_id)
    handle = LowLatencyHandle(token, buffer_id, -1, tokens, False)  # the call is in the token (low_latency.py)
    return buffer.combine(y, handle, topk_weights=topk_weights, weighted=weighted)


def _handle(buffer, token, tokens, weighted):
    from .outputs import Handle

    return Handle(token, buffer.id, Layout.expert_major, tokens, weighted)


# --- fake kernels --------------------------------------------------------------------------

def _dispatch_fake(buffer_id, x, x_scales, topk_idx, topk_weights, routing_map, probs, layout, nvfp4_global_scale,
                   expert_replicas=None, shared_gate=None):
    buffer = registry.get(buffer_id)
    rows = buffer.capacity_rows if buffer.capacity_rows else _dynamic_rows()
    specs = dispatch_outputs(buffer, layout, rows, x.shape[0])
    token = torch.empty(4, dtype=torch.int64, device=_token_device(x.device))
    return [token] + [_empty(torch.float32, x.device) if s is None else x.new_empty(s[0], dtype=s[1]) for s in specs]


def _combine_fake(buffer_id, y, token, shared_out, weighted, tokens):
    return y.new_empty((tokens, registry.get(buffer_id).hidden), dtype=torch.bfloat16)


def _dispatch_backward_fake(buffer_id, grad_recv_x, grad_recv_weights, token, tokens):
    c = registry.get(buffer_id)
    weights = grad_recv_weights is not None
    gw = grad_recv_x.new_empty((tokens, c.topk), dtype=torch.float32) if weights \
        else _empty(torch.float32, grad_recv_x.device)
    # grad_shared_gate: [T] where the buffer has the shared expert and weights flow (empty if the
    # dispatch had no gate: the real kernel's form, which the fake cannot see in the handle)
    gs = grad_recv_x.new_empty((tokens,), dtype=torch.float32) if weights and c.shared_expert \
        else _empty(torch.float32, grad_recv_x.device)
    return [grad_recv_x.new_empty((tokens, c.hidden), dtype=torch.bfloat16), gw, gs]


def _combine_backward_fake(buffer_id, grad_out, y, token, weighted, rows):
    c = registry.get(buffer_id)
    gw = grad_out.new_empty((grad_out.shape[0], c.topk), dtype=torch.float32) if weighted \
        else _empty(torch.float32, grad_out.device)
    gs = grad_out.new_empty((grad_out.shape[0],), dtype=torch.float32) if weighted and c.shared_expert \
        else _empty(torch.float32, grad_out.device)
    return [grad_out.new_empty((rows, c.hidden), dtype=torch.bfloat16), gw, gs]


def _ll_dispatch_fake(buffer_id, x, topk_idx, num_tokens, topk_weights, nvfp4_global_scale, expert_replicas=None,
                      shared_gate=None):
    specs = ll_dispatch_outputs(registry.get(buffer_id), x.shape[0])
    token = torch.empty(4, dtype=torch.int64, device=_token_device(x.device))
    return [token] + [_empty(torch.float32, x.device) if s is None else x.new_empty(s[0], dtype=s[1]) for s in specs]


def _ll_combine_fake(buffer_id, y, token, topk_weights, weighted, tokens):
    return y.new_empty((tokens, registry.get(buffer_id).hidden), dtype=torch.bfloat16)


def _register(name, real, fake):
    for key in ("CPU", "CUDA"):
        _lib.impl(name, real, key)
    if hasattr(torch.library, "register_fake"):
        torch.library.register_fake("epx::" + name, fake, lib=_lib)
    elif hasattr(torch.library, "impl_abstract"):
        torch.library.impl_abstract("epx::" + name, fake, lib=_lib)
    else:  # no fake tensors: meta tensors, with or without autograd's key (torch < 2 has no fallthrough there)
        _lib.impl(name, fake, "Meta")
        _lib.impl(name, fake, "AutogradMeta")


_register("dispatch", _dispatch, _dispatch_fake)
_register("combine", _combine, _combine_fake)
_register("dispatch_backward", _dispatch_backward, _dispatch_backward_fake)
_register("combine_backward", _combine_backward, _combine_backward_fake)
_register("ll_dispatch", _ll_dispatch, _ll_dispatch_fake)
_register("ll_combine", _ll_combine, _ll_combine_fake)
