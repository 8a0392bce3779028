"""epx.Buffer: the high-throughput dispatch and combine, and both backward passes.

Every call is collective: every rank of the group calls the same methods in the same order
(docs/semantics.md). A check of this layer that refuses an input joins the call as a rejection
(C++ ``Buffer::reject``), so the peers' same call fails at once with the reason instead of
waiting for this rank.
"""

import torch

from . import _C, registry
from .config import CapacityMode, DType, Layout, Op, WireFormat, code_of, names_of
from .errors import InvalidArgument
from .outputs import (CombineBackwardOutput, CombineOutput, DispatchBackwardOutput, DispatchOutput, Handle)
from .streams import NO_EVENT, CallStreams, current_stream_handle, handle_of, wait_for
from .tensors import arg, out, problem

BF16 = (DType.bf16,)
F32 = (DType.f32,)
X_TYPES = (DType.bf16, DType.fp8_e4m3)
INDEX_TYPES = (DType.i32, DType.i64)
INT32 = (DType.i32,)
BOOL = (DType.boolean,)


class Buffer:
    """The communication state of one MoE layer shape on one rank (C++ ``epx::Buffer``).

    Creating it is collective: every rank constructs one with the same arguments, in the same
    order. ``mode`` defaults to capacity mode when ``capacity_rows`` is given, else blocking.
    """

    def __init__(self, group, hidden, max_tokens_per_rank, num_experts, topk, *, wire="bf16",
                 expert_alignment=1, mode=None, capacity_rows=0, capacity_factor=0.0, timeout_ms=0,
                 num_sms=0, check_finite=False, send_blocks=0, shared_expert=False, combine_wire="bf16",
                 num_physical_experts=0, max_replicas=0):
        if mode is None:
            mode = CapacityMode.capacity if capacity_rows else CapacityMode.blocking
        wire_code, mode_code = code_of(WireFormat, wire), code_of(CapacityMode, mode)
        combine_code = code_of(WireFormat, combine_wire)
        config = _C.BufferConfig(
            hidden=hidden, max_tokens_per_rank=max_tokens_per_rank, num_experts=num_experts, topk=topk,
            wire=-1 if wire_code is None else wire_code, expert_alignment=expert_alignment,
            mode=-1 if mode_code is None else mode_code, capacity_rows=capacity_rows,
            capacity_factor=capacity_factor, timeout_ms=timeout_ms, num_sms=num_sms, check_finite=check_finite,
            send_blocks=send_blocks, shared_expert=shared_expert,
            combine_wire=-1 if combine_code is None else combine_code,
            num_physical_experts=num_physical_experts, max_replicas=max_replicas)
        try:
            self._c = _C.Buffer(group._c, config)  # an unknown code fails on every rank (epx refuses it)
        except InvalidArgument as e:
            if wire_code is None:
                raise InvalidArgument(f"buffer: wire: unknown {wire!r}; use one of {names_of(WireFormat)}") from e
            if mode_code is None:
                raise InvalidArgument(f"buffer: mode: unknown {mode!r}; use one of {names_of(CapacityMode)}") from e
            if combine_code is None:
                raise InvalidArgument(f"buffer: combine_wire: unknown {combine_wire!r}; use bf16, fp8 or fp8_ue8m0") from e
            raise
        self.group = group
        self.device = group.device
        self.id = registry.add(self)
        self._config = self._c.config
        # Plain Python copies of the configuration: torch.compile traces what reads them (epx.torch),
        # and does not trace into the compiled module's objects.
        c = self._config
        self.hidden, self.num_experts, self.topk, self.wire_code = c.hidden, c.num_experts, c.topk, c.wire
        self.capacity_rows = c.capacity_rows if c.mode == CapacityMode.capacity else 0
        # Redundant experts (EPLB): the ranks hold P physical experts; the local experts are physical ones.
        self.num_physical_experts = c.num_physical_experts or c.num_experts
        self.num_local_experts = self.num_physical_experts // group.size
        self.eplb = c.num_physical_experts > 0
        self.shared_expert = c.shared_expert
        self.num_ranks = group.size
        self._cuda = self.device.type == "cuda"
        self._stream = None  # the cudaStream_t the C++ buffer runs on (what we last set)
        self._comm_stream = None

    # --- configuration -------------------------------------------------------------------------

    @property
    def config(self):
        return self._config

    @property
    def rank(self):
        return self.group.rank

    @property
    def wire(self):
        return WireFormat(self._config.wire)

    @property
    def capacity_mode(self):
        return self._config.mode == CapacityMode.capacity

    @property
    def comm_stream(self):
        """The stream calls with previous_event / async_finish / allocate_on_comm_stream run on."""
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=self.device)
        return self._comm_stream

    def synchronize(self):
        """Waits until every call made so far on the buffer's stream is done (CUDA; the CPU returns at once)."""
        self._c.synchronize()

    def close(self):
        """Destroys the C++ buffer now, as the garbage collector would (collective on the shared GPU).

        Outputs stay valid; later calls raise."""
        self._c.close()

    def expert_load(self):
        """[L] int64: (token, slot) rows each local (physical) expert received over every dispatch since creation
        or the last reset_expert_load (after dropping; no padding, shared or cached-dispatch rows). A view of the
        buffer's counters: later dispatches show in it. Not collective. CUDA: on the device, stream-ordered."""
        return out(self._c.expert_load())

    def reset_expert_load(self):
        """Zeroes the load counters (not collective)."""
        self._c.reset_expert_load()

    def reject(self, op, reason):
        """Joins this rank's next call `op` as a rank whose input is bad: raises InvalidArgument here, and
        every peer's same call fails with PeerFailed quoting `reason` (C++ Buffer::reject)."""
        self._c.reject(int(Op[op] if isinstance(op, str) else op), reason)

    # --- the four calls ------------------------------------------------------------------------

    def dispatch(self, x, topk_idx=None, topk_weights=None, *, x_scales=None, routing_map=None, probs=None,
                 layout=None, nvfp4_global_scale=0.0, handle=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False, shared_gate=None, expert_replicas=None):
        """Sends each token to the ranks of its experts. Routing: topk_idx [T, K] (int32/int64, -1 unused)
        with optional topk_weights [T, K] float32, or routing_map [T, E] bool with optional probs [T, E].
        x: [T, H] bfloat16, or fp8 codes (float8_e4m3fn or uint8) with x_scales [T, H/128] (wire fp8).
        layout: expert_major (the default) or rank_major.
        With shared_expert=True (the buffer's): the output starts with this rank's own tokens as segment 0
        (expert_offsets [L+2], tokens_per_expert [L+1]), weighted by shared_gate [T] float32 if given.
        With num_physical_experts > 0 (EPLB): expert_replicas [E, M] int32, the physical experts serving each
        logical expert (-1 unused), read at this call; the output's topk_physical [T, K] says which one each
        slot went to (docs/semantics.md, "Redundant experts (EPLB)").

        With ``handle`` (a cached dispatch, DeepEP's dispatch with a handle): no routing; x of the same T
        goes out in the layout of the dispatch that made the handle, with no routing work and no plan
        exchange. Only recv_x / recv_scales / recv_global_scale are new; the layout fields are None
        (they are the handle's dispatch's) and ``handle`` is the one given."""
        if handle is not None:
            return self._cached_dispatch(x, x_scales, handle, layout, nvfp4_global_scale,
                                         (topk_idx, topk_weights, routing_map, probs, shared_gate, expert_replicas),
                                         (previous_event, async_finish, allocate_on_comm_stream))
        layout = Layout.expert_major if layout is None else layout
        layout_code = code_of(Layout, layout)
        if layout_code is None:
            self.reject(Op.dispatch, f"dispatch: layout: unknown {layout!r}; use one of {names_of(Layout)}")
        inputs = self._inputs(Op.dispatch, (("dispatch: x", x, X_TYPES), ("dispatch: x_scales", x_scales, F32),
                                            ("dispatch: topk_idx", topk_idx, INDEX_TYPES),
                                            ("dispatch: topk_weights", topk_weights, F32),
                                            ("dispatch: routing_map", routing_map, BOOL),
                                            ("dispatch: probs", probs, F32),
                                            ("dispatch: shared_gate", shared_gate, F32),
                                            ("dispatch: expert_replicas", expert_replicas, INT32)))
        streams = self._begin(Op.dispatch, previous_event, async_finish, allocate_on_comm_stream)
        result = self._c.dispatch(*inputs[:7], layout_code, float(nvfp4_global_scale), self._consumer(streams),
                                  inputs[7])
        event = self._finish(streams, (x, x_scales, topk_idx, topk_weights, routing_map, probs, shared_gate,
                                       expert_replicas))
        weights = topk_weights if routing_map is None else probs
        return self.dispatch_output(result, layout_code, x.shape[0], weights, routing_map, event)

    def _cached_dispatch(self, x, x_scales, handle, layout, nvfp4_global_scale, routing, stream_args):
        op = Op.cached_dispatch
        self._check_handle(op, handle, "dispatch")
        if any(t is not None for t in routing):
            self.reject(op, "dispatch: a handle and routing given; a cached dispatch takes the routing of the "
                            "handle's dispatch (its shared_gate and replica choice too): pass x (and x_scales) only")
        if layout is not None and code_of(Layout, layout) != handle.layout:
            self.reject(op, f"dispatch: layout {layout!r} given with a handle of a {Layout(handle.layout).name} "
                            "dispatch; a cached dispatch has its handle's layout (leave layout out)")
        inputs = self._inputs(op, (("dispatch: x", x, X_TYPES), ("dispatch: x_scales", x_scales, F32)))
        streams = self._begin(op, *stream_args)
        recv = self._c.cached_dispatch(*inputs, arg(handle.token), float(nvfp4_global_scale),
                                       self._consumer(streams))
        event = self._finish(streams, (x, x_scales))
        wire = self._config.wire
        recv_x, recv_scales, recv_global = recv
        return DispatchOutput(out(recv_x, fp8=wire in (WireFormat.fp8, WireFormat.fp8_ue8m0)),
                              out(recv_scales, fp8=wire == WireFormat.nvfp4), out(recv_global),
                              *([None] * 8), handle, event)

    def combine(self, y, handle, *, shared_out=None, weighted=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        """Brings expert outputs y [N, H] bfloat16 (the dispatch's rows) back: out [T, H] bfloat16, weighted
        by the router weights (expert-major, weights given) unless weighted=False; plus shared_out [T, H]."""
        self._check_handle(Op.combine, handle, "combine")
        weighted = handle.weighted if weighted is None else bool(weighted)
        inputs = self._inputs(Op.combine, (("combine: y", y, BF16), ("combine: shared_out", shared_out, BF16)))
        streams = self._begin(Op.combine, previous_event, async_finish, allocate_on_comm_stream)
        result, overflow = self._c.combine(inputs[0], arg(handle.token), inputs[1], weighted, self._consumer(streams))
        event = self._finish(streams, (y, shared_out))
        return CombineOutput(out(result), overflow, event)

    def dispatch_backward(self, grad_recv_x, handle, grad_recv_weights=None, *, previous_event=None,
                          async_finish=False, allocate_on_comm_stream=False):
        """grad_x [T, H] = the unweighted combine of grad_recv_x [N, H] bfloat16; with grad_recv_weights
        (expert-major [N], rank-major [N, K] float32) also grad_topk_weights [T, K]."""
        self._check_handle(Op.dispatch_backward, handle, "dispatch_backward")
        inputs = self._inputs(Op.dispatch_backward,
                              (("dispatch_backward: grad_recv_x", grad_recv_x, BF16),
                               ("dispatch_backward: grad_recv_weights", grad_recv_weights, F32)))
        streams = self._begin(Op.dispatch_backward, previous_event, async_finish, allocate_on_comm_stream)
        gx, gw, gs = self._c.dispatch_backward(inputs[0], inputs[1], arg(handle.token), self._consumer(streams))
        event = self._finish(streams, (grad_recv_x, grad_recv_weights))
        return DispatchBackwardOutput(out(gx), out(gw), event, out(gs))

    def combine_backward(self, grad_out, handle, y=None, *, weighted=None, previous_event=None, async_finish=False,
                         allocate_on_comm_stream=False):
        """grad_y [N, H] bfloat16 in the dispatch layout from grad_out [T, H]; weighted, also
        grad_topk_weights [T, K] = <grad_out[t], y[row]> (needs the combine's input y)."""
        self._check_handle(Op.combine_backward, handle, "combine_backward")
        weighted = handle.weighted if weighted is None else bool(weighted)
        inputs = self._inputs(Op.combine_backward, (("combine_backward: grad_out", grad_out, BF16),
                                                    ("combine_backward: y", y, BF16)))
        streams = self._begin(Op.combine_backward, previous_event, async_finish, allocate_on_comm_stream)
        gy, gw, gs = self._c.combine_backward(inputs[0], inputs[1], arg(handle.token), weighted,
                                              self._consumer(streams))
        event = self._finish(streams, (grad_out, y))
        return CombineBackwardOutput(out(gy), out(gw), event, out(gs))

    # --- shared by the calls (also used by epx.ops) ---------------------------------------------

    def dispatch_output(self, result, layout, tokens, weights, routing_map, event=NO_EVENT):
        token, recv_x, recv_scales, *rest = result
        wire = self._config.wire
        handle = Handle(out(token), self.id, layout, tokens,
                        layout == Layout.expert_major and weights is not None, weights, routing_map)
        *layout_fields, topk_physical = (out(c) for c in rest)
        return DispatchOutput(out(recv_x, fp8=wire in (WireFormat.fp8, WireFormat.fp8_ue8m0)),
                              out(recv_scales, fp8=wire == WireFormat.nvfp4), *layout_fields, handle, event,
                              topk_physical)

    def _inputs(self, op, specs):
        """The compiled module's arguments; the first tensor refused fails the call on every rank."""
        for what, t, allowed in specs:
            if t is not None:
                reason = problem(t, what, allowed, self.device)
                if reason is not None:
                    self.reject(op, reason)
        return [arg(t) for _, t, _ in specs]

    def _check_handle(self, op, handle, name):
        if not isinstance(handle, Handle):
            self.reject(op, f"{name}: handle: expected the Handle a dispatch of this buffer returned, "
                            f"got {type(handle).__name__}")
        if handle.buffer_id != self.id:
            self.reject(op, f"{name}: handle: made by another buffer (#{handle.buffer_id}, this is #{self.id})")

    def _begin(self, op, previous_event, async_finish, allocate_on_comm_stream):
        """Chooses and prepares the call's stream (streams.py); None on the CPU backend."""
        if not self._cuda:
            return None
        on_comm = async_finish or previous_event is not None or allocate_on_comm_stream
        if not on_comm:
            handle = current_stream_handle(self.device)
            self._use_stream(handle)
            return CallStreams(None, None, False, False, handle)
        current = torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            self.reject(op, f"{Op(op).name}: previous_event / async_finish / allocate_on_comm_stream are not "
                            "supported while a CUDA graph is being captured; capture with the defaults (the call "
                            "then runs on the capturing stream)")
        comm = self.comm_stream
        wait_for(comm, previous_event, current)
        self._use_stream(handle_of(comm))
        return CallStreams(comm, current, bool(async_finish), True)

    def _use_stream(self, handle):
        if handle != self._stream:
            self._c.set_stream(handle)  # orders the new stream after the previous one (an event, no host wait)
            self._stream = handle

    @staticmethod
    def _consumer(streams):
        return 0 if streams is None else streams.consumer_handle

    @staticmethod
    def _finish(streams, inputs):
        return NO_EVENT if streams is None else streams.finish(inputs)

    def __repr__(self):
        return f"epx.Buffer(rank {self.rank} of {self.num_ranks}, {self._config!r})"
