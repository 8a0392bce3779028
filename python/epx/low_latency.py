"""epx.LowLatencyBuffer: the low-latency mode for decode (docs/low-latency.md).

Shapes never change (receive buffers [L, R*M, H]), calls may be split into a send half and a
receive half with compute in between, and both forms can be captured in CUDA graphs. Calls run on
torch's current stream.

Lifetimes. Two buffer sets alternate: dispatch call n uses set n % 2. On the GPU, the tensors a
dispatch returns (recv_x, recv_scales, recv_count, recv_src, recv_layout, ...) are views of set
n % 2 and are overwritten when dispatch n + 2 starts; the same holds for combine outputs and
combine n + 2. They stay readable (the memory lives as long as they do) but hold the newer call's
rows. Use ``clone=True`` (or ``.clone()``) to keep them longer; ``is_current(output)`` says whether
an output still holds its own call's data. Combining a dispatch whose set was reused is refused on
every rank. (On the CPU backend outputs are fresh tensors; the rule is enforced the same way.)
"""

from typing import NamedTuple, Optional

import torch

from . import _C, registry
from .config import DType, WireFormat, code_of, names_of
from .errors import InvalidArgument
from .streams import current_stream_handle
from .tensors import arg, out, problem

_BF16, _F32, _I32 = (DType.bf16,), (DType.f32,), (DType.i32,)
_INDEX = (DType.i32, DType.i64)


class LowLatencyHandle(NamedTuple):
    """What ll dispatch call `call` learned; its combine takes it. ``token`` owns the C++ handle (its words:
    id, tokens, call; ``call`` is -1 in handles made under torch.compile, whose token still says it)."""

    token: torch.Tensor
    buffer_id: int
    call: int
    tokens: int
    weights_at_dispatch: bool


class LowLatencyDispatchOutput(NamedTuple):
    # With shared_expert every leading L is 1 + L, the shared expert first (docs/low-latency.md).
    recv_x: torch.Tensor  # [L, R*M, H] bf16 | fp8 codes | [L, R*M, H/2] uint8 (NVFP4)
    recv_scales: Optional[torch.Tensor]  # fp8: [L, R*M, H/128] f32; nvfp4: [L, R*M, H/16] fp8
    recv_global_scale: Optional[torch.Tensor]  # nvfp4: [L, R*M] f32
    recv_count: torch.Tensor  # [L] int32
    recv_src: torch.Tensor  # [L, R*M, 2] int32
    recv_layout: torch.Tensor  # [L, R, 2] int32
    handle: LowLatencyHandle
    topk_physical: Optional[torch.Tensor] = None  # EPLB: [T, K] int32 the physical expert of each slot (-1 unused)


class LowLatencyBuffer:
    """Collective to create (every rank, the same arguments, in the same order as other buffers)."""

    def __init__(self, group, hidden, max_tokens_per_rank, num_experts, topk, *, wire="bf16", timeout_ms=0,
                 check_finite=False, shared_expert=False, combine_wire="bf16", num_physical_experts=0,
                 max_replicas=0):
        wire_code, combine_code = code_of(WireFormat, wire), code_of(WireFormat, combine_wire)
        config = _C.LowLatencyConfig(hidden=hidden, max_tokens_per_rank=max_tokens_per_rank,
                                     num_experts=num_experts, topk=topk, wire=-1 if wire_code is None else wire_code,
                                     timeout_ms=timeout_ms, check_finite=check_finite, shared_expert=shared_expert,
                                     combine_wire=-1 if combine_code is None else combine_code,
                                     num_physical_experts=num_physical_experts, max_replicas=max_replicas)
        try:
            self._c = _C.LowLatencyBuffer(group._c, config)
        except InvalidArgument as e:
            if wire_code is None:
                raise InvalidArgument(f"low-latency buffer: wire: unknown {wire!r}; use one of "
                                      f"{names_of(WireFormat)}") from e
            if combine_code is None:
                raise InvalidArgument(f"low-latency buffer: combine_wire: unknown {combine_wire!r}; use bf16, fp8 "
                                      "or fp8_ue8m0") from e
            raise
        self.group = group
        self.device = group.device
        self.id = registry.add(self)
        self._config = self._c.config
        c = self._config  # plain Python copies, for what torch.compile traces (buffer.py)
        self.hidden, self.num_experts, self.topk, self.wire_code = c.hidden, c.num_experts, c.topk, c.wire
        self.max_tokens_per_rank, self.num_ranks = c.max_tokens_per_rank, group.size
        self.num_physical_experts = c.num_physical_experts or c.num_experts  # P (= E without EPLB)
        self.num_local_experts = self.num_physical_experts // group.size  # local physical experts
        self.eplb = c.num_physical_experts > 0
        self.shared_expert = c.shared_expert  # the outputs lead with the shared expert: [1 + L, ...]
        self._cuda = self.device.type == "cuda"
        self._stream = None
        self.dispatch_calls = 0  # calls started so far, of each kind
        self.combine_calls = 0
        # Each kind's send-half inputs, alive until its receive half (a dispatch may go out while a
        # combine is in flight, and the other way round).
        self._pending_dispatch_inputs = self._pending_combine_inputs = ()

    @property
    def config(self):
        return self._config

    def synchronize(self):
        self._c.synchronize()

    def close(self):
        self._c.close()

    # --- dispatch ------------------------------------------------------------------------------

    def dispatch(self, x, topk_idx, *, num_tokens=None, topk_weights=None, nvfp4_global_scale=0.0, clone=False,
                 expert_replicas=None, shared_gate=None):
        """x [T, H] bfloat16 (T <= max_tokens_per_rank), topk_idx [T, K]; num_tokens: optional [1] int32 on the
        device (rows that count; may change between graph replays); topk_weights: the combine's weights, sent now.
        expert_replicas: [E, M] int32, required with num_physical_experts > 0 (docs/semantics.md, EPLB).
        shared_gate: [T] float32 with shared_expert: each token's shared-row weight in a weighted combine
        (the outputs then lead with the shared expert: [1 + L, ...], docs/low-latency.md)."""
        call = self._start_dispatch()
        inputs = self._dispatch_inputs(x, topk_idx, num_tokens, topk_weights, expert_replicas, shared_gate)
        self._use_current_stream()
        result = self._c.dispatch(*inputs[:4], float(nvfp4_global_scale), *inputs[4:])
        return self._dispatch_output(result, call, topk_weights is not None, clone)

    def dispatch_send(self, x, topk_idx, *, num_tokens=None, topk_weights=None, nvfp4_global_scale=0.0,
                      expert_replicas=None, shared_gate=None):
        """The send half: returns at once. Its dispatch_recv must come before the next dispatch_send."""
        call = self._start_dispatch()
        inputs = self._dispatch_inputs(x, topk_idx, num_tokens, topk_weights, expert_replicas, shared_gate)
        self._use_current_stream()
        self._c.dispatch_send(*inputs[:4], float(nvfp4_global_scale), *inputs[4:])
        self._pending_dispatch = (call, topk_weights is not None)
        self._pending_dispatch_inputs = (x, topk_idx, num_tokens, topk_weights, expert_replicas, shared_gate)

    def dispatch_recv(self, clone=False):
        """The receive half: waits for every peer."""
        self._use_current_stream()
        result = self._c.dispatch_recv()
        call, weights_at_dispatch = self._pending_dispatch
        self._pending_dispatch_inputs = ()
        return self._dispatch_output(result, call, weights_at_dispatch, clone)

    # --- combine -------------------------------------------------------------------------------

    def combine(self, y, handle, *, topk_weights=None, weighted=True, clone=False):
        """y [L, R*M, H] bfloat16 ([1 + L, ...] with shared_expert; contiguous): the expert outputs in the
        dispatch's rows. Returns [T, H] bfloat16."""
        self.combine_calls += 1  # as epx counts them: a refused call uses its set too
        inputs = self._combine_inputs(y, handle, topk_weights)
        self._use_current_stream()
        result = out(self._c.combine(inputs[0], arg(handle.token), inputs[1], bool(weighted)))
        return result.clone() if clone else result

    def combine_send(self, y, handle, *, topk_weights=None, weighted=True):
        self.combine_calls += 1
        inputs = self._combine_inputs(y, handle, topk_weights)
        self._use_current_stream()
        self._c.combine_send(inputs[0], arg(handle.token), inputs[1], bool(weighted))
        self._pending_combine_inputs = (y, handle, topk_weights)

    def combine_recv(self, clone=False):
        self._use_current_stream()
        result = out(self._c.combine_recv())
        self._pending_combine_inputs = ()
        return result.clone() if clone else result

    def expert_load(self):
        """[L] int64: rows received per local (physical) expert over every dispatch since creation or the last
        reset_expert_load (recv_count summed). A view of the buffer's counters (CUDA: on the device, stream-ordered)."""
        return out(self._c.expert_load())

    def reset_expert_load(self):
        self._c.reset_expert_load()

    def reject(self, op, reason):
        """Joins this rank's next call `op` ("dispatch" or "combine", its send half) as a rank whose input is
        bad: raises InvalidArgument here, and every peer's same call fails with PeerFailed quoting `reason`
        (C++ LowLatencyBuffer::reject). The call uses its buffer set, as any call does."""
        if op == "dispatch":
            self._start_dispatch()
            self._c.reject_dispatch(reason)  # always raises
        elif op == "combine":
            self.combine_calls += 1
            self._c.reject_combine(reason)  # always raises
        else:
            raise InvalidArgument(f"reject: unknown op {op!r}; use 'dispatch' or 'combine'")

    # --- lifetimes -----------------------------------------------------------------------------

    def is_current(self, output):
        """Whether a dispatch output (or its handle) still holds its own call's data: no dispatch n + 2 yet."""
        handle = output.handle if isinstance(output, LowLatencyDispatchOutput) else output
        return self.dispatch_calls <= int(handle.token[2]) + 2  # the token's record (handle.call is -1 when traced)

    # --- helpers -------------------------------------------------------------------------------

    def _dispatch_inputs(self, x, topk_idx, num_tokens, topk_weights, expert_replicas, shared_gate):
        specs = (("ll_dispatch: x", x, _BF16), ("ll_dispatch: topk_idx", topk_idx, _INDEX),
                 ("ll_dispatch: num_tokens", num_tokens, _I32), ("ll_dispatch: topk_weights", topk_weights, _F32),
                 ("ll_dispatch: expert_replicas", expert_replicas, _I32), ("ll_dispatch: shared_gate", shared_gate, _F32))
        for what, t, allowed in specs:
            if t is not None:
                reason = problem(t, what, allowed, self.device)
                if reason is not None:
                    self._c.reject_dispatch(reason)
        return [arg(t) for _, t, _ in specs]

    def _combine_inputs(self, y, handle, topk_weights):
        reason = self._handle_problem(handle)
        for what, t, allowed in (("ll_combine: y", y, _BF16), ("ll_combine: topk_weights", topk_weights, _F32)):
            if reason is None and t is not None:
                reason = problem(t, what, allowed, self.device)
        if reason is not None:
            self._c.reject_combine(reason)
        return arg(y), arg(topk_weights)

    def _handle_problem(self, handle):
        if not isinstance(handle, LowLatencyHandle):
            return f"ll_combine: handle: expected the LowLatencyHandle a dispatch returned, got {type(handle).__name__}"
        if handle.buffer_id != self.id:
            return f"ll_combine: handle: made by another low-latency buffer (#{handle.buffer_id}, this is #{self.id})"
        call = int(handle.token[2])  # the token's own record (handle.call is -1 from a traced ll_dispatch)
        if self.dispatch_calls > call + 2:
            return (f"ll_combine: handle of dispatch #{call} is stale: dispatch #{call + 2} reused its "
                    "buffer set; combine each dispatch before the next-but-one dispatch starts")
        return None

    def _start_dispatch(self):
        """Counts the call as epx does (a refused call uses its buffer set too)."""
        call = self.dispatch_calls
        self.dispatch_calls += 1
        return call

    def _dispatch_output(self, result, call, weights_at_dispatch, clone):
        token, recv_x, recv_scales, recv_global_scale, recv_count, recv_src, recv_layout, topk_physical = result
        wire = self._config.wire
        token = out(token)
        token[2] = call  # the token's words: id, tokens, call (ops.py reads the call back)
        tensors = [out(recv_x, fp8=wire in (WireFormat.fp8, WireFormat.fp8_ue8m0)),
                   out(recv_scales, fp8=wire == WireFormat.nvfp4), out(recv_global_scale), out(recv_count),
                   out(recv_src), out(recv_layout), out(topk_physical)]
        if clone:
            tensors = [None if t is None else t.clone() for t in tensors]
        handle = LowLatencyHandle(token, self.id, call, int(token[1]), weights_at_dispatch)
        return LowLatencyDispatchOutput(*tensors[:6], handle, tensors[6])

    def _use_current_stream(self):
        if self._cuda:
            handle = current_stream_handle(self.device)
            if handle != self._stream:
                self._c.set_stream(handle)
                self._stream = handle

    def __repr__(self):
        return f"epx.LowLatencyBuffer(rank {self.group.rank} of {self.group.size}, {self._config!r})"
