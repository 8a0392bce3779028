"""epx.torch: dispatch and combine as autograd functions over the torch.ops.epx operators.

    d = epx.torch.dispatch(buffer, x, topk_idx, topk_weights)
    y = experts(d.recv_x, d.expert_offsets)        # rows in d's layout
    out = epx.torch.combine(buffer, y, d.handle)   # weighted by topk_weights (expert-major)

Backward: dispatch's is ``dispatch_backward`` (grad_x = the unweighted combine of grad recv_x;
grad of topk_weights from grad recv_weights / recv_topk_weights), combine's is
``combine_backward`` (grad y in the dispatch layout; weighted, grad of topk_weights), both with the
saved handle. With routing_map / probs the weight gradients come back as [T, E] grads of probs.
recv_x carries a gradient only with wire bf16 (quantized codes are not differentiable). Every
rank runs the same backward calls in the same order, as in the forward.

Under torch.compile these trace without graph breaks (the ops have fake kernels; capacity mode
for static shapes). Under an active :class:`epx.LayoutRecorder` (epx.torch.checkpoint), a
recomputed dispatch is a cached dispatch with the recorded handle (replay.py).
"""

import functools as _functools

import torch as _torch
import torch.utils.checkpoint as _checkpoint

from . import registry
from . import replay as _replay
from .config import Layout
from .errors import InvalidArgument, Unsupported
from .low_latency import LowLatencyDispatchOutput, LowLatencyHandle
from .ops import dispatch_outputs, ll_dispatch_outputs, present
from .outputs import DispatchOutput, Handle

try:  # torch.compile traces these functions: what it must not see is skipped while it does
    from torch.compiler import is_compiling as _compiling
except ImportError:
    try:
        from torch._dynamo import is_compiling as _compiling
    except ImportError:
        def _compiling():
            return False

# Positions in the dispatch op's output list (the token first, then outputs.DISPATCH_TENSORS).
_RECV_X, _RECV_WEIGHTS, _RECV_TOPK_WEIGHTS = 1, 5, 7


def dispatch(buffer, x, topk_idx=None, topk_weights=None, *, x_scales=None, routing_map=None, probs=None,
             layout=Layout.expert_major, nvfp4_global_scale=0.0, expert_replicas=None, shared_gate=None):
    """Buffer.dispatch, differentiable in x (wire bf16), topk_weights, probs and shared_gate. Returns a
    DispatchOutput (its ``event`` is None: these run on torch's current stream). expert_replicas: the EPLB
    replica table [E, M] int32 (buffers with num_physical_experts > 0); not differentiable. shared_gate
    [T] float32 (buffers with shared_expert): the weight of each token's shared row, in recv_weights and
    in combine's weighted sum, with its gradient from either."""
    if isinstance(layout, str):
        if layout not in Layout.__members__:
            raise InvalidArgument(f"dispatch: layout: unknown {layout!r}; use {', '.join(Layout.__members__)}")
        layout = Layout.__members__[layout]
    layout = int(layout)
    recorder = None if _compiling() else _replay.active()
    if recorder is not None and shared_gate is not None:
        raise Unsupported("epx.torch.dispatch: layout replay of a dispatch with a shared_gate is not supported; "
                          "recompute without the recorder, or give the gate to the shared expert's output")
    if recorder is not None:  # a replayed dispatch keeps its recorded replica choice (the handle's)
        return recorder.dispatch(buffer, x, topk_idx, topk_weights, x_scales=x_scales, routing_map=routing_map,
                                 probs=probs, layout=layout, nvfp4_global_scale=nvfp4_global_scale,
                                 run=_functools.partial(_plain_dispatch, expert_replicas=expert_replicas),
                                 replay=_replay_dispatch)
    return _plain_dispatch(buffer, x, topk_idx, topk_weights, x_scales, routing_map, probs, layout,
                           nvfp4_global_scale, expert_replicas, shared_gate)


def _plain_dispatch(buffer, x, topk_idx, topk_weights, x_scales, routing_map, probs, layout, nvfp4_global_scale,
                    expert_replicas=None, shared_gate=None):
    outs = _Dispatch.apply(buffer.id, layout, float(nvfp4_global_scale), buffer.num_experts, x, x_scales,
                           topk_idx, topk_weights, routing_map, probs, expert_replicas, shared_gate)
    keep = present(dispatch_outputs(buffer, layout, 0))
    tensors = [t if real else None for t, real in zip(outs[1:], keep)]
    weights = topk_weights if routing_map is None else probs
    handle = Handle(outs[0], buffer.id, layout, x.shape[0], layout == Layout.expert_major and weights is not None,
                    weights, routing_map, shared_gate)
    return DispatchOutput(*tensors[:-1], handle, None, tensors[-1])


def _replay_dispatch(buffer, x, x_scales, weights, recorded, nvfp4_global_scale):
    """A recompute's dispatch (replay.py): x in the recorded dispatch's layout by a cached dispatch,
    the recorded layout tensors, and the router weight outputs new, so that gradients reach this
    recompute's x and weights (their values are the recorded ones: the handle's combine uses those)."""
    h = recorded.handle
    buffer = registry.get(h.buffer_id)  # the recorded dispatch's buffer (a pool may have made another since)
    weight_field = "recv_weights" if h.layout == Layout.expert_major else "recv_topk_weights"
    recv_x, recv_scales, recv_global, recv_w = _CachedDispatch.apply(
        buffer, h, float(nvfp4_global_scale), x, x_scales, weights, getattr(recorded, weight_field))
    handle = h._replace(weights=weights if h.weights is not None else None)
    return recorded._replace(recv_x=recv_x, recv_scales=recv_scales, recv_global_scale=recv_global,
                             handle=handle, **{weight_field: recv_w})


def combine(buffer, y, handle, *, shared_out=None, weighted=None):
    """Buffer.combine, differentiable in y, shared_out and the router weights the dispatch took. Returns out."""
    weighted = handle.weighted if weighted is None else bool(weighted)
    weights = handle.weights if weighted else None
    return _Combine.apply(buffer.id, weighted, handle.tokens, buffer.num_experts, handle.token, y, weights,
                          handle.routing_map if weighted else None, shared_out,
                          handle.shared_gate if weighted else None)


def ll_dispatch(buffer, x, topk_idx, *, num_tokens=None, topk_weights=None, nvfp4_global_scale=0.0,
                expert_replicas=None, shared_gate=None):
    """LowLatencyBuffer.dispatch through torch.ops.epx.ll_dispatch (no autograd: decode). Traces under
    torch.compile; the outputs are views of the buffer's receive set (low_latency.py, lifetimes)."""
    outs = _torch.ops.epx.ll_dispatch(buffer.id, x, topk_idx, num_tokens, topk_weights, float(nvfp4_global_scale),
                                      expert_replicas, shared_gate)
    keep = present(ll_dispatch_outputs(buffer))
    tensors = [t if real else None for t, real in zip(outs[1:], keep)]
    handle = LowLatencyHandle(outs[0], buffer.id, -1, x.shape[0], topk_weights is not None)
    return LowLatencyDispatchOutput(*tensors[:-1], handle, tensors[-1])


def ll_combine(buffer, y, handle, *, topk_weights=None, weighted=True):
    """LowLatencyBuffer.combine through torch.ops.epx.ll_combine."""
    return _torch.ops.epx.ll_combine(buffer.id, y, handle.token, topk_weights, bool(weighted), handle.tokens)


def checkpoint(function, *args, recorder=None, check=True, **kwargs):
    """torch.utils.checkpoint.checkpoint (reentrant) whose recompute replays each dispatch's layout.

    The forward records every epx.torch.dispatch of `function` (its routing and layout); the
    recompute in backward serves them back in order, so it returns the identical layout
    (replay.py). `recorder`: a LayoutRecorder to keep (its stats count the replays and misses)."""
    recorder = recorder if recorder is not None else _replay.LayoutRecorder(check=check)
    runs = [0]

    def run(*inner):
        mode = recorder.recording() if runs[0] == 0 else recorder.replaying()
        runs[0] += 1
        with mode:
            return function(*inner)

    return _checkpoint.checkpoint(run, *args, use_reentrant=True, **kwargs)


def _probs_grad(grad_slots, routing_map, num_experts):
    """Slot grads [T, K] back to [T, E]: slot k of a dense row is its k-th selected expert (ascending)."""
    tokens, k = grad_slots.shape
    ids = _torch.arange(num_experts, device=routing_map.device).expand(tokens, num_experts)
    ids = _torch.where(routing_map, ids, _torch.full_like(ids, num_experts))
    slots = _torch.sort(ids, dim=1).values[:, :k]
    used = slots < num_experts
    grad = _torch.zeros(tokens, num_experts + 1, dtype=grad_slots.dtype, device=grad_slots.device)
    grad.scatter_add_(1, _torch.where(used, slots, _torch.full_like(slots, num_experts)), grad_slots)
    return grad[:, :num_experts]


class _Dispatch(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer_id, layout, gscale, num_experts, x, x_scales, topk_idx, topk_weights, routing_map, probs,
                expert_replicas, shared_gate):
        outs = _torch.ops.epx.dispatch(buffer_id, x, x_scales, topk_idx, topk_weights, routing_map, probs, layout,
                                       gscale, expert_replicas, shared_gate)
        ctx.gate_given = shared_gate is not None
        ctx.buffer_id, ctx.layout, ctx.tokens, ctx.num_experts = buffer_id, layout, x.shape[0], num_experts
        ctx.x_grad = outs[_RECV_X].dtype == _torch.bfloat16
        ctx.weights_given = topk_weights is not None or probs is not None
        ctx.save_for_backward(outs[0], routing_map)
        weight_out = _RECV_WEIGHTS if layout == Layout.expert_major else _RECV_TOPK_WEIGHTS
        differentiable = {weight_out} | ({_RECV_X} if ctx.x_grad else set())
        ctx.mark_non_differentiable(*(t for i, t in enumerate(outs) if i not in differentiable))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        token, routing_map = ctx.saved_tensors
        grad_recv_x = grads[_RECV_X]
        if not ctx.x_grad:  # quantized recv_x: only the weights' gradient flows; x gets none
            grad_recv_x = _torch.zeros(grad_recv_x.shape, dtype=_torch.bfloat16, device=grad_recv_x.device)
        weight_out = _RECV_WEIGHTS if ctx.layout == Layout.expert_major else _RECV_TOPK_WEIGHTS
        grad_recv_weights = grads[weight_out].contiguous() if ctx.weights_given else None
        grad_x, grad_slots, grad_gate = _torch.ops.epx.dispatch_backward(ctx.buffer_id, grad_recv_x.contiguous(),
                                                                         grad_recv_weights, token, ctx.tokens)
        grad_topk_weights = grad_probs = None
        if ctx.weights_given and routing_map is None:
            grad_topk_weights = grad_slots
        elif ctx.weights_given:
            grad_probs = _probs_grad(grad_slots, routing_map, ctx.num_experts)
        return (None, None, None, None, grad_x if ctx.x_grad else None, None, None, grad_topk_weights, None,
                grad_probs, None, grad_gate if ctx.gate_given and ctx.weights_given else None)


class _CachedDispatch(_torch.autograd.Function):
    """Buffer.dispatch with a handle; backward as a dispatch's (dispatch_backward with the handle)."""

    @staticmethod
    def forward(ctx, buffer, handle, gscale, x, x_scales, weights, recorded_weights):
        d = buffer.dispatch(x, x_scales=x_scales, handle=handle, nvfp4_global_scale=gscale)
        ctx.buffer_id, ctx.token, ctx.tokens, ctx.num_experts = buffer.id, handle.token, x.shape[0], buffer.num_experts
        ctx.routing_map = handle.routing_map
        ctx.x_grad = d.recv_x.dtype == _torch.bfloat16
        ctx.weights_given = weights is not None
        recv_w = None if recorded_weights is None else recorded_weights.clone()
        ctx.mark_non_differentiable(*(t for t in (d.recv_scales, d.recv_global_scale) if t is not None))
        if not ctx.x_grad:
            ctx.mark_non_differentiable(d.recv_x)
        return d.recv_x, d.recv_scales, d.recv_global_scale, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, _scales, _global, grad_recv_w):
        if not ctx.x_grad:  # quantized recv_x: only the weights' gradient flows, as in _Dispatch
            grad_recv_x = _torch.zeros(grad_recv_x.shape, dtype=_torch.bfloat16, device=grad_recv_x.device)
        grad_x, grad_slots, _ = _torch.ops.epx.dispatch_backward(
            ctx.buffer_id, grad_recv_x.contiguous(), grad_recv_w.contiguous() if ctx.weights_given else None,
            ctx.token, ctx.tokens)
        grad_weights = None
        if ctx.weights_given:
            grad_weights = grad_slots if ctx.routing_map is None else _probs_grad(grad_slots, ctx.routing_map,
                                                                                 ctx.num_experts)
        return None, None, None, grad_x if ctx.x_grad else None, None, grad_weights, None


class _Combine(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer_id, weighted, tokens, num_experts, token, y, weights, routing_map, shared_out,
                shared_gate):
        # shared_gate is the dispatch's (the C++ handle weighs by it): an input here for its gradient
        out = _torch.ops.epx.combine(buffer_id, y, token, shared_out, weighted, tokens)
        ctx.buffer_id, ctx.weighted, ctx.rows, ctx.num_experts = buffer_id, weighted, y.shape[0], num_experts
        ctx.has_shared = shared_out is not None
        ctx.save_for_backward(token, y if weighted else None, routing_map)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        token, y, routing_map = ctx.saved_tensors
        grad_y, grad_slots, grad_gate = _torch.ops.epx.combine_backward(ctx.buffer_id, grad_out.contiguous(), y,
                                                                        token, ctx.weighted, ctx.rows)
        grad_weights = None
        if ctx.weighted and ctx.needs_input_grad[6]:
            grad_weights = grad_slots if routing_map is None else _probs_grad(grad_slots, routing_map,
                                                                              ctx.num_experts)
        grad_gate = grad_gate if ctx.weighted and ctx.needs_input_grad[9] else None
        return (None, None, None, None, None, grad_y, grad_weights, None, grad_out if ctx.has_shared else None,
                grad_gate)


def __getattr__(name):
    """epx.torch.TokenDispatcher and its DispatcherConfig, from epx.dispatcher (which builds on this module)."""
    if name in ("TokenDispatcher", "DispatcherConfig"):
        from . import dispatcher

        return getattr(dispatcher, name)
    raise AttributeError(f"module 'epx.torch' has no attribute {name!r}")
