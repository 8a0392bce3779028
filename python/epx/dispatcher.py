"""A MoE token dispatcher with the interface NeMo / Megatron MoE layers call, over epx.

    dispatcher = TokenDispatcher(group, local_expert_indices, DispatcherConfig(num_experts=64, topk=6))
    permuted, tokens_per_expert, permuted_probs = dispatcher.token_permutation(x, routing_map, probs)
    y = experts(permuted, tokens_per_expert) * permuted_probs.unsqueeze(-1)   # the experts weigh
    out = dispatcher.token_unpermutation(y)                                    # [T, H], unweighted sum

The forward goes through epx.torch.dispatch / combine (autograd functions), so backward works
through every step: the gradient of x is the combine of the gradient of the permuted rows, the
gradient of the probs comes back from the gradient of permuted_probs (dispatch_backward), and the
combine's backward is a dispatch reusing the handle.

Buffers live in a :class:`BufferPool`, shared by every dispatcher (every layer) of one EP group:
each is created once per hidden size and reused. Creating a buffer is collective, so every rank must
run the same dispatches in the same order (as epx requires of every call anyway).

Capacity mode (``static_capacity=True``): the first ``calibration_dispatches`` dispatches run in
blocking mode and measure the rows each rank receives; the ranks then agree on the largest
(``Group.agree_max``), and later dispatches run on a capacity-mode buffer of
``ceil(largest * capacity_headroom)`` rows (no host sync, static shapes). A dispatch that needs more
rows than that is never silently truncated: see ``on_overflow`` and :class:`CapacityOverflow`.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import registry, replay
from . import torch as epx_torch
from .buffer import Buffer
from .config import Layout, Op
from .errors import InvalidArgument
from .group import Group
from .streams import NO_EVENT, EventOverlap, event_of, on_side_stream


class CapacityOverflow(RuntimeError):
    """A capacity-mode dispatch received more rows than the calibrated capacity on some rank.

    Raised on every rank alike (the ranks agree on it). Rows past the capacity were not received and
    contributed nothing, so the step's results are incomplete: skip it. The pool recalibrates at its
    next dispatch (a blocking one), sized for at least the rows that were needed.
    """

    def __init__(self, ranks, rows_needed, capacity_rows):
        self.ranks, self.rows_needed, self.capacity_rows = ranks, rows_needed, capacity_rows
        super().__init__(f"epx dispatcher: capacity overflow on rank(s) {ranks}: up to {rows_needed} rows were "
                         f"needed, the capacity is {capacity_rows}; those rows were dropped from this step, and "
                         "the next dispatch recalibrates")


@dataclass
class DispatcherConfig:
    """What of a MoE layer's configuration applies to epx (Megatron's names in brackets)."""

    num_experts: int  # [num_moe_experts] over the whole EP group
    topk: int  # [moe_router_topk] most experts per token
    max_tokens_per_rank: int = 0  # 0: the largest token count of the first dispatch, agreed over ranks
    capacity_factor: Optional[float] = None  # epx's drop rule (docs/semantics.md); None or 0: no dropping
    pad_multiple: int = 1  # each expert's rows padded to a multiple (grouped GEMM, fp8/fp4 alignment)
    fused_permute: bool = True  # [moe_permute_fusion] epx's expert-major rows; False: rank-major + torch
    num_sms: int = 0  # [moe_deepep_num_sms / moe_hybridep_num_sms] SM budget of the CUDA kernels, 0 = all
    async_dispatch: bool = False  # every call on the buffer's communication stream (async_finish works)
    router_dtype: str = "fp32"  # [moe_router_dtype] dtype of permuted_probs: fp32 or fp64
    static_capacity: bool = False  # calibrate, then capacity mode (static shapes, no host sync)
    calibration_dispatches: int = 1  # blocking dispatches measured before capacity mode (e.g. one per layer)
    capacity_headroom: float = 1.25  # capacity rows = ceil(largest measured rows * this)
    on_overflow: str = "raise"  # "raise" (agreed each dispatch) or "count" (read with check_overflow())
    tokens_per_expert_on_host: bool = False  # tokens_per_expert as a CPU tensor (as DeepEP's manager gives)
    timeout_ms: int = 0  # epx's timeout; 0: EPX_TIMEOUT_MS, else 60 s

    def validate(self):
        if self.router_dtype not in ("fp32", "fp64"):
            raise InvalidArgument(f"dispatcher: router_dtype: {self.router_dtype!r}; use fp32 or fp64")
        if self.on_overflow not in ("raise", "count"):
            raise InvalidArgument(f"dispatcher: on_overflow: {self.on_overflow!r}; use raise or count")
        if self.pad_multiple < 1 or self.calibration_dispatches < 1 or self.capacity_headroom < 1.0:
            raise InvalidArgument("dispatcher: pad_multiple and calibration_dispatches must be >= 1, "
                                  "capacity_headroom >= 1.0")


def as_epx_group(group):
    """An epx.Group as it is, or a torch.distributed process group turned into one (collective)."""
    return group if isinstance(group, Group) else Group.from_torch(group)


# --- buffers: created once per shape, shared by every layer ------------------------------------

class _Calibration:
    """Capacity-mode state of one hidden size: rows measured so far and the buffer sized from them."""

    def __init__(self, dispatches):
        self.left = dispatches  # blocking dispatches still to measure
        self.largest = 0  # largest rows this rank received while measuring
        self.buffer = None  # the capacity-mode buffer, once calibrated


class BufferPool:
    """The epx Buffers of one EP group: one blocking buffer per hidden size, and in capacity mode one
    capacity buffer per hidden size once calibrated. Every rank must create the same pool and make the
    same dispatches in the same order: buffers are created collectively at the first dispatch that needs
    them."""

    def __init__(self, group, config):
        config.validate()
        self.group, self.config = as_epx_group(group), config
        self.max_tokens_per_rank = config.max_tokens_per_rank
        self._blocking = {}  # hidden -> Buffer
        self._calibrations = {}  # hidden -> _Calibration
        self._overflow_count = None  # "count" mode: overflowed dispatches of this rank (device tensor)
        self._overflow_needed = None  # and the most rows one of them needed
        self._overflow_capacity = 0

    @property
    def device(self):
        return self.group.device

    def buffer_for(self, hidden, tokens):
        """(the buffer the next dispatch runs on, whether it is a calibration dispatch). Collective."""
        if not self.max_tokens_per_rank:  # the first dispatch fixes it, the same on every rank
            self.max_tokens_per_rank = self.group.agree_max(tokens, self.config.timeout_ms)
        if not self.config.static_capacity:
            return self._blocking_buffer(hidden), False
        calibration = self._calibrations.setdefault(hidden, _Calibration(self.config.calibration_dispatches))
        if calibration.left > 0:
            return self._blocking_buffer(hidden), True
        return calibration.buffer, False

    def after_dispatch(self, hidden, output, calibrating):
        """Measures a calibration dispatch, or checks a capacity-mode one for overflow (on_overflow)."""
        if calibrating:
            self._measure(hidden, output.handle.num_rows)
        elif self.config.static_capacity:
            self._watch_overflow(hidden, output.recv_info)

    def check_overflow(self):
        """on_overflow="count": raises CapacityOverflow on every rank if any rank's dispatch overflowed since
        the last check, and recalibrates at the next dispatch. Collective (a host sync on the GPU)."""
        if self._overflow_count is None:
            count, needed = 0, 0
        else:
            if self._overflow_count.is_cuda:  # the counts grow on the calls' stream (the comm stream when async)
                torch.cuda.synchronize(self._overflow_count.device)
            count, needed = int(self._overflow_count), int(self._overflow_needed)
            self._overflow_count.zero_()
            self._overflow_needed.zero_()
        self._agree_on_overflow(count > 0, needed, self._overflow_capacity)

    def close(self):
        """Destroys every buffer now (collective on the shared GPU); outputs held stay valid."""
        for b in self._blocking.values():
            b.close()
        for c in self._calibrations.values():
            if c.buffer is not None:
                c.buffer.close()

    # --- internals ----------------------------------------------------------------------------

    def _new_buffer(self, hidden, capacity_rows=0):
        c = self.config
        return Buffer(self.group, hidden, self.max_tokens_per_rank, c.num_experts, c.topk,
                      expert_alignment=c.pad_multiple, capacity_rows=capacity_rows,
                      capacity_factor=float(c.capacity_factor or 0.0), timeout_ms=c.timeout_ms, num_sms=c.num_sms)

    def _blocking_buffer(self, hidden):
        if hidden not in self._blocking:
            self._blocking[hidden] = self._new_buffer(hidden)
        return self._blocking[hidden]

    def _measure(self, hidden, rows):
        calibration = self._calibrations[hidden]
        calibration.largest = max(calibration.largest, rows)
        calibration.left -= 1
        if calibration.left == 0:  # every rank gets here at the same dispatch: agree, then create together
            largest = self.group.agree_max(calibration.largest, self.config.timeout_ms)
            rows = self._round_up(max(1, math.ceil(largest * self.config.capacity_headroom)))
            if calibration.buffer is not None:
                calibration.buffer.close()
            calibration.buffer = self._new_buffer(hidden, capacity_rows=rows)

    def _round_up(self, rows):
        m = self.config.pad_multiple
        return (rows + m - 1) // m * m

    def _watch_overflow(self, hidden, recv_info):
        """recv_info = (rows received, num_rows, rows allocated, overflow), on the buffer's device."""
        capacity = self._calibrations[hidden].buffer.capacity_rows
        if self.config.on_overflow == "count":  # device-side bookkeeping: no host sync here
            if self._overflow_count is None:
                self._overflow_count = torch.zeros((), dtype=torch.int64, device=recv_info.device)
                self._overflow_needed = torch.zeros((), dtype=torch.int64, device=recv_info.device)
            self._overflow_count += recv_info[3]
            torch.maximum(self._overflow_needed, recv_info[1] * recv_info[3], out=self._overflow_needed)
            self._overflow_capacity = capacity
            return
        info = recv_info.tolist()
        self._agree_on_overflow(bool(info[3]), int(info[1]), capacity)

    def _agree_on_overflow(self, overflowed, needed, capacity):
        records = self.group.all_gather_object((overflowed, needed), self.config.timeout_ms)
        ranks = [r for r, (flag, _) in enumerate(records) if flag]
        if not ranks:
            return
        most = max(n for flag, n in records if flag)
        for calibration in self._calibrations.values():  # recalibrate: the next dispatch measures again
            calibration.left = self.config.calibration_dispatches
            calibration.largest = max(calibration.largest, most)
        raise CapacityOverflow(ranks, most, capacity)


# --- the dispatcher ------------------------------------------------------------------------------

@dataclass
class _Routing:
    """What dispatch_preprocess took, for the dispatch_all_to_all that follows: the compact routing
    (topk_idx, topk_weights) or the dense one (routing_map, probs), and what was wrong with it (refused
    at the dispatch, where every rank takes part)."""

    topk_idx: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    routing_map: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None
    problem: Optional[str] = None

    @property
    def weights(self):
        """The probs that travel with the tokens: [T, K] compact, [T, E] dense (what preprocess returned)."""
        return self.probs if self.routing_map is not None else self.topk_weights

    def with_weights(self, weights):
        if self.routing_map is not None:
            self.probs = weights
        else:
            self.topk_weights = weights


@dataclass
class _Pending:
    """One dispatch between its forward dispatch and its forward combine."""

    buffer: object
    output: object  # the DispatchOutput
    hidden_shape: torch.Size
    dtype: torch.dtype
    event: EventOverlap = NO_EVENT
    rows: Optional[torch.Tensor] = None  # rank-major path: the received row of each permuted row
    positions: Optional[torch.Tensor] = None  # and its position among the permuted rows
    combine_event: EventOverlap = NO_EVENT


class TokenDispatcher:
    """Megatron / NeMo's flex-dispatcher interface over epx (module docstring).

    group: an epx.Group or a torch.distributed process group (the EP group). local_expert_indices: the
    experts of this rank, which must be epx's contiguous block rank*L .. rank*L + L - 1. pool: a BufferPool
    to share with other dispatchers (other layers); default: a pool of this dispatcher's own. One
    dispatcher may serve every layer, one forward dispatch at a time (its combine comes before the next
    layer's dispatch); backward needs nothing of it.
    """

    def __init__(self, group, local_expert_indices, config, pool=None):
        self.config = config
        self.pool = pool if pool is not None else BufferPool(group, config)
        self.group = self.pool.group
        self.num_local_experts = config.num_experts // self.group.size
        first = self.group.rank * self.num_local_experts
        if list(local_expert_indices) != list(range(first, first + self.num_local_experts)):
            raise InvalidArgument(f"dispatcher: local_expert_indices {list(local_expert_indices)}: epx puts experts "
                                  f"{first}..{first + self.num_local_experts - 1} on rank {self.group.rank}")
        self.local_expert_indices = list(local_expert_indices)
        self._routing = None  # the _Routing dispatch_preprocess took
        self._pending = None

    # --- whole calls ----------------------------------------------------------------------------

    def token_permutation(self, hidden_states, routing_map, probs):
        """hidden_states [..., H], routing_map [T, E] bool, probs [T, E] -> (permuted_hidden [N, H],
        tokens_per_expert [L] (rows of each expert's segment, padding included), permuted_probs [N]).
        NeMo's form ``token_permutation(hidden_states, num_local_tokens, probs)`` takes the token count
        (an int, or None) in routing_map's place: dispatch_preprocess."""
        hidden, _ = self.dispatch_preprocess(hidden_states, routing_map, probs)
        hidden, probs = self.dispatch_all_to_all(hidden, async_finish=False)
        return self.dispatch_postprocess(hidden, probs)

    def token_permutation2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """The compact form: token_indices [T, K] (-1 unused) and token_probs [T, K] (NeMo's argument order)."""
        hidden, _ = self.dispatch_preprocess2(hidden_states, num_local_tokens, token_probs, token_indices)
        hidden, probs = self.dispatch_all_to_all(hidden, async_finish=False)
        return self.dispatch_postprocess(hidden, probs)

    def token_permutation_topk(self, hidden_states, token_indices, token_probs):
        """token_permutation2 without the token count."""
        return self.token_permutation2(hidden_states, None, token_probs, token_indices)

    def token_unpermutation(self, hidden_states):
        """Expert outputs [N, H] in the permuted rows (already weighted by permuted_probs) -> [..., H]."""
        hidden = self.combine_preprocess(hidden_states)
        hidden = self.combine_all_to_all(hidden, async_finish=False)
        return self.combine_postprocess(hidden)

    # --- the split, for overlapping ---------------------------------------------------------------

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Flattens hidden_states and takes the routing: routing_map [T, E] (or [T, ranks, L]) bool and probs
        of the same shape. Returns (hidden [T, H], probs [T, E] float32). Or NeMo's form: routing_map is the
        local token count (an int, or None) and probs [T, E] is zero outside each token's experts; the
        experts are then probs' top-k, a zero probability an unused slot, as Megatron's managers read them
        (returns (hidden, the top-k probs [T, K] float32))."""
        if routing_map is None or isinstance(routing_map, int):
            return self._preprocess_top_k(hidden_states, routing_map, probs)
        tokens = routing_map.shape[0]
        routing_map = routing_map.reshape(tokens, self.config.num_experts).bool()
        probs = probs.reshape(tokens, self.config.num_experts).float()
        self._routing = _Routing(routing_map=routing_map, probs=probs)
        return self._flatten(hidden_states), probs

    def _preprocess_top_k(self, hidden_states, num_local_tokens, probs):
        tokens = probs.numel() // self.config.num_experts
        token_probs, token_indices = torch.topk(probs.reshape(tokens, self.config.num_experts).float(),
                                                self.config.topk, dim=-1)
        return self.dispatch_preprocess2(hidden_states, num_local_tokens, token_probs,
                                         token_indices.masked_fill(token_probs == 0, -1))

    def dispatch_preprocess2(self, hidden_states, num_local_tokens, token_probs, token_indices):
        """The compact routing: token_indices [T, K] (-1 unused), token_probs [T, K]. num_local_tokens (NeMo's
        signature; None: not checked) must be T, as in the dense form; a wrong one fails the dispatch that
        follows on every rank (preprocess is this rank's alone)."""
        self._routing = _Routing(topk_idx=token_indices, topk_weights=token_probs.float())
        tokens = token_indices.shape[0]
        if num_local_tokens is not None and num_local_tokens != tokens:
            self._routing.problem = (f"dispatcher: num_local_tokens={num_local_tokens}, but the routing holds "
                                     f"{tokens} tokens")
        return self._flatten(hidden_states), self._routing.topk_weights

    def dispatch_all_to_all(self, hidden_states, probs=None, async_finish=None, allocate_on_comm_stream=None,
                            previous_event=None):
        """The dispatch itself (collective). Returns (received rows, their probs): expert-major rows and
        [N] probs with fused_permute, else rank-major rows and [M, K] probs.

        probs: the probs that travel with the tokens, of the shape dispatch_preprocess returned ([T, E]
        dense, [T, K] compact); None: those preprocess returned. (Megatron's flex dispatcher passes back
        what preprocess returned; its alltoall dispatcher sends the probs it is given: both hold here.)

        With async_dispatch the call runs on the buffer's communication stream after previous_event (else
        after the current stream); async_finish (default: async_dispatch) returns before it is done, and
        dispatch_postprocess waits (self.dispatch_event). Without async_dispatch the call runs on torch's
        current stream, which first waits for previous_event; async_finish=True is refused there (there is
        no other stream to finish on). allocate_on_comm_stream is accepted for Megatron's signature: epx's
        outputs always come from the stream the call ran on.

        A bad probs, async_finish or num_local_tokens fails this call on every rank."""
        if self._routing is None:
            raise InvalidArgument("dispatcher: dispatch_all_to_all before dispatch_preprocess")
        routing, self._routing = self._routing, None
        hidden, tokens = hidden_states.shape[1], hidden_states.shape[0]
        buffer, calibrating = self.pool.buffer_for(hidden, tokens)
        problem = routing.problem or self._probs_problem(routing, probs) or self._async_problem(
            "dispatch_all_to_all", async_finish)
        if problem is not None:
            buffer.reject(Op.dispatch, problem)  # the peers' dispatch fails too, quoting it
        if probs is not None:
            routing.with_weights(probs.reshape(routing.weights.shape).float())
        topk_idx, topk_weights, routing_map, probs_dense = (routing.topk_idx, routing.topk_weights,
                                                            routing.routing_map, routing.probs)
        layout = Layout.expert_major if self.config.fused_permute else Layout.rank_major

        def run():  # on the stream the call runs on: the cast too, after previous_event
            x = hidden_states if hidden_states.dtype == torch.bfloat16 else hidden_states.bfloat16()
            return epx_torch.dispatch(buffer, x, topk_idx, topk_weights, routing_map=routing_map,
                                      probs=probs_dense, layout=layout)

        output, event = self._on_stream(buffer, run, async_finish, previous_event,
                                        (hidden_states, topk_idx, topk_weights, routing_map, probs_dense))
        # A recompute (epx.torch.checkpoint) replays the recorded dispatch on the buffer that made it.
        self._pending = _Pending(registry.get(output.handle.buffer_id), output, self._shape, hidden_states.dtype,
                                 event)
        if not replay.replaying():  # a recompute measures and watches nothing twice
            with self._on_call_stream(buffer):  # recv_info is written on the stream the call ran on
                self.pool.after_dispatch(hidden, output, calibrating)
        probs_out = output.recv_weights if self.config.fused_permute else output.recv_topk_weights
        return output.recv_x, probs_out

    @property
    def dispatch_event(self):
        """The EventOverlap of the last dispatch_all_to_all (nothing to wait for unless it was async)."""
        return NO_EVENT if self._pending is None else self._pending.event

    def dispatch_postprocess(self, hidden_states, probs=None):
        """Waits for the dispatch, then (permuted_hidden [N, H], tokens_per_expert [L], permuted_probs [N])
        in expert-major order: each local expert's rows in (source rank, source token) order, then zero
        rows (probability 0) up to a multiple of pad_multiple."""
        pending = self._require_pending("dispatch_postprocess")
        pending.event.current_stream_wait()
        output = pending.output
        if self.config.fused_permute:
            permuted, permuted_probs = hidden_states, output.recv_weights if probs is None else probs
            counts = self._segment_rows(output, hidden_states.shape[0])
        else:
            permuted, permuted_probs, counts = self._permute_rank_major(pending, hidden_states, probs)
        if self.config.router_dtype == "fp64":
            permuted_probs = permuted_probs.double()
        if self.config.tokens_per_expert_on_host:
            counts = counts.cpu()
        return permuted, counts, permuted_probs

    def combine_preprocess(self, hidden_states):
        """Expert outputs [N, H] in the permuted rows -> the rows combine takes (bf16): as they are with
        fused_permute, else each received token's sum over its local experts (in fp32, rounded once)."""
        pending = self._require_pending("combine_preprocess")
        if self.config.fused_permute:
            return hidden_states.bfloat16()
        partial = torch.zeros(pending.output.recv_x.shape[0], hidden_states.shape[1], dtype=torch.float32,
                              device=hidden_states.device)
        rows_out = hidden_states.index_select(0, pending.positions).float()
        return partial.index_add(0, pending.rows, rows_out).bfloat16()

    def combine_all_to_all(self, hidden_states, async_finish=None, allocate_on_comm_stream=None,
                           previous_event=None):
        """The combine (collective, unweighted: the experts applied the probs). Returns [T, H] bf16; async as
        dispatch_all_to_all (combine_postprocess waits, self.combine_event)."""
        pending = self._require_pending("combine_all_to_all")
        problem = self._async_problem("combine_all_to_all", async_finish)
        if problem is not None:
            pending.buffer.reject(Op.combine, problem)  # the peers' combine fails too; the dispatch stays pending

        def run():
            return epx_torch.combine(pending.buffer, hidden_states, pending.output.handle, weighted=False)

        out, pending.combine_event = self._on_stream(pending.buffer, run, async_finish, previous_event,
                                                     (hidden_states,))
        return out

    @property
    def combine_event(self):
        return NO_EVENT if self._pending is None else self._pending.combine_event

    def combine_postprocess(self, hidden_states):
        """Waits for the combine; [T, H] -> the input's shape and dtype. Ends this dispatch."""
        pending = self._require_pending("combine_postprocess")
        pending.combine_event.current_stream_wait()
        self._pending = None
        return hidden_states.view(pending.hidden_shape).to(pending.dtype)

    # --- what the last dispatch learned ----------------------------------------------------------

    @property
    def last_dispatch(self):
        """The epx DispatchOutput of the dispatch in flight (handle, offsets, unpadded counts, recv_info)."""
        return None if self._pending is None else self._pending.output

    def check_overflow(self):
        """BufferPool.check_overflow (on_overflow="count"); collective."""
        self.pool.check_overflow()

    # --- internals ----------------------------------------------------------------------------

    def _flatten(self, hidden_states):
        self._shape = hidden_states.shape
        return hidden_states.reshape(-1, hidden_states.shape[-1])

    def _require_pending(self, step):
        if self._pending is None:
            raise InvalidArgument(f"dispatcher: {step} without a dispatch in flight")
        return self._pending

    def _segment_rows(self, output, rows):
        """Rows of each local expert's segment of the permuted rows (padding included, sum = rows): from
        expert_offsets, clipped to the rows there are; in capacity mode the empty tail goes to the last
        expert, so a grouped GEMM over the segments covers every row (all on the device)."""
        offsets = output.expert_offsets.clamp(max=rows)
        counts = offsets[1:] - offsets[:-1]
        tail = rows - offsets[-1]
        return torch.cat([counts[:-1], counts[-1:] + tail])

    def _permute_rank_major(self, pending, recv_x, recv_probs):
        """The torch permute step: rank-major rows [M, H] with recv_topk_idx [M, K] -> expert-major rows, in
        the same order and padding as epx's expert-major layout. Keeps the row of each permuted row for
        the combine (an index_add). Data-dependent sizes: a host sync on the GPU."""
        idx = pending.output.recv_topk_idx.long()
        weights = pending.output.recv_topk_weights if recv_probs is None else recv_probs
        slots_per_row = idx.shape[1]
        flat = idx.reshape(-1)
        pairs = torch.nonzero(flat >= 0).flatten()  # (row, slot) pairs in row order
        experts = flat[pairs]
        order = torch.sort(experts * flat.numel() + pairs).indices  # by expert, then row
        pairs, experts = pairs[order], experts[order]
        rows, slots = pairs // slots_per_row, pairs % slots_per_row
        counts = torch.bincount(experts, minlength=self.num_local_experts)
        m = self.config.pad_multiple
        padded = (counts + m - 1) // m * m
        padded_starts = torch.cumsum(padded, 0) - padded
        starts = torch.cumsum(counts, 0) - counts
        positions = padded_starts[experts] + torch.arange(len(pairs), device=idx.device) - starts[experts]
        total = int(padded.sum())
        permuted = recv_x.new_zeros(total, recv_x.shape[1]).index_copy(0, positions, recv_x.index_select(0, rows))
        probs = weights.new_zeros(total).index_copy(0, positions, weights[rows, slots])
        pending.rows, pending.positions = rows, positions
        return permuted, probs, padded

    @staticmethod
    def _probs_problem(routing, probs):
        """Why dispatch_all_to_all cannot send `probs` in place of the routing's (None: it can)."""
        if probs is None or probs is routing.weights:
            return None
        want = routing.weights
        if not isinstance(probs, torch.Tensor) or probs.numel() != want.numel() or probs.dim() < 1 \
                or probs.shape[0] != want.shape[0]:
            shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            return (f"dispatcher: dispatch_all_to_all: probs {shape} is not of the routing dispatch_preprocess took "
                    f"({tuple(want.shape)}: pass what it returned, or probs of that shape)")
        return None

    def _async_problem(self, step, async_finish):
        """async_finish=True needs the communication stream, which only async_dispatch uses."""
        if async_finish and not self.config.async_dispatch:
            return (f"dispatcher: {step}: async_finish=True with async_dispatch=False: every call then runs on "
                    "torch's current stream (as CUDA graph capture needs), so there is nothing to finish "
                    "asynchronously; make the dispatcher with DispatcherConfig(async_dispatch=True), or pass "
                    "async_finish=False / None")
        return None

    def _on_call_stream(self, buffer):
        """A context that runs torch ops on the stream _on_stream runs the calls on."""
        if buffer.device.type != "cuda" or not self.config.async_dispatch:
            return contextlib.nullcontext()
        return torch.cuda.stream(buffer.comm_stream)

    def _on_stream(self, buffer, run, async_finish, previous_event, inputs):
        """Runs an epx call where this pool's calls run: torch's current stream, or (async_dispatch) the
        buffer's communication stream (streams.on_side_stream). Returns (result, EventOverlap). Backward
        runs on the stream the forward ran on (torch's rule)."""
        if buffer.device.type != "cuda":
            return run(), NO_EVENT  # the CPU backend has no streams: every call is done when it returns
        if not self.config.async_dispatch:
            event = event_of(previous_event)
            if event is not None:  # the call is ordered after previous_event on the stream it runs on
                torch.cuda.current_stream(buffer.device).wait_event(event)
            return run(), NO_EVENT
        asynchronous = self.config.async_dispatch if async_finish is None else bool(async_finish)
        return on_side_stream(buffer.comm_stream, run, inputs, previous_event, asynchronous)
