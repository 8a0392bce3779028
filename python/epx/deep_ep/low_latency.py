"""DeepEP's low-latency calls on epx.LowLatencyBuffer (mixed into deep_ep.Buffer).

One epx low-latency buffer per (num_max_dispatch_tokens_per_rank, hidden, experts, top-k, wire);
the wire comes from use_fp8 / round_scale / use_ue8m0: bf16, fp8, fp8_ue8m0 (float scales), or
fp8_ue8m0 with DeepEP's packed int32 scales. Each epx buffer has two alternating sets, as DeepEP's
two buffers: a call's outputs hold its data until the next-but-one call of its kind.

return_recv_hook=True is epx's send half now and its receive half in the hook. DeepEP returns the
output tensors before the hook fills them, so they must exist at the send: each set keeps the
tensors of its previous call (which DeepEP's rule lets the new call overwrite) and the hook writes
the received data into them. On the GPU epx's receive tensors are views of the set, the same memory
every time, so from a set's second call on nothing is copied but the small derived tensors (scales
in DeepEP's layout, src_info, layout_range); a set's first hooked call copies once. On the CPU
backend, whose outputs are fresh tensors, the hook copies.
"""

import torch

from ..config import WireFormat
from ..errors import InvalidArgument, Unsupported
from ..low_latency import LowLatencyBuffer
from ..streams import EventOverlap
from .config import ll_bytes
from .handles import LowLatencyHandle, is_low_latency_handle
from .layout import column_major, layout_range, ue8m0_packed


def refuse_options(call, options):
    """Keyword arguments of DeepEP forks (SGLang's use_nvfp4, overlap, comp_signal, ...) epx does not have."""
    if options:
        raise Unsupported(f"{call}: {', '.join(sorted(options))}: not DeepEP arguments epx supports (options of a "
                          "DeepEP fork?)")


class _LowLatencyState:
    """One epx low-latency buffer and the tensors DeepEP's callers hold of it."""

    def __init__(self, buffer, packed_scales):
        self.ll = buffer
        self.packed_scales = packed_scales
        self.dispatched = [None, None]  # per set: the last dispatch's outputs (name -> tensor)
        self.combined = [None, None]  # per set: the last combine's output
        self.zero_copy = [None, None]  # per combine set: get_next_low_latency_combine_buffer's tensor

    def close(self):
        """Destroys the epx buffer now (collective on the shared GPU)."""
        self.ll.close()

    def received(self, d):
        """DeepEP's form of an epx dispatch output."""
        outputs = {"recv_x": d.recv_x, "recv_count": d.recv_count, "src_info": d.recv_src[..., 1].contiguous(),
                   "layout_range": layout_range(d.recv_layout)}
        if d.recv_scales is not None:
            scales = ue8m0_packed(d.recv_scales) if self.packed_scales else d.recv_scales
            outputs["recv_scales"] = column_major(scales)
        return outputs

    def reserved_dispatch(self, set_index, x):
        """Tensors to hand out before a hooked dispatch's data is there: the set's last ones, else new."""
        kept = self.dispatched[set_index]
        if kept is None:
            kept = self._empty_dispatch(x.device)
            self.dispatched[set_index] = kept
        return kept

    def _empty_dispatch(self, device):
        c, ranks = self.ll.config, self.ll.num_ranks
        local, rows = self.ll.num_local_experts, ranks * c.max_tokens_per_rank
        x_dtype = torch.bfloat16 if c.wire == WireFormat.bf16 else _fp8_dtype()
        outputs = {"recv_x": torch.zeros(local, rows, c.hidden, dtype=x_dtype, device=device),
                   "recv_count": torch.zeros(local, dtype=torch.int32, device=device),
                   "src_info": torch.zeros(local, rows, dtype=torch.int32, device=device),
                   "layout_range": torch.zeros(local, ranks, dtype=torch.int64, device=device)}
        if c.wire != WireFormat.bf16:
            groups, dtype = (c.hidden // 512, torch.int32) if self.packed_scales else (c.hidden // 128, torch.float32)
            outputs["recv_scales"] = column_major(torch.zeros(local, rows, groups, dtype=dtype, device=device))
        return outputs

    @staticmethod
    def fill(targets, values):
        for name, value in values.items():
            target = targets[name]
            if target.data_ptr() != value.data_ptr() or target.stride() != value.stride():
                target.copy_(value)


def _fp8_dtype():
    from ..tensors import fp8_dtype

    return fp8_dtype()


def _deep_ep_x(outputs):
    return (outputs["recv_x"], outputs["recv_scales"]) if "recv_scales" in outputs else outputs["recv_x"]


class LowLatencyCalls:
    """low_latency_dispatch / low_latency_combine and their helpers, for deep_ep.Buffer."""

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """The num_rdma_bytes an epx low-latency buffer of this shape needs (one wire format; each format
        used makes its own buffer, checked against num_rdma_bytes on its own)."""
        return ll_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: epx's low-latency buffers are their own memory, and every call's flags are
        reset by their receiver, so a high-throughput call leaves them as they were."""
        self._check_alive()
        self._require_low_latency_mode("clean_low_latency_buffer")

    def get_next_low_latency_combine_buffer(self, handle):
        """A bf16 [L, R*M, H] tensor for the next low_latency_combine's x (zero_copy=True): one per set, as
        DeepEP's. epx reads x wherever it lies, so this is an ordinary tensor the combine reads in place."""
        state = self._ll_state_of(handle, "get_next_low_latency_combine_buffer")
        index = state.ll.combine_calls % 2
        if state.zero_copy[index] is None:
            c = state.ll.config
            shape = (state.ll.num_local_experts, state.ll.num_ranks * c.max_tokens_per_rank, c.hidden)
            state.zero_copy[index] = torch.zeros(shape, dtype=torch.bfloat16, device=handle.src_info.device)
        return state.zero_copy[index]

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False, use_per_tensor_quantization=False, static_scale=None,
                             **options):
        """(recv_x or (codes, scales), recv_count [L] int32, handle, event, hook or None), DeepEP's shapes:
        recv_x [L, R*M, H]; scales [L, R*M, H/128] f32 or, with use_ue8m0, [L, R*M, H/512] int32 packed,
        column-major in the last two dimensions."""
        self._check_alive()
        self._require_low_latency_mode("low_latency_dispatch")
        refuse_options("low_latency_dispatch", options)
        if dispatch_wait_recv_cost_stats is not None:
            raise Unsupported("low_latency_dispatch: dispatch_wait_recv_cost_stats: epx does not time its waits")
        if use_per_tensor_quantization or static_scale is not None:
            raise Unsupported("low_latency_dispatch: per-tensor fp8 (use_per_tensor_quantization / static_scale) is "
                              "not an epx wire format; epx scales per 128 channels")
        if async_finish and return_recv_hook:
            raise InvalidArgument("low_latency_dispatch: async_finish and return_recv_hook exclude each other")
        wire, packed = ll_wire(use_fp8, round_scale, use_ue8m0)
        state = self._ll_state(num_max_dispatch_tokens_per_rank, x, topk_idx, num_experts, wire, packed)
        set_index = state.ll.dispatch_calls % 2

        def count(received):  # on the stream that made recv_count
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(received["recv_count"])

        def finish(received, epx_handle):
            state.dispatched[set_index] = received  # the set's next hooked call hands these out
            handle.attach(epx_handle, state)

        if return_recv_hook:
            state.ll.dispatch_send(x, topk_idx)
            outputs = state.reserved_dispatch(set_index, x)
            handle = self._ll_handle(outputs, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
            handle.attach(None, state)  # combine before the hook is refused

            def hook():
                d = state.ll.dispatch_recv()
                received = state.received(d)
                state.fill(outputs, received)
                count(received)
                finish(received, d.handle)

            return _deep_ep_x(outputs), outputs["recv_count"], handle, EventOverlap(), hook

        def run():
            d = state.ll.dispatch(x, topk_idx)
            received = state.received(d)
            count(received)
            return d, received

        inputs = tuple(t for t in (x, topk_idx, cumulative_local_expert_recv_stats) if t is not None)
        (d, outputs), event = self.run_on_side_stream(run, inputs, None, async_finish, False)
        handle = self._ll_handle(outputs, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        finish(outputs, d.handle)
        return _deep_ep_x(outputs), outputs["recv_count"], handle, event, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None,
                            **options):
        """(combined_x [T, H] bf16, event, hook or None): combined_x[t] = sum over slots k with topk_idx >= 0
        of topk_weights[t, k] * x[its row] (epx sums per expert rank first, rounding each rank's partial to
        bf16). zero_copy=True: x must be get_next_low_latency_combine_buffer's tensor for this combine (DeepEP
        reads that buffer, not x), else the combine fails on every rank; x is read in place either way. out:
        written and returned."""
        self._check_alive()
        refuse_options("low_latency_combine", options)
        if use_logfmt:
            raise Unsupported("low_latency_combine: use_logfmt (DeepEP's 10-bit LogFMT) is not an epx wire format")
        if combine_wait_recv_cost_stats is not None:
            raise Unsupported("low_latency_combine: combine_wait_recv_cost_stats: epx does not time its waits")
        if async_finish and return_recv_hook:
            raise InvalidArgument("low_latency_combine: async_finish and return_recv_hook exclude each other")
        state = self._ll_state_of(handle, "low_latency_combine")
        if handle.epx is None:  # this rank's own state: its peers' same combine fails too
            state.ll.reject("combine", "low_latency_combine: the dispatch's receive hook has not run yet")
        set_index = state.ll.combine_calls % 2
        if zero_copy and not same_memory(x, state.zero_copy[set_index]):
            # DeepEP's zero-copy combine reads its own buffer, not x; epx reads x: they agree only when x is that
            # buffer (the one get_next_low_latency_combine_buffer handed out for this combine).
            state.ll.reject("combine", "low_latency_combine: zero_copy=True with an x that is not the tensor "
                                       "get_next_low_latency_combine_buffer returned for this combine: DeepEP would "
                                       "combine what that buffer holds, epx combines x; pass that tensor as x (or "
                                       "zero_copy=False)")
        weights = combine_weights(topk_idx, topk_weights)
        if return_recv_hook:
            state.ll.combine_send(x, handle.epx, topk_weights=weights)
            target = out if out is not None else self._reserved_combine(state, set_index, handle, x)

            def hook():
                result = state.ll.combine_recv()
                if result.data_ptr() != target.data_ptr():
                    target.copy_(result)
                state.combined[set_index] = result

            return target, EventOverlap(), hook

        def run():
            result = state.ll.combine(x, handle.epx, topk_weights=weights)
            return result, (out.copy_(result) if out is not None else result)

        inputs = tuple(t for t in (x, weights, out) if t is not None)
        (result, combined), event = self.run_on_side_stream(run, inputs, None, async_finish, False)
        state.combined[set_index] = result  # the set's own tensor, never the caller's out
        return combined, event, None

    # --- helpers --------------------------------------------------------------------------------

    def _ll_state(self, tokens, x, topk_idx, num_experts, wire, packed):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not isinstance(topk_idx, torch.Tensor) \
                or topk_idx.dim() != 2:
            raise InvalidArgument("low_latency_dispatch: x must be [num_tokens, hidden], topk_idx "
                                  "[num_tokens, num_topk]")
        hidden, topk = x.shape[1], topk_idx.shape[1]
        if packed and hidden % 512:
            raise InvalidArgument(f"low_latency_dispatch: use_ue8m0 packs four scales of 128 channels per int32, so "
                                  f"hidden must be a multiple of 512, got {hidden}")
        key = ("ll", tokens, hidden, num_experts, topk, wire, packed)
        if key not in self._buffers:
            need = ll_bytes(tokens, hidden, self.group_size)
            if self.num_rdma_bytes < need:
                raise InvalidArgument(f"low_latency_dispatch: num_rdma_bytes={self.num_rdma_bytes} is less than the "
                                      f"{need} bytes get_low_latency_rdma_size_hint({tokens}, {hidden}, "
                                      f"{self.group_size}, {num_experts}) asks for")
            ll = LowLatencyBuffer(self.epx_group, hidden, tokens, num_experts, topk, wire=wire,
                                  timeout_ms=self.epx_timeout_ms)
            self._buffers[key] = _LowLatencyState(ll, packed)
        return self._buffers[key]

    def _ll_state_of(self, handle, call):
        if not is_low_latency_handle(handle):
            raise InvalidArgument(f"{call}: handle: expected the handle an epx.deep_ep low_latency_dispatch "
                                  f"returned, got {type(handle).__name__}")
        return handle.buffer

    def _ll_handle(self, outputs, tokens, hidden, num_experts):
        return LowLatencyHandle(outputs["src_info"], outputs["layout_range"], tokens, hidden, num_experts)

    @staticmethod
    def _reserved_combine(state, set_index, handle, x):
        kept = state.combined[set_index]
        tokens = handle.epx.tokens
        if kept is None or kept.shape != (tokens, x.shape[-1]):
            kept = torch.empty(tokens, x.shape[-1], dtype=torch.bfloat16, device=x.device)
        return kept

    def _require_low_latency_mode(self, call):
        if not self.low_latency_mode:
            raise InvalidArgument(f"{call}: needs a Buffer made with low_latency_mode=True (as in DeepEP)")


def same_memory(a, b):
    """Whether tensor a is tensor b's memory in b's layout (b may be None)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() \
        and a.shape == b.shape and a.stride() == b.stride()


def ll_wire(use_fp8, round_scale, use_ue8m0):
    """(epx wire format, packed UE8M0 scales?) of DeepEP's fp8 flags."""
    if not use_fp8:
        return "bf16", False  # round_scale / use_ue8m0 describe fp8 scales: without fp8 there are none
    if use_ue8m0 and not round_scale:
        raise InvalidArgument("low_latency_dispatch: use_ue8m0=True needs round_scale=True (as in DeepEP)")
    return ("fp8_ue8m0" if round_scale else "fp8"), bool(use_ue8m0)


def combine_weights(topk_idx, topk_weights):
    """The weights epx sums with: zero where the combine's topk_idx is -1, which DeepEP skips (epx combines by
    the dispatch's routing). Tensors epx would refuse pass unchanged, so epx refuses them on every rank."""
    if isinstance(topk_idx, torch.Tensor) and isinstance(topk_weights, torch.Tensor) \
            and topk_idx.shape == topk_weights.shape and topk_idx.device == topk_weights.device:
        return topk_weights.masked_fill(topk_idx < 0, 0.0)
    return topk_weights
