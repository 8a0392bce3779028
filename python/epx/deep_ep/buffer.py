"""deep_ep.Buffer on epx: the high-throughput calls (the low-latency ones are in low_latency.py).

DeepEP's Buffer is sized once, by bytes; epx buffers are sized by a call's shape (hidden, experts,
top-k, wire format, tokens per rank). So this Buffer creates epx buffers as calls need them, one per
shape key. Creating an epx buffer is collective (every rank, the same config, the same order), so
every part of the key comes from arguments every rank passes alike: the call's hidden size, top-k
and expert count, the wire format x comes in, num_worst_tokens, the Config's num_sms, and a token
budget derived from num_nvl_bytes (config.py), never from this rank's token count. A rank whose call
exceeds the budget fails the call on every rank (epx.Buffer.reject), with the reason.

DeepEP intranode dispatch is epx's rank-major layout (each token once per destination rank,
recv_topk_idx local expert ids or -1); DeepEP combine is epx's unweighted rank-major combine.
"""


import weakref

import torch

from ..buffer import Buffer as EpxBuffer
from ..config import Op, WireFormat
from ..errors import InvalidArgument, Unsupported
from ..group import Group
from ..streams import EventHandle, EventOverlap, on_side_stream
from .config import Config, nvl_bytes_per_token
from .handles import DispatchHandle, is_dispatch_handle
from .layout import aligned_counts, dispatch_layout, finish_on, rank_prefix_matrix
from .low_latency import LowLatencyCalls, refuse_options

# Buffer(..., epx_max_tokens_per_rank=None) takes this, for code that builds its Buffers itself (vLLM,
# SGLang): set it once before they do, with set_default_max_tokens_per_rank.
_defaults = {"max_tokens_per_rank": None}


def set_default_max_tokens_per_rank(tokens):
    """The high-throughput token budget per rank of every Buffer made from now on without
    epx_max_tokens_per_rank (None: what num_nvl_bytes buys). Every rank must set the same value."""
    _defaults["max_tokens_per_rank"] = None if tokens is None else int(tokens)


def refuse(buffer, op, reason, error=Unsupported):
    """Fails this call on every rank: the peers' same call raises PeerFailed quoting `reason`, this rank
    raises `error` (Unsupported for what epx cannot do, InvalidArgument for a bad input)."""
    try:
        buffer.reject(op, reason)
    except InvalidArgument as e:
        raise error(reason) from e
    raise error(reason)  # reject always raises; kept so a change there cannot let the call run


class Buffer(LowLatencyCalls):
    """DeepEP's communication buffer over an epx group (docs/integrations.md, "DeepEP").

    ``group``: a torch.distributed ProcessGroup (an epx group is made from it, collectively) or an
    epx.Group. epx extensions (keyword-only): ``epx_max_tokens_per_rank`` (the high-throughput token
    budget per rank; default: set_default_max_tokens_per_rank's, else what num_nvl_bytes buys) and
    ``epx_timeout_ms`` (every epx buffer's timeout; 0: epx's default).
    """

    num_sms = 20  # DeepEP's class-wide SM budget for the high-throughput calls (set_num_sms)

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False, explicitly_destroy=False,
                 enable_shrink=False, comm=None, *, epx_max_tokens_per_rank=None, epx_timeout_ms=0):
        # DeepEP's positional order (deep_ep/buffer.py); refusals here come before anything collective, and
        # every rank passes these arguments alike, so every rank refuses the same construction.
        if comm is not None:
            raise Unsupported("deep_ep.Buffer: comm (an mpi4py communicator) is not supported by epx; pass the "
                              "torch.distributed group (or an epx.Group) as group")
        if group is None:
            raise InvalidArgument("deep_ep.Buffer: group is required")
        if not allow_nvlink_for_low_latency_mode:
            raise Unsupported("deep_ep.Buffer: allow_nvlink_for_low_latency_mode=False asks for RDMA-only traffic; "
                              "epx moves every token over NVLink / peer memory (it has no RDMA transport)")
        if use_fabric:
            raise Unsupported("deep_ep.Buffer: use_fabric=True asks for communication memory allocated with CUDA "
                              "fabric handles (multi-node NVLink); epx allocates its buffers itself, for the ranks "
                              "of one node, and has no fabric-memory allocation")
        if enable_shrink:
            raise Unsupported("deep_ep.Buffer: enable_shrink=True asks for DeepEP's shrink mode (a mask buffer that "
                              "takes failed ranks out of the low-latency calls, with low_latency_update_mask_buffer "
                              "and the other mask calls); epx has no rank masking: every call needs every rank")
        if low_latency_mode and num_qps_per_rank <= 0:
            raise InvalidArgument(f"deep_ep.Buffer: num_qps_per_rank must be > 0, got {num_qps_per_rank}")
        self.group = group
        self.epx_group = group if isinstance(group, Group) else Group.from_torch(group)
        self.rank, self.group_size = self.epx_group.rank, self.epx_group.size
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.num_qps_per_rank, self.allow_mnnvl = num_qps_per_rank, bool(allow_mnnvl)  # no effect on epx
        if epx_max_tokens_per_rank is None:
            epx_max_tokens_per_rank = _defaults["max_tokens_per_rank"]
        self.epx_max_tokens_per_rank = epx_max_tokens_per_rank
        self.epx_timeout_ms = epx_timeout_ms
        self._buffers = {}  # shape key -> epx buffer (high-throughput and low-latency), in creation order
        self._side_stream = None
        self._destroyed = False
        self._last_layout = None  # what get_dispatch_layout returned last (_LayoutRecord)

    # --- DeepEP's static helpers ----------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms):
        """The SM budget of later high-throughput calls (every rank alike: it is part of the buffer config)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise InvalidArgument(f"deep_ep.Buffer.set_num_sms: the SM count must be a positive even int, "
                                  f"got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        """A Config epx honours at any rank count: Buffer.num_sms (the chunk sizes do not apply to epx)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def capture():
        """EventOverlap(EventHandle()): an event recorded on torch's current stream (none without CUDA)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled():
        """Whether this build has GPU kernels (epx's serve every format on every GPU it supports)."""
        from .. import has_cuda

        return bool(has_cuda)

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        raise Unsupported("deep_ep.Buffer.get_local_buffer_tensor: epx has no raw communication buffer to expose; "
                          "its buffers are sized and laid out per call shape")

    def get_comm_stream(self):
        raise Unsupported("deep_ep.Buffer.get_comm_stream: epx runs each buffer shape's comm-stream calls on that "
                          "buffer's own stream (epx.Buffer.comm_stream), so there is no single one")

    def destroy(self):
        """Destroys every epx buffer now, in creation order (collective on the shared GPU)."""
        if not self.explicitly_destroy:
            raise InvalidArgument("deep_ep.Buffer.destroy: needs explicitly_destroy=True (as in DeepEP)")
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()
        self._destroyed = True

    # --- high-throughput calls ------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """num_tokens_per_rank [R] int32, None (no RDMA ranks), num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event. Local (no peers), in torch."""
        self._check_alive()
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise InvalidArgument("get_dispatch_layout: topk_idx must be a [num_tokens, num_topk] tensor")
        if num_experts <= 0 or num_experts % self.group_size:
            raise InvalidArgument(f"get_dispatch_layout: num_experts={num_experts} must be a positive multiple "
                                  f"of the {self.group_size} ranks")
        (per_rank, per_expert, in_rank), event = self.run_on_side_stream(
            lambda: dispatch_layout(topk_idx, num_experts, self.group_size), (topk_idx,), previous_event,
            async_finish, allocate_on_comm_stream)
        self._last_layout = _LayoutRecord(topk_idx, (per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False, **options):
        """DeepEP's intranode dispatch: (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); with a handle, the cached dispatch:
        (recv_x, None, None, None, None, event). x: [T, H] bf16, or (fp8 codes, scales [T, H/128] f32).

        Routing is topk_idx's; num_tokens_per_rank / is_token_in_rank / num_tokens_per_expert must be what
        get_dispatch_layout derives from it (DeepEP would route and count by them): values that are not
        fail the dispatch on every rank (_check_layout_args). num_tokens_per_expert's length is the expert
        count."""
        self._check_alive()
        refuse_options("dispatch", options)
        given = x
        x, x_scales = split_x(x)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise InvalidArgument("dispatch: x must be a [num_tokens, hidden] tensor (or a pair of them with fp8)")
        streams = dict(previous_event=previous_event, async_finish=async_finish,
                       allocate_on_comm_stream=allocate_on_comm_stream)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise InvalidArgument("dispatch: a cached dispatch (handle given) takes no topk_idx / topk_weights")
            if is_dispatch_handle(handle):
                self._check_cached_args(handle, num_tokens_per_rdma_rank, num_worst_tokens, config)
                order_copies(handle.buffer, given, x_scales, previous_event)
            return self._cached_dispatch(x, x_scales, handle, streams)
        self._check_routing_args(topk_idx, num_tokens_per_expert, num_tokens_per_rdma_rank, expert_alignment,
                                 num_worst_tokens)
        # The config's num_sms is part of the buffer's key: the dispatch runs with it (the chunk sizes tune
        # DeepEP's rings, which epx does not have).
        num_sms = config_sms(config if config is not None else self.get_dispatch_config(self.group_size))
        buffer = self._ht_buffer(x.shape[1], topk_idx.shape[1], num_tokens_per_expert.numel(),
                                 "bf16" if x_scales is None else "fp8", num_worst_tokens, num_sms)
        if x.shape[0] > buffer.config.max_tokens_per_rank:
            refuse(buffer, Op.dispatch, self._budget_message(x.shape[0], buffer), InvalidArgument)
        self._check_layout_args(buffer, topk_idx, (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank))
        order_copies(buffer, given, x_scales, previous_event)
        d = buffer.dispatch(x, topk_idx, topk_weights, x_scales=x_scales, layout="rank_major", **streams)

        def deep_ep_outputs():
            recv_x = d.recv_x if x_scales is None else (d.recv_x, d.recv_scales)
            counts = [] if num_worst_tokens else aligned_counts(d.tokens_per_expert, expert_alignment)
            recv_weights = None if topk_weights is None else d.recv_topk_weights
            in_rank = dispatch_layout(topk_idx, buffer.num_experts, self.group_size)[2]
            new_handle = DispatchHandle(rank_prefix_matrix(d.rank_offsets, self.rank, self.group_size), None, None,
                                        d.recv_src[:, 1].contiguous(), in_rank, None)
            new_handle.attach(d.handle, buffer, d.recv_topk_idx, recv_weights)
            return recv_x, d.recv_topk_idx.to(topk_idx.dtype), recv_weights, counts, new_handle

        outputs, event = finish_on(buffer, d.event, deep_ep_outputs)
        return (*outputs, event)

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False, **options):
        """DeepEP's combine: (combined_x [T, H] bf16, combined_topk_weights [T, K] f32 or None, event).
        combined_x[t] = the sum of the rows of token t from every rank it went to, plus bias (one [T, H]
        bf16 tensor or a pair). The combine runs with the SM budget of the buffer its dispatch made."""
        self._check_alive()
        refuse_options("combine", options)
        if not is_dispatch_handle(handle):
            raise InvalidArgument("combine: handle: expected the handle an epx.deep_ep dispatch returned, got "
                                  f"{type(handle).__name__}")
        buffer, streams = handle.buffer, dict(previous_event=previous_event, async_finish=async_finish,
                                              allocate_on_comm_stream=allocate_on_comm_stream)
        op = Op.combine if topk_weights is None else Op.dispatch_backward  # the epx call this combine makes
        # DeepEP runs its combine with the config's SMs; epx's combine runs on the buffer its dispatch made, with
        # that buffer's SM budget, and cannot take another one per call.
        check_config(buffer, op, "combine", config, "epx's combine runs with its dispatch's SM budget", Unsupported)
        biases = [b for b in unpack_bias(bias) if b is not None]
        if topk_weights is None:
            shared = biases.pop(0) if biases else None
            c = buffer.combine(x, handle.epx, shared_out=shared, weighted=False, **streams)
            out, weights, event = c.out, None, c.event
        else:
            # epx's dispatch_backward is exactly this: the unweighted combine of x, and per slot the weight at
            # the rank holding its expert (= DeepEP's sum over ranks when the other ranks hold 0 there).
            self._check_combine_weights(handle, topk_weights)
            b = buffer.dispatch_backward(x, handle.epx, topk_weights, **streams)
            out, weights, event = b.grad_x, b.grad_topk_weights, b.event
        if biases:  # rounded to bf16 once more than DeepEP's sum (epx rounds its sum first)
            out, event = finish_on(buffer, event, lambda: add_biases(out, biases))
            if event.event is not None:  # read on the comm stream: the caller may drop them now
                for bias in biases:
                    bias.record_stream(buffer.comm_stream)
        return out, weights, event

    # --- helpers --------------------------------------------------------------------------------

    def _cached_dispatch(self, x, x_scales, handle, streams):
        if not is_dispatch_handle(handle):
            raise InvalidArgument("dispatch: handle: expected the handle an epx.deep_ep dispatch returned, got "
                                  f"{type(handle).__name__}")
        buffer = handle.buffer
        fp8_handle = buffer.wire in (WireFormat.fp8, WireFormat.fp8_ue8m0)
        if fp8_handle != (x_scales is not None):
            given, made = ("fp8" if x_scales is not None else "bf16"), ("fp8" if fp8_handle else "bf16")
            refuse(buffer, Op.cached_dispatch, f"dispatch: a cached dispatch of {given} x with the handle of a {made} "
                                               "dispatch: epx moves the rows in the wire format of the handle's "
                                               "buffer; pass x in the form the dispatch that made the handle had")
        d = buffer.dispatch(x, handle=handle.epx, x_scales=x_scales, **streams)
        recv_x = d.recv_x if x_scales is None else (d.recv_x, d.recv_scales)
        return recv_x, None, None, None, None, d.event

    def _check_cached_args(self, handle, num_tokens_per_rdma_rank, num_worst_tokens, config):
        """A cached dispatch takes its layout from the handle, as DeepEP's does (num_tokens_per_rank,
        is_token_in_rank, num_tokens_per_expert and expert_alignment are not read); what would make it
        another call than the handle's dispatch is refused, on every rank alike."""
        buffer = handle.buffer
        if num_tokens_per_rdma_rank is not None:
            refuse(buffer, Op.cached_dispatch, "dispatch: num_tokens_per_rdma_rank is for internode dispatch; "
                                               "epx is intranode only")
        if num_worst_tokens not in (0, buffer.config.capacity_rows):
            refuse(buffer, Op.cached_dispatch,
                   f"dispatch: num_worst_tokens={num_worst_tokens} with a handle whose dispatch had "
                   f"{buffer.config.capacity_rows}: a cached dispatch has its handle's output rows", InvalidArgument)
        check_config(buffer, Op.cached_dispatch, "dispatch", config,
                     "a cached dispatch runs on its handle's buffer and SM budget", InvalidArgument)

    def _check_routing_args(self, topk_idx, num_tokens_per_expert, num_tokens_per_rdma_rank, expert_alignment,
                            num_worst_tokens):
        """Arguments every rank passes alike: refused here, on every rank, before any collective."""
        if topk_idx is None:
            raise Unsupported("dispatch: a dispatch without topk_idx (routing by is_token_in_rank only) is not "
                              "supported by epx; pass topk_idx (and topk_weights)")
        if num_tokens_per_rdma_rank is not None:
            raise Unsupported("dispatch: num_tokens_per_rdma_rank is for internode dispatch; epx is intranode only")
        if not isinstance(num_tokens_per_expert, torch.Tensor):
            raise InvalidArgument("dispatch: num_tokens_per_expert (the [num_experts] tensor of get_dispatch_layout) "
                                  "is required: its length is the expert count")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise InvalidArgument("dispatch: topk_idx must be a [num_tokens, num_topk] tensor")
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise InvalidArgument(f"dispatch: expert_alignment must be an int >= 1, got {expert_alignment!r}")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise InvalidArgument(f"dispatch: num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")

    def _check_layout_args(self, buffer, topk_idx, given):
        """DeepEP's dispatch sends by num_tokens_per_rank / is_token_in_rank and counts by num_tokens_per_expert;
        epx sends and counts by topk_idx. They agree when those are what get_dispatch_layout gives for topk_idx,
        so other values are refused on every rank. get_dispatch_layout's own outputs for this topk_idx, unchanged,
        pass without a look; others are compared (a host sync on the GPU; skipped in a graph capture)."""
        if self._last_layout is not None and self._last_layout.holds(topk_idx, given):
            return
        if topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        experts = buffer.num_experts
        if topk_idx.dtype not in (torch.int32, torch.int64) or bool(((topk_idx < -1) | (topk_idx >= experts)).any()):
            return  # epx refuses this topk_idx itself, on every rank, naming it
        want = dispatch_layout(topk_idx, experts, self.group_size)
        for name, t, w in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), given, want):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != w.shape or not torch.equal(t.to(w.device, w.dtype), w):
                refuse(buffer, Op.dispatch, f"dispatch: {name} is not what get_dispatch_layout gives for topk_idx: "
                                            "DeepEP would send (or count) by it, epx sends by topk_idx; pass "
                                            "get_dispatch_layout's outputs for this topk_idx", InvalidArgument)

    def _check_combine_weights(self, handle, topk_weights):
        """Refuses, on every rank, weights epx cannot sum as DeepEP does: non-zero where this rank holds none
        of the slot's expert (recv_topk_idx == -1). The dispatch's own recv_topk_weights, unchanged, pass
        without a look; anything else is checked (a host sync on the GPU; skipped in a graph capture)."""
        if topk_weights is handle.recv_topk_weights and topk_weights._version == handle.weights_version:
            return
        local = handle.recv_topk_idx
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != local.shape \
                or topk_weights.device != local.device:
            return  # epx's own checks refuse it on every rank, naming it
        if topk_weights.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if bool((topk_weights.masked_fill(local >= 0, 0) != 0).any()):
            refuse(handle.buffer, Op.dispatch_backward,
                   "combine: topk_weights is non-zero at slots whose expert this rank does not hold "
                   "(recv_topk_idx == -1); epx returns each slot's weight from its expert's rank only, so it cannot "
                   "add those in as DeepEP does. Zero them (as dispatch's recv_topk_weights are)")

    def _ht_buffer(self, hidden, topk, num_experts, wire, num_worst_tokens, num_sms):
        key = ("ht", hidden, topk, num_experts, wire, num_worst_tokens, num_sms)
        if key not in self._buffers:
            tokens = self._token_budget(hidden)
            self._buffers[key] = EpxBuffer(self.epx_group, hidden, tokens, num_experts, topk, wire=wire,
                                           capacity_rows=num_worst_tokens, num_sms=num_sms,
                                           timeout_ms=self.epx_timeout_ms)
        return self._buffers[key]

    def _token_budget(self, hidden):
        if self.epx_max_tokens_per_rank is not None:
            return int(self.epx_max_tokens_per_rank)
        tokens = self.num_nvl_bytes // (self.group_size * nvl_bytes_per_token(hidden))
        if tokens <= 0:
            raise InvalidArgument(f"dispatch: num_nvl_bytes={self.num_nvl_bytes} buys no tokens at hidden={hidden} "
                                  f"on {self.group_size} ranks; size it with Config.get_nvl_buffer_size_hint, or "
                                  f"pass epx_max_tokens_per_rank= (or call epx.deep_ep.set_default_max_tokens_per_rank)")
        return tokens

    def _budget_message(self, tokens, buffer):
        budget = buffer.config.max_tokens_per_rank
        return (f"dispatch: {tokens} tokens on rank {self.rank}, but this deep_ep.Buffer's token budget is "
                f"{budget} per rank (num_nvl_bytes={self.num_nvl_bytes} at hidden={buffer.hidden}, or "
                f"epx_max_tokens_per_rank); create the Buffer with a larger num_nvl_bytes or "
                f"epx_max_tokens_per_rank= (or epx.deep_ep.set_default_max_tokens_per_rank)")

    def _check_alive(self):
        if self._destroyed:
            raise InvalidArgument("deep_ep.Buffer: used after destroy()")

    def run_on_side_stream(self, make, inputs, previous_event, async_finish, allocate_on_comm_stream):
        """Torch work the DeepEP way (get_dispatch_layout, low-latency async_finish): on CUDA inputs with any
        of the options, on this Buffer's side stream (streams.on_side_stream); else here. (result, event)."""
        if not (async_finish or previous_event is not None or allocate_on_comm_stream) \
                or not any(t.is_cuda for t in inputs if t is not None):
            return make(), EventOverlap()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        return on_side_stream(self._side_stream, make, inputs, previous_event, async_finish)


class _LayoutRecord:
    """get_dispatch_layout's topk_idx and outputs, by weak reference and version: a dispatch given them unchanged
    needs no look at their values."""

    def __init__(self, topk_idx, outputs):
        tensors = (topk_idx, *outputs)
        self.refs = [weakref.ref(t) for t in tensors]
        self.versions = [t._version for t in tensors]

    def holds(self, topk_idx, given):
        for ref, version, t in zip(self.refs, self.versions, (topk_idx, *given)):
            if t is not None and (ref() is not t or t._version != version):
                return False
        return True


def config_sms(config):
    """The SM count of a deep_ep.Config (or of DeepEP's own Config, which has the same attribute)."""
    num_sms = getattr(config, "num_sms", None)
    if not isinstance(num_sms, int):
        raise InvalidArgument(f"config: expected a deep_ep.Config, got {type(config).__name__}")
    return num_sms


def check_config(buffer, op, call, config, why, error):
    """Refuses, on every rank, a config (None: the default, accepted) whose num_sms is not the SM budget of the
    epx buffer the call runs on: epx cannot honour it (`why`)."""
    num_sms = getattr(config, "num_sms", None)
    if config is not None and num_sms != buffer.config.num_sms:
        refuse(buffer, op, f"{call}: config.num_sms={num_sms!r}, but the handle's dispatch ran with "
                           f"{buffer.config.num_sms} and {why}; pass a config with that num_sms (or none)", error)


def split_x(x):
    """DeepEP's x: a tensor, or (fp8 codes, scales). Scales in another layout (DeepEP reads strides) are made
    contiguous; packed UE8M0 int scales are refused."""
    if not isinstance(x, tuple):
        return x, None
    if len(x) != 2:
        raise InvalidArgument(f"dispatch: x as a tuple must be (fp8 codes, scales), got {len(x)} items")
    codes, scales = x
    if isinstance(scales, torch.Tensor) and scales.dtype == torch.int32:
        raise Unsupported("dispatch: packed UE8M0 scales (int32) are not supported by epx's high-throughput "
                          "dispatch; pass float32 scales [T, H/128]")
    if isinstance(scales, torch.Tensor) and not scales.is_contiguous():
        scales = scales.contiguous()  # on the current stream: see order_copies
    return codes, scales


def order_copies(buffer, original_x, x_scales, previous_event):
    """With previous_event the comm stream waits for that event only; scales split_x copied on the
    current stream after it must be waited for too."""
    copied = isinstance(original_x, tuple) and x_scales is not original_x[1]
    if copied and previous_event is not None and x_scales.is_cuda:
        buffer.comm_stream.wait_stream(torch.cuda.current_stream())


def unpack_bias(bias):
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, tuple) and len(bias) == 2:
        return bias
    raise InvalidArgument("combine: bias must be a [T, H] bf16 tensor or a pair of them")


def add_biases(out, biases):
    total = out.float()
    for b in biases:
        total = total + b.float()
    return total.to(torch.bfloat16)
