"""epx.deep_ep: DeepEP's Buffer API on epx, against a plain-torch statement of DeepEP's documented semantics
(deep_ep/buffer.py's docstrings, tests/test_intranode.py, tests/test_low_latency.py), on the CPU backend at
1, 2 and 4 ranks; the call patterns of vLLM and SGLang; refusals on every rank; GPU tests (skipped without a
GPU): EP1 over NCCL and the shared GPU at EP2/EP4, bit for bit against the CPU backend, and CUDA graphs of
the low-latency calls."""

import inspect
import threading

import pytest
import torch

import epx
import epx.deep_ep as deep_ep
from epx.deep_ep.config import nvl_bytes_per_token
from epx.tensors import fp8_dtype
from helpers import TIMEOUT_MS, Problem, assert_close_sum, random_bf16, run_all, run_ranks

H, E, K, T = 128, 8, 3, 10  # E: a multiple of 1, 2 and 4 ranks
M = 12  # low-latency num_max_dispatch_tokens_per_rank
BUDGET = 64  # high-throughput tokens per rank num_nvl_bytes buys in these tests
RANKS = [1, 2, 4]

has_cached_dispatch = "handle" in inspect.signature(epx.Buffer.dispatch).parameters
needs_cached_dispatch = pytest.mark.skipif(not has_cached_dispatch, reason="epx.Buffer.dispatch(handle=) not there yet")
needs_gpu = pytest.mark.skipif(not (epx.has_cuda and epx.cuda_available()), reason="needs the CUDA backend and a GPU")


def nvl_bytes(ranks, hidden=H, tokens=BUDGET):
    return ranks * tokens * nvl_bytes_per_token(hidden)


def make_buffers(groups, hidden=H, **kwargs):
    args = dict(num_nvl_bytes=nvl_bytes(len(groups), hidden),
                num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, len(groups), E),
                low_latency_mode=True, epx_timeout_ms=TIMEOUT_MS)
    args.update(kwargs)
    return [deep_ep.Buffer(g, **args) for g in groups]  # an epx.Group: nothing collective until a call


# --- the reference: DeepEP's documented semantics in plain torch ---------------------------------------

def ref_layout(idx, ranks, experts):
    """get_dispatch_layout of one rank: tokens per rank, per expert, is_token_in_rank (loops)."""
    local = experts // ranks
    in_rank = torch.zeros(idx.shape[0], ranks, dtype=torch.bool)
    per_expert = torch.zeros(experts, dtype=torch.int32)
    for t in range(idx.shape[0]):
        for e in idx[t].tolist():
            if e >= 0:
                in_rank[t, e // local] = True
                per_expert[e] += 1
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


class RefDispatch:
    """What rank d receives: rows in (source rank, source token) order, each token once."""

    def __init__(self, p, d, alignment=1):
        local = p.experts // p.ranks
        self.rows = [(s, t) for s in range(p.ranks) for t in range(p.tokens[s])
                     if any(e >= 0 and e // local == d for e in p.idx[s][t].tolist())]
        n = len(self.rows)
        self.x = torch.stack([p.x[s][t] for s, t in self.rows]) if n else torch.zeros(0, p.hidden, dtype=torch.bfloat16)
        self.topk_idx = torch.full((n, p.topk), -1, dtype=torch.int64)
        self.topk_weights = torch.zeros(n, p.topk)
        for row, (s, t) in enumerate(self.rows):
            for k, e in enumerate(p.idx[s][t].tolist()):
                if e >= 0 and e // local == d:
                    self.topk_idx[row, k] = e - d * local
                    self.topk_weights[row, k] = p.w[s][t, k]
        counts = [int((self.topk_idx == l).sum()) for l in range(local)]
        self.counts = [-(-c // alignment) * alignment for c in counts]
        self.prefix = [sum(1 for s, _ in self.rows if s <= i) for i in range(p.ranks)]
        self.src_idx = torch.tensor([t for _, t in self.rows], dtype=torch.int32)


def ref_combine(refs, ys, s, p, biases=()):
    """combined_x of rank s in float64 (the sum over the ranks each token went to), and the magnitudes."""
    out = torch.zeros(p.tokens[s], p.hidden, dtype=torch.float64)
    scale = torch.zeros_like(out)
    for d, ref in enumerate(refs):
        for row, (src, t) in enumerate(ref.rows):
            if src == s:
                out[t] += ys[d][row].double()
                scale[t] += ys[d][row].double().abs()
    for b in biases:
        out += b.double()
        scale += b.double().abs()
    return out, scale


def ref_combined_weights(refs, ws, s, p):
    """combined_topk_weights of rank s: per slot the sum over the ranks the token went to."""
    out = torch.zeros(p.tokens[s], p.topk, dtype=torch.float64)
    for d, ref in enumerate(refs):
        for row, (src, t) in enumerate(ref.rows):
            if src == s:
                out[t] += ws[d][row].double()
    return out.float()


def e4m3_to_float(codes):
    """Decodes e4m3 codes (a float8 tensor or its uint8 bytes) in plain integer arithmetic."""
    b = codes.view(torch.uint8).to(torch.int32)
    sign = torch.where(b >> 7 == 1, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 15, (b & 7).float()
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).float())
    value = torch.where(exponent == 0, mantissa / 8 * 2.0 ** -6, normal)
    return sign * torch.where((exponent == 15) & (mantissa == 7), torch.tensor(float("nan")), value)


def ref_scale(rows, round_scale):
    """Per 128-channel block: max(amax, 1e-4) / 448 in fp32; round_scale: up to a power of two."""
    amax = rows.float().abs().reshape(*rows.shape[:-1], -1, 128).amax(-1).clamp(min=1e-4)
    scale = amax / 448
    if round_scale:
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return scale


def problem(ranks, seed, tokens=T, hidden=H, unused=0.15):
    return Problem(ranks, hidden, E, K, tokens, seed=seed, unused=unused)


# --- high throughput -------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", RANKS)
def test_get_dispatch_layout_matches_reference(ranks):
    p = problem(ranks, seed=1)
    buffers = make_buffers(epx.Group.host(ranks))
    for r in range(ranks):  # local: no peers involved
        per_rank, rdma, per_expert, in_rank, event = buffers[r].get_dispatch_layout(p.idx[r], E)
        want = ref_layout(p.idx[r], ranks, E)
        assert rdma is None and isinstance(event, deep_ep.EventOverlap)
        assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert torch.equal(per_rank, want[0]) and torch.equal(per_expert, want[1]) and torch.equal(in_rank, want[2])


VARIANTS = ["plain", "aligned", "worst_tokens", "stream_options", "bias", "bias_pair", "no_weights_in_combine"]


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_dispatch_and_combine_match_reference(ranks, variant):
    p = problem(ranks, seed=10 + ranks)
    alignment = 4 if variant == "aligned" else 1
    worst = ranks * T if variant == "worst_tokens" else 0
    streams = variant == "stream_options"
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        prev = deep_ep.Buffer.capture() if streams else None
        per_rank, rdma, per_expert, in_rank, event = b.get_dispatch_layout(
            p.idx[r], E, previous_event=prev, async_finish=streams, allocate_on_comm_stream=streams)
        recv_x, recv_idx, recv_w, counts, handle, event = b.dispatch(
            p.x[r], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=p.idx[r], topk_weights=p.w[r], expert_alignment=alignment,
            num_worst_tokens=worst, previous_event=event if streams else None, async_finish=streams,
            allocate_on_comm_stream=streams)
        event.current_stream_wait()
        y = random_bf16(recv_x.shape, 100 + r)
        biases = [random_bf16((T, H), 200 + r + i) for i in range(2 if variant == "bias_pair" else 1)] \
            if variant.startswith("bias") else []
        bias = None if not biases else biases[0] if len(biases) == 1 else tuple(biases)
        weights = None if variant == "no_weights_in_combine" else recv_w
        combined, combined_w, event = b.combine(y, handle, topk_weights=weights, bias=bias,
                                                previous_event=deep_ep.Buffer.capture() if streams else None,
                                                async_finish=streams, allocate_on_comm_stream=streams)
        with event:
            pass
        return recv_x, recv_idx, recv_w, counts, handle, y, biases, combined, combined_w

    runs = run_all(groups, rank)
    refs = [RefDispatch(p, d, alignment) for d in range(ranks)]
    for d, (recv_x, recv_idx, recv_w, counts, handle, _, _, _, _) in enumerate(runs):
        ref, n = refs[d], len(refs[d].rows)
        assert recv_x.shape[0] == (worst or n) and recv_idx.dtype == torch.int64
        assert torch.equal(recv_x[:n], ref.x) and torch.equal(recv_idx[:n], ref.topk_idx)
        assert torch.equal(recv_w[:n], ref.topk_weights)
        if worst:  # padding rows: nothing received
            assert counts == [] and not recv_x[n:].any() and (recv_idx[n:] == -1).all() and not recv_w[n:].any()
        else:
            assert counts == ref.counts
        rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, _ = handle
        assert rank_prefix_matrix[:, d].tolist() == ref.prefix
        assert torch.equal(recv_src_idx[:n], ref.src_idx)
        assert torch.equal(is_token_in_rank, ref_layout(p.idx[d], ranks, E)[2])
    ys = [run[5][:len(refs[d].rows)] for d, run in enumerate(runs)]
    for s, run in enumerate(runs):
        want, scale = ref_combine(refs, ys, s, p, run[6])
        assert_close_sum(run[7], want, scale, f"rank {s} combined_x", rel=2.0 ** -7 * (1 + len(run[6])))
        if variant == "no_weights_in_combine":
            assert run[8] is None
        else:
            want_w = ref_combined_weights(refs, [r[2][:len(refs[d].rows)] for d, r in enumerate(runs)], s, p)
            assert torch.equal(run[8], want_w)
            assert torch.equal(want_w, torch.where(p.idx[s] >= 0, p.w[s], torch.zeros_like(p.w[s])))


def fp8_inputs(p, seed):
    """Pre-quantized x: random e4m3 codes (no NaN code) and random positive scales [T, H/128]."""
    g = torch.Generator().manual_seed(seed)
    codes, scales = [], []
    for t in p.tokens:
        c = torch.randint(0, 0x7E, (t, p.hidden), generator=g, dtype=torch.uint8)
        c |= (torch.randint(0, 2, (t, p.hidden), generator=g, dtype=torch.uint8) << 7)
        codes.append(c.view(fp8_dtype()))
        scales.append(torch.rand(t, p.hidden // 128, generator=g) + 0.01)
    return codes, scales


@pytest.mark.parametrize("ranks", RANKS)
def test_fp8_dispatch_moves_codes_and_scales_as_given(ranks):
    p = problem(ranks, seed=20 + ranks, hidden=256)
    codes, scales = fp8_inputs(p, 21)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=256)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        per_rank, rdma, per_expert, in_rank, _ = b.get_dispatch_layout(p.idx[r], E)
        (recv_codes, recv_scales), recv_idx, _, counts, handle, _ = b.dispatch(
            (codes[r], scales[r].t().contiguous().t()), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=p.idx[r], topk_weights=p.w[r])  # column-major scales too
        return recv_codes, recv_scales, recv_idx, counts

    for d, (recv_codes, recv_scales, recv_idx, counts) in enumerate(run_all(groups, rank)):
        ref = RefDispatch(p, d)
        assert recv_codes.dtype == fp8_dtype() and recv_scales.dtype == torch.float32
        want_codes = torch.stack([codes[s][t].view(torch.uint8) for s, t in ref.rows])
        want_scales = torch.stack([scales[s][t] for s, t in ref.rows])
        assert torch.equal(recv_codes.view(torch.uint8), want_codes) and torch.equal(recv_scales, want_scales)
        assert torch.equal(recv_idx, ref.topk_idx) and counts == ref.counts


@needs_cached_dispatch
@pytest.mark.parametrize("ranks", RANKS)
def test_cached_dispatch_repeats_the_layout(ranks):
    p = problem(ranks, seed=30 + ranks, hidden=256)
    codes, scales = fp8_inputs(p, 31)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=256)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(p.idx[r], E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        _, _, _, _, handle, _ = b.dispatch(p.x[r], topk_idx=p.idx[r], topk_weights=p.w[r], **layout)
        again = b.dispatch(random_bf16((T, 256), 40 + r), handle=handle)
        _, _, _, _, fp8_handle, _ = b.dispatch((codes[r], scales[r]), topk_idx=p.idx[r], topk_weights=p.w[r],
                                               **layout)
        fp8_again = b.dispatch((codes[r], scales[r] * 2), handle=fp8_handle, async_finish=True,
                               previous_event=deep_ep.Buffer.capture())
        return again, fp8_again

    for d, (again, fp8_again) in enumerate(run_all(groups, rank)):
        ref = RefDispatch(p, d)
        assert again[1:5] == (None, None, None, None) and fp8_again[1:5] == (None, None, None, None)
        want = torch.stack([random_bf16((T, 256), 40 + s)[t] for s, t in ref.rows])
        assert torch.equal(again[0], want)
        recv_codes, recv_scales = fp8_again[0]
        want_codes = torch.stack([codes[s][t].view(torch.uint8) for s, t in ref.rows])
        assert torch.equal(recv_codes.view(torch.uint8), want_codes)
        assert torch.equal(recv_scales, torch.stack([scales[s][t] * 2 for s, t in ref.rows]))


@pytest.mark.parametrize("ranks", RANKS)
def test_backward_style_combine_of_gradients(ranks):
    """As training code does (Megatron's fused_a2a): the backward of dispatch is a combine of the gradients of
    recv_x with topk_weights = the gradients of recv_topk_weights (zero at slots held elsewhere)."""
    p = problem(ranks, seed=50 + ranks)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(p.idx[r], E)
        recv_x, recv_idx, _, _, handle, _ = b.dispatch(p.x[r], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=p.idx[r],
                                                       topk_weights=p.w[r])
        grad_recv_x = random_bf16(recv_x.shape, 60 + r)
        grad_recv_w = torch.randn(recv_idx.shape, generator=torch.Generator().manual_seed(70 + r))
        grad_recv_w = grad_recv_w.masked_fill(recv_idx < 0, 0.0)  # what autograd gives a gathered weight
        grad_x, grad_w, _ = b.combine(grad_recv_x.contiguous(), handle, topk_weights=grad_recv_w.float())
        return grad_recv_x, grad_recv_w, grad_x, grad_w

    runs = run_all(groups, rank)
    refs = [RefDispatch(p, d) for d in range(ranks)]
    for s, (_, _, grad_x, grad_w) in enumerate(runs):
        want, scale = ref_combine(refs, [run[0] for run in runs], s, p)
        assert_close_sum(grad_x, want, scale, f"rank {s} grad_x")
        assert torch.equal(grad_w, ref_combined_weights(refs, [run[1] for run in runs], s, p))


def megatron_style_functions(buffer, num_experts, async_finish):
    """Autograd functions in the manner of Megatron's fused_a2a (its FusedDispatch / FusedCombine): the
    previous event is EventOverlap(EventHandle()) imported from deep_ep.utils, the dispatch's backward a
    combine of the gradients with topk_weights, the combine's backward a cached dispatch."""
    from deep_ep.utils import EventHandle, EventOverlap  # noqa: F811 (the module under its DeepEP name)

    def before():
        return EventOverlap(EventHandle()) if async_finish else None

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, idx, probs):
            per_rank, rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
                idx, num_experts, previous_event=before(), async_finish=async_finish)
            recv_x, recv_idx, recv_probs, counts, handle, after = buffer.dispatch(
                x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=event,
                async_finish=async_finish)
            if async_finish:
                after.current_stream_wait()
            ctx.handle = handle
            return recv_x, recv_idx, recv_probs, torch.tensor(counts), handle

        @staticmethod
        def backward(ctx, grad_x, grad_idx, grad_probs, grad_counts, grad_handle):
            gx, gprobs, after = buffer.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
                                               previous_event=before(), async_finish=async_finish)
            if async_finish:
                after.current_stream_wait()
            return gx, None, gprobs

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, handle):
            out, _, after = buffer.combine(y, handle=handle, previous_event=before(), async_finish=async_finish)
            if async_finish:
                after.current_stream_wait()
            ctx.handle = handle
            return out

        @staticmethod
        def backward(ctx, grad_out):
            grad_y, _, _, _, _, after = buffer.dispatch(grad_out.contiguous(), handle=ctx.handle,
                                                        previous_event=before(), async_finish=async_finish)
            if async_finish:
                after.current_stream_wait()
            return grad_y, None

    return Dispatch, Combine


@pytest.fixture
def deep_ep_module_name():
    """epx.deep_ep importable as deep_ep (and deep_ep.utils), as a stack that imports DeepEP sees it."""
    import sys

    saved = {name: sys.modules.get(name) for name in ("deep_ep", "deep_ep.utils")}
    sys.modules["deep_ep"] = deep_ep
    yield
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_fused_a2a_pattern_forward_and_backward(deep_ep_module_name, ranks, async_finish):
    """x -> dispatch -> experts (y = 2 x times the row's local probs) -> combine, with autograd as
    Megatron's fused_a2a drives DeepEP, against the dense statement in float64: out[t] = 2 x[t] sum_k p[t,k]."""
    p = problem(ranks, seed=80 + ranks)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)
    grads = [torch.randn(T, H, generator=torch.Generator().manual_seed(90 + r)) for r in range(ranks)]

    def rank(g):
        r = g.rank
        Dispatch, Combine = megatron_style_functions(buffers[r], E, async_finish)
        x = p.x[r].clone().requires_grad_()
        probs = p.w[r].clone().requires_grad_()
        recv_x, recv_idx, recv_probs, counts, handle = Dispatch.apply(x, p.idx[r], probs)
        local_probs = recv_probs.masked_fill(recv_idx < 0, 0.0).sum(dim=1, keepdim=True)
        out = Combine.apply((recv_x.float() * 2 * local_probs).bfloat16(), handle)
        (out.float() * grads[r]).sum().backward()
        return out.detach(), x.grad, probs.grad

    for r, (out, gx, gp) in enumerate(run_all(groups, rank)):
        x = p.x[r].double().requires_grad_()
        w = p.w[r].double().requires_grad_()
        used = (p.idx[r] >= 0).double()
        want = 2 * x * (w * used).sum(dim=1, keepdim=True)
        (want * grads[r].double()).sum().backward()
        for got, ref, what in ((out, want.detach(), "out"), (gx, x.grad, "grad x"), (gp, w.grad * used, "grad probs")):
            err = (got.double() - ref).abs().max()
            assert err <= 0.02 * ref.abs().max() + 1e-6, f"rank {r} {what}: max error {float(err):.3g}"


def test_deep_ep_utils_and_topk_idx_t_import_as_deep_ep(deep_ep_module_name):
    import deep_ep as imported
    from deep_ep.utils import EventHandle, EventOverlap

    assert imported.topk_idx_t == torch.int64
    assert EventOverlap is deep_ep.EventOverlap and EventHandle is deep_ep.EventHandle
    overlap = EventOverlap(EventHandle())
    overlap.current_stream_wait()  # nothing queued on the CPU: returns
    with deep_ep.Buffer.capture():
        pass


@pytest.mark.parametrize("ranks", [2])
def test_cached_dispatch_refuses_what_would_make_it_another_call(ranks):
    p = problem(ranks, seed=95)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)
    cases = {"rdma": (dict(num_tokens_per_rdma_rank=torch.ones(2)), epx.Unsupported, "internode"),
             "worst": (dict(num_worst_tokens=7), epx.InvalidArgument, "num_worst_tokens=7"),
             "sms": (dict(config=deep_ep.Config(8)), epx.InvalidArgument, "config.num_sms=8")}

    def rank(g):
        b, r = buffers[g.rank], g.rank
        _, _, _, _, handle, _ = b.dispatch(p.x[r], **_dispatch_kwargs(b, p, r))
        outcomes = {}
        for name, (extra, _, _) in cases.items():
            try:
                b.dispatch(p.x[r], handle=handle, **extra)
            except epx.Error as e:
                outcomes[name] = e
        again = b.dispatch(p.x[r], handle=handle, config=deep_ep.Buffer.get_dispatch_config(ranks))
        return outcomes, again

    for d, (outcomes, again) in enumerate(run_all(groups, rank)):
        for name, (_, error, message) in cases.items():
            assert isinstance(outcomes.get(name), error) and message in str(outcomes[name]), (name, outcomes.get(name))
        assert again[1:5] == (None, None, None, None)
        assert torch.equal(again[0], RefDispatch(p, d).x), f"rank {d}: the cached dispatch after the refusals"


@pytest.mark.parametrize("weights", [False, True])
def test_combine_config_epx_cannot_honour_fails_every_rank(weights):
    """combine runs with its dispatch's SM budget: a config of another num_sms is refused on every rank (one rank
    passing it fails that combine everywhere), one of the same num_sms (or none) is accepted; the dispatch's
    config.num_sms is the budget of the buffer it runs on."""
    ranks, p = 2, problem(2, seed=96)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)
    dispatch_config = deep_ep.Config(8)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        recv_x, _, recv_w, _, handle, _ = b.dispatch(p.x[r], config=dispatch_config, **_dispatch_kwargs(b, p, r))
        assert handle.buffer.config.num_sms == 8
        topk_weights = recv_w if weights else None
        outcomes = []
        for bad_ranks in ((1,), (0, 1)):
            try:
                b.combine(recv_x, handle, topk_weights=topk_weights,
                          config=deep_ep.Config(12) if r in bad_ranks else None)
                outcomes.append(None)
            except epx.Error as e:
                outcomes.append(e)
        same = b.combine(recv_x, handle, topk_weights=topk_weights, config=deep_ep.Config(8))
        default = b.combine(recv_x, handle, topk_weights=topk_weights)
        return recv_x, outcomes, same[0], default[0]

    runs = run_all(groups, rank)
    (one_0, all_0), (one_1, all_1) = runs[0][1], runs[1][1]
    assert isinstance(one_1, epx.Unsupported) and "config.num_sms=12" in str(one_1), one_1
    assert isinstance(one_0, epx.PeerFailed) and "config.num_sms=12" in str(one_0), one_0
    for e in (all_0, all_1):
        assert isinstance(e, epx.Unsupported) and "dispatch's SM budget" in str(e), e
    refs = [RefDispatch(p, d) for d in range(ranks)]
    for s, run in enumerate(runs):
        want, scale = ref_combine(refs, [r[0] for r in runs], s, p)
        assert_close_sum(run[2], want, scale, f"rank {s} combined, config of the dispatch's num_sms")
        assert torch.equal(run[2], run[3])


# --- low latency -----------------------------------------------------------------------------------

LL_WIRES = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True), "fp8_round": dict(use_fp8=True, round_scale=True),
            "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}


def ll_expected(p, d):
    """For each local expert of rank d and each source rank: the source tokens that chose it."""
    local = p.experts // p.ranks
    return [[sorted(t for t in range(p.tokens[s]) if d * local + l in p.idx[s][t].tolist()) for s in range(p.ranks)]
            for l in range(local)]


def ll_rows(handle, l, s):
    """The rows of source rank s in local expert l's block (DeepEP's layout_range) and their tokens."""
    packed = int(handle[1][l, s])
    begin, count = packed >> 32, packed & 0xFFFFFFFF
    return range(begin, begin + count), handle[0][l, begin:begin + count].tolist()


def check_ll_dispatch(p, d, recv, recv_count, handle, wire):
    expected = ll_expected(p, d)
    local = p.experts // p.ranks
    assert recv_count.dtype == torch.int32 and recv_count.tolist() == [sum(map(len, e)) for e in expected]
    assert handle[2:] == (M, p.hidden, p.experts) and handle[1].dtype == torch.int64
    codes, scales = recv if isinstance(recv, tuple) else (recv, None)
    assert codes.shape == (local, p.ranks * M, p.hidden)
    if scales is not None:
        packed = wire == "ue8m0"
        groups = p.hidden // (512 if packed else 128)
        assert scales.shape == (local, p.ranks * M, groups)
        assert scales.dtype == (torch.int32 if packed else torch.float32)
        assert scales.stride()[1] == 1 and (groups == 1 or scales.stride()[2] == p.ranks * M)  # column-major (TMA)
    for l in range(local):
        for s in range(p.ranks):
            rows, tokens = ll_rows(handle, l, s)
            assert sorted(tokens) == expected[l][s], f"expert {l} source {s}"
            for row, t in zip(rows, tokens):
                x = p.x[s][t]
                if scales is None:
                    assert torch.equal(codes[l, row], x)
                    continue
                want_scale = ref_scale(x, wire != "fp8")
                got_scale = scales[l, row].contiguous()
                if wire == "ue8m0":  # exponent bytes, four to an int32 (block 4j + b in byte b)
                    got_scale = (got_scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
                assert torch.equal(got_scale, want_scale)
                deq = e4m3_to_float(codes[l, row]) * want_scale.repeat_interleave(128)
                bound = x.float().abs() / 16 + want_scale.repeat_interleave(128) / 512
                assert ((deq - x.float()).abs() <= bound).all()


def ll_expected_combine(p, handles, ys, s, weights):
    local = p.experts // p.ranks
    out = torch.zeros(p.tokens[s], p.hidden, dtype=torch.float64)
    scale = torch.zeros_like(out)
    for d in range(p.ranks):
        for l in range(local):
            rows, tokens = ll_rows(handles[d], l, s)
            for row, t in zip(rows, tokens):
                k = p.idx[s][t].tolist().index(d * local + l)
                term = ys[d][l, row].double() * float(weights[t, k])
                out[t] += term
                scale[t] += term.abs()
    return out, scale


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("wire", sorted(LL_WIRES))
@pytest.mark.parametrize("hook", [False, True])
def test_low_latency_dispatch_and_combine_match_reference(ranks, wire, hook):
    p = problem(ranks, seed=80 + ranks, tokens=M - 2, hidden=512)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=512)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        stats = torch.full((E // ranks,), 3, dtype=torch.int32)
        results = []
        for step in range(3):  # both sets, and the first one again
            recv, count, handle, event, recv_hook = b.low_latency_dispatch(
                p.x[r], p.idx[r], M, E, cumulative_local_expert_recv_stats=stats, async_finish=not hook,
                return_recv_hook=hook, **LL_WIRES[wire])
            recv_hook() if hook else event.current_stream_wait()
            y = random_bf16((E // ranks, ranks * M, 512), 90 + 10 * step + r)
            out = torch.empty(p.tokens[r], 512, dtype=torch.bfloat16) if step == 1 else None
            if step == 2:  # zero copy: the expert outputs written into the combine's buffer
                y_buffer = b.get_next_low_latency_combine_buffer(handle)
                y_buffer.copy_(y)
                y = y_buffer
            combined, event, combine_hook = b.low_latency_combine(y, p.idx[r], p.w[r], handle, zero_copy=step == 2,
                                                                  async_finish=not hook, return_recv_hook=hook, out=out)
            combine_hook() if hook else event.current_stream_wait()
            assert out is None or combined is out
            results.append((recv, count, handle, y.clone(), combined.clone()))
            if step == 0:
                results[0] = tuple(v.clone() if isinstance(v, torch.Tensor) else
                                   tuple(t.clone() for t in v) if isinstance(v, tuple) and not isinstance(
                                       v, deep_ep.LowLatencyHandle) else v for v in results[0])
        return results, stats

    runs = run_all(groups, rank)
    for step in (1, 2):  # steps 1 and 2 still hold their data (step 0's set was reused by step 2)
        handles = [run[0][step][2] for run in runs]
        ys = [run[0][step][3] for run in runs]
        for d, (results, _) in enumerate(runs):
            recv, count, handle, _, combined = results[step]
            check_ll_dispatch(p, d, recv, count, handle, wire)
            want, scale = ll_expected_combine(p, handles, ys, d, p.w[d])
            assert_close_sum(combined, want, scale, f"step {step} rank {d} combined")
    for d, (results, stats) in enumerate(runs):
        assert torch.equal(stats, 3 + 3 * results[1][1])


@pytest.mark.parametrize("ranks", [2, 4])
def test_low_latency_hooks_overlap_two_layers(ranks):
    """One layer's combine in flight while the next layer's dispatch is sent (one send of each kind in flight,
    as a two-batch overlap may interleave two micro-batches)."""
    problems = [problem(ranks, seed=100 + i, tokens=M, hidden=512) for i in range(2)]
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=512)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        recv0, _, h0, _, hook0 = b.low_latency_dispatch(problems[0].x[r], problems[0].idx[r], M, E, use_fp8=False,
                                                        return_recv_hook=True)
        hook0()
        y0 = random_bf16((E // ranks, ranks * M, 512), 110 + r)
        out0, _, combine_hook0 = b.low_latency_combine(y0, problems[0].idx[r], problems[0].w[r], h0,
                                                       return_recv_hook=True)
        recv1, _, h1, _, hook1 = b.low_latency_dispatch(problems[1].x[r], problems[1].idx[r], M, E, use_fp8=False,
                                                        return_recv_hook=True)
        combine_hook0()
        hook1()
        y1 = random_bf16((E // ranks, ranks * M, 512), 120 + r)
        out1, _, _ = b.low_latency_combine(y1, problems[1].idx[r], problems[1].w[r], h1)
        return (h0, y0, out0.clone()), (h1, y1, out1)

    runs = run_all(groups, rank)
    for i, p in enumerate(problems):
        handles, ys = [run[i][0] for run in runs], [run[i][1] for run in runs]
        for d, run in enumerate(runs):
            want, scale = ll_expected_combine(p, handles, ys, d, p.w[d])
            assert_close_sum(run[i][2], want, scale, f"layer {i} rank {d}")


def test_low_latency_combine_never_hands_out_the_callers_out():
    """A combine written into the caller's out=, then a hooked combine of the same set without out: the hook
    fills the set's own tensor, and the caller's out keeps its values."""
    ranks = 2
    p = problem(ranks, seed=130, tokens=M, hidden=512)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=512)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        y = random_bf16((E // ranks, ranks * M, 512), 140 + r)
        mine = torch.zeros(M, 512, dtype=torch.bfloat16)
        for step in range(3):  # combine sets 0, 1, 0
            recv, _, h, _, _ = b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_fp8=False)
            if step == 0:
                b.low_latency_combine(y, p.idx[r], p.w[r], h, out=mine)
                kept = mine.clone()
            elif step == 2:
                got, _, hook = b.low_latency_combine(y, p.idx[r], p.w[r], h, return_recv_hook=True)
                hook()
            else:
                b.low_latency_combine(y, p.idx[r], p.w[r], h)
        return got is not mine and torch.equal(mine, kept)

    assert all(run_all(groups, rank))


def test_low_latency_combine_skips_slots_its_topk_idx_masks():
    """DeepEP sums the slots whose combine-time topk_idx is >= 0: a slot masked there adds nothing."""
    ranks, p = 2, problem(2, seed=130, tokens=M, hidden=512, unused=0.0)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=512)
    masked = [i.clone() for i in p.idx]
    for i in masked:
        i[:, 0] = -1

    def rank(g):
        b, r = buffers[g.rank], g.rank
        _, _, handle, _, _ = b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_fp8=False)
        y = random_bf16((E // ranks, ranks * M, 512), 140 + r)
        return handle, y, b.low_latency_combine(y, masked[r], p.w[r], handle)[0]

    runs = run_all(groups, rank)
    for d, (_, _, combined) in enumerate(runs):
        weights = p.w[d].clone()
        weights[:, 0] = 0
        want, scale = ll_expected_combine(p, [r[0] for r in runs], [r[1] for r in runs], d, weights)
        assert_close_sum(combined, want, scale, f"rank {d}")


# --- refusals --------------------------------------------------------------------------------------

def test_constructor_refusals():
    (g,) = epx.Group.host(1)
    with pytest.raises(epx.Unsupported, match="mpi4py"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(epx.Unsupported, match="RDMA"):
        deep_ep.Buffer(g, allow_nvlink_for_low_latency_mode=False)
    with pytest.raises(epx.InvalidArgument, match="explicitly_destroy"):
        deep_ep.Buffer(g).destroy()
    with pytest.raises(epx.InvalidArgument, match="even"):
        deep_ep.Buffer.set_num_sms(3)
    b = deep_ep.Buffer(g, num_nvl_bytes=nvl_bytes(1), explicitly_destroy=True)
    b.destroy()
    with pytest.raises(epx.InvalidArgument, match="after destroy"):
        b.get_dispatch_layout(torch.zeros(1, K, dtype=torch.int64), E)
    with pytest.raises(epx.Unsupported):
        b.get_local_buffer_tensor(torch.bfloat16)


# DeepEP's constructor (deep_ep/buffer.py): code that passes its arguments by position lands on the same ones.
DEEP_EP_BUFFER_ARGS = ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                       "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                       "enable_shrink", "comm"]


def test_constructor_takes_deep_eps_arguments_in_deep_eps_order():
    params = list(inspect.signature(deep_ep.Buffer.__init__).parameters.values())[1:]
    positional = [q.name for q in params if q.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == DEEP_EP_BUFFER_ARGS
    defaults = {q.name: q.default for q in params if q.name in DEEP_EP_BUFFER_ARGS[1:]}
    assert defaults == dict(num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                            explicitly_destroy=False, enable_shrink=False, comm=None)
    (g,) = epx.Group.host(1)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E)
    b = deep_ep.Buffer(g, nvl_bytes(1), rdma, True, 8, True, True, False, True, False, None)  # all by position
    assert (b.num_nvl_bytes, b.num_rdma_bytes, b.low_latency_mode, b.num_qps_per_rank, b.allow_mnnvl,
            b.explicitly_destroy) == (nvl_bytes(1), rdma, True, 8, True, True)
    b.destroy()  # explicitly_destroy (the ninth) took True


@pytest.mark.parametrize("name, why", [("use_fabric", "fabric"), ("enable_shrink", "rank masking")])
def test_constructor_refuses_what_epx_cannot_honour_by_name(name, why):
    (g,) = epx.Group.host(1)
    with pytest.raises(epx.Unsupported, match=f"{name}=True.*{why}"):
        deep_ep.Buffer(g, num_nvl_bytes=nvl_bytes(1), **{name: True})
    position = DEEP_EP_BUFFER_ARGS.index(name)
    args = [g, nvl_bytes(1), 0, False, 24, True, False, False, False, False, None]
    args[position] = True
    with pytest.raises(epx.Unsupported, match=f"{name}=True"):
        deep_ep.Buffer(*args)
    deep_ep.Buffer(g, num_nvl_bytes=nvl_bytes(1), **{name: False})  # False: DeepEP's default, accepted


def _dispatch_kwargs(b, p, r, **extra):
    per_rank, rdma, per_expert, in_rank, _ = b.get_dispatch_layout(p.idx[r], E)
    args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=p.idx[r], topk_weights=p.w[r])
    args.update(extra)
    return args


REFUSED_EVERYWHERE = {
    "no_topk_idx": (lambda b, p, r: b.dispatch(p.x[r], **_dispatch_kwargs(b, p, r, topk_idx=None, topk_weights=None)),
                    epx.Unsupported, "without topk_idx"),
    "rdma_ranks": (lambda b, p, r: b.dispatch(p.x[r], **_dispatch_kwargs(b, p, r,
                                                                         num_tokens_per_rdma_rank=torch.ones(2))),
                   epx.Unsupported, "internode"),
    "fork_option": (lambda b, p, r: b.dispatch(p.x[r], num_recv_tokens_per_expert_as_cuda=True,
                                               **_dispatch_kwargs(b, p, r)),
                    epx.Unsupported, "num_recv_tokens_per_expert_as_cuda"),
    "logfmt": (lambda b, p, r: b.low_latency_combine(None, p.idx[r], p.w[r], None, use_logfmt=True),
               epx.Unsupported, "LogFMT"),
    "per_tensor": (lambda b, p, r: b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_per_tensor_quantization=True),
                   epx.Unsupported, "per-tensor"),
    "wait_stats": (lambda b, p, r: b.low_latency_dispatch(p.x[r], p.idx[r], M, E,
                                                          dispatch_wait_recv_cost_stats=torch.zeros(2, 2).long()),
                   epx.Unsupported, "time its waits"),
    "nvfp4_fork": (lambda b, p, r: b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_nvfp4=True),
                   epx.Unsupported, "use_nvfp4"),
    "ue8m0_without_round": (lambda b, p, r: b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_ue8m0=True),
                            epx.InvalidArgument, "round_scale"),
    "hook_and_async": (lambda b, p, r: b.low_latency_dispatch(p.x[r], p.idx[r], M, E, async_finish=True,
                                                              return_recv_hook=True),
                       epx.InvalidArgument, "exclude"),
    # a second dispatch send before the first one's receive (hook): one send of each kind in flight
    "two_dispatch_sends": (lambda b, p, r: [b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_fp8=False,
                                                                   return_recv_hook=True) for _ in range(2)],
                           epx.InvalidArgument, "has no dispatch_recv yet"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_EVERYWHERE))
def test_refused_arguments_fail_every_rank(name):
    call, error, message = REFUSED_EVERYWHERE[name]
    ranks, p = 2, problem(2, seed=150, tokens=M)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)
    _, errors = run_ranks(groups, lambda g: call(buffers[g.rank], p, g.rank))
    for e in errors:
        assert isinstance(e, error) and message in str(e), e


def test_low_latency_needs_low_latency_mode_and_rdma_bytes():
    p = problem(1, seed=160, tokens=M)
    (g,) = epx.Group.host(1)
    with pytest.raises(epx.InvalidArgument, match="low_latency_mode=True"):
        deep_ep.Buffer(g).low_latency_dispatch(p.x[0], p.idx[0], M, E)
    with pytest.raises(epx.InvalidArgument, match="get_low_latency_rdma_size_hint"):
        deep_ep.Buffer(g, num_rdma_bytes=1000, low_latency_mode=True).low_latency_dispatch(p.x[0], p.idx[0], M, E)


def test_tokens_past_the_budget_fail_every_rank_and_the_buffer_stays_usable():
    ranks = 2
    p = problem(ranks, seed=170, tokens=[BUDGET + 1, 4])
    small = problem(ranks, seed=171, tokens=4)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)
    _, errors = run_ranks(groups, lambda g: buffers[g.rank].dispatch(p.x[g.rank],
                                                                     **_dispatch_kwargs(buffers[g.rank], p, g.rank)))
    assert isinstance(errors[0], epx.InvalidArgument) and "token budget is 64" in str(errors[0]), errors[0]
    assert isinstance(errors[1], epx.PeerFailed) and "token budget" in str(errors[1]), errors[1]
    runs = run_all(groups, lambda g: buffers[g.rank].dispatch(small.x[g.rank],
                                                              **_dispatch_kwargs(buffers[g.rank], small, g.rank)))
    for d, run in enumerate(runs):
        assert torch.equal(run[0], RefDispatch(small, d).x)


def test_combine_weights_held_elsewhere_fail_every_rank():
    """DeepEP's combine adds slot k's weight from every rank the token went to; epx takes it from the rank
    holding the expert, so weights at slots held elsewhere are refused, not dropped."""
    ranks, p = 2, problem(2, seed=180)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        recv_x, recv_idx, recv_w, _, handle, _ = b.dispatch(p.x[r], **_dispatch_kwargs(b, p, r))
        if r == 1:
            recv_w[recv_idx == -1] = 1.0  # DeepEP's test_intranode does this
        return b.combine(recv_x, handle, topk_weights=recv_w)

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[1], epx.Unsupported) and "recv_topk_idx == -1" in str(errors[1]), errors[1]
    assert isinstance(errors[0], epx.PeerFailed), errors[0]


LAYOUT_EDITS = {"num_tokens_per_rank": lambda t: t + 1, "num_tokens_per_expert": lambda t: t.flip(0) + 1,
                "is_token_in_rank": lambda t: ~t}


@pytest.mark.parametrize("name", sorted(LAYOUT_EDITS))
def test_layout_arguments_not_of_topk_idx_fail_every_rank(name):
    """DeepEP's dispatch sends and counts by num_tokens_per_rank / is_token_in_rank / num_tokens_per_expert, epx
    by topk_idx: a value other than get_dispatch_layout's for topk_idx (on one rank) fails that dispatch on every
    rank; an equal copy passes (it is compared), and so does the next dispatch."""
    ranks, p = 2, problem(2, seed=185)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        args = _dispatch_kwargs(b, p, r)
        if r == 1:
            args[name] = LAYOUT_EDITS[name](args[name])
        try:
            b.dispatch(p.x[r], **args)
            error = None
        except epx.Error as e:
            error = e
        copies = {key: value.clone() if isinstance(value, torch.Tensor) else value
                  for key, value in _dispatch_kwargs(b, p, r).items()}
        return error, b.dispatch(p.x[r], **copies)[0]

    runs = run_all(groups, rank)
    assert isinstance(runs[1][0], epx.InvalidArgument) and f"{name} is not what" in str(runs[1][0]), runs[1][0]
    assert isinstance(runs[0][0], epx.PeerFailed) and f"{name} is not what" in str(runs[0][0]), runs[0][0]
    for d, (_, recv_x) in enumerate(runs):
        assert torch.equal(recv_x, RefDispatch(p, d).x)


def test_zero_copy_combine_of_another_x_fails_every_rank():
    """DeepEP's zero-copy combine reads its own buffer, not x: zero_copy=True with an x that is not
    get_next_low_latency_combine_buffer's tensor fails that combine on every rank; with it, it works."""
    ranks, p = 2, problem(2, seed=186, tokens=M, hidden=512)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=512)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        _, _, handle, _, _ = b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_fp8=False)
        y_buffer = b.get_next_low_latency_combine_buffer(handle)
        y_buffer.copy_(random_bf16(y_buffer.shape, 187 + r))
        try:
            b.low_latency_combine(y_buffer.clone() if r == 1 else y_buffer, p.idx[r], p.w[r], handle, zero_copy=True)
            error = None
        except epx.Error as e:
            error = e
        y_next = b.get_next_low_latency_combine_buffer(handle)  # the next combine's (the failed one took its turn)
        y_next.copy_(y_buffer)
        return error, handle, y_next.clone(), b.low_latency_combine(y_next, p.idx[r], p.w[r], handle,
                                                                    zero_copy=True)[0]

    runs = run_all(groups, rank)
    assert isinstance(runs[1][0], epx.InvalidArgument) and "zero_copy=True" in str(runs[1][0]), runs[1][0]
    assert isinstance(runs[0][0], epx.PeerFailed) and "zero_copy=True" in str(runs[0][0]), runs[0][0]
    for d, run in enumerate(runs):
        want, scale = ll_expected_combine(p, [r[1] for r in runs], [r[2] for r in runs], d, p.w[d])
        assert_close_sum(run[3], want, scale, f"rank {d}")


def test_low_latency_bad_input_on_one_rank_fails_every_rank():
    ranks, p = 2, problem(2, seed=190, tokens=M)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups)

    def rank(g):
        x = p.x[g.rank].float() if g.rank == 1 else p.x[g.rank]
        return buffers[g.rank].low_latency_dispatch(x, p.idx[g.rank], M, E, use_fp8=False)

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[1], epx.InvalidArgument) and "bfloat16" in str(errors[1])
    assert isinstance(errors[0], epx.PeerFailed)


# --- the call patterns of vLLM and SGLang ----------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("worst", [False, True])
@pytest.mark.parametrize("async_prepare", [False, True])
def test_vllm_high_throughput_pattern(ranks, worst, async_prepare):
    """vllm/model_executor/layers/fused_moe/deepep_ht_prepare_finalize.py (and all2all.py's buffer); with
    async_prepare as its current form runs it: the calls wait for Buffer.capture() and finish
    asynchronously, and the caller waits for the returned event where it has one."""
    p = problem(ranks, seed=200 + ranks)
    groups = epx.Group.host(ranks)
    buffers = [deep_ep.Buffer(group=g, num_nvl_bytes=nvl_bytes(ranks), num_rdma_bytes=0, low_latency_mode=False,
                              num_qps_per_rank=1, epx_timeout_ms=TIMEOUT_MS) for g in groups]
    local = E // ranks

    def rank(g):
        buffer, r = buffers[g.rank], g.rank
        num_tokens_per_rank, num_tokens_per_rdma_rank, expert_num_tokens, is_token_in_rank, event = \
            buffer.get_dispatch_layout(topk_idx=p.idx[r], num_experts=E, previous_event=None, async_finish=False,
                                       allocate_on_comm_stream=False)
        token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle, event = \
            buffer.dispatch(x=p.x[r], handle=None, num_tokens_per_rank=num_tokens_per_rank,
                            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                            num_tokens_per_expert=expert_num_tokens, topk_idx=p.idx[r], topk_weights=p.w[r],
                            expert_alignment=1, num_worst_tokens=ranks * T if worst else 0,
                            config=deep_ep.Buffer.get_dispatch_config(ranks),
                            previous_event=deep_ep.Buffer.capture() if async_prepare else None,
                            async_finish=async_prepare, allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        offset = r * local  # vLLM moves the ids back to global ones, -1 to an expert elsewhere
        global_ids = torch.where(expert_topk_ids == -1, E - 1 if offset == 0 else 0, expert_topk_ids + offset)
        # experts: y = 2 x weighted by the local slots' weights (vLLM weighs before the combine)
        weight = expert_topk_weights.sum(dim=1, keepdim=True)
        fused_expert_output = (token_data.float() * 2 * weight).bfloat16()
        combined_x, _, event = buffer.combine(x=fused_expert_output, handle=handle, topk_weights=None,
                                              config=deep_ep.Buffer.get_combine_config(ranks),
                                              previous_event=deep_ep.Buffer.capture() if async_prepare else None,
                                              async_finish=async_prepare, allocate_on_comm_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        output = torch.empty_like(p.x[r])
        output.copy_(combined_x, non_blocking=True)
        return global_ids, expert_num_tokens_per_expert_list, fused_expert_output, output

    runs = run_all(groups, rank)
    refs = [RefDispatch(p, d) for d in range(ranks)]
    for d, (global_ids, counts, _, _) in enumerate(runs):
        n = len(refs[d].rows)
        want_ids = torch.where(refs[d].topk_idx == -1, E - 1 if d == 0 else 0, refs[d].topk_idx + d * local)
        assert torch.equal(global_ids[:n], want_ids) and counts == ([] if worst else refs[d].counts)
    ys = [run[2][:len(refs[d].rows)] for d, run in enumerate(runs)]
    for s, run in enumerate(runs):
        want, scale = ref_combine(refs, ys, s, p)
        assert_close_sum(run[3], want, scale, f"rank {s}")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_vllm_low_latency_pattern(ranks, use_fp8):
    """vllm/model_executor/layers/fused_moe/deepep_ll_prepare_finalize.py: hooks, out=, no zero copy."""
    hidden = 512
    p = problem(ranks, seed=210 + ranks, tokens=M - 3, hidden=hidden)
    groups = epx.Group.host(ranks)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, ranks, E)
    buffers = [deep_ep.Buffer(group=g, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                              num_qps_per_rank=E // ranks, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                              epx_timeout_ms=TIMEOUT_MS) for g in groups]

    def rank(g):
        buffer, r = buffers[g.rank], g.rank
        expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
            p.x[r], p.idx[r], M, E, use_fp8=use_fp8, round_scale=False, use_ue8m0=False, async_finish=False,
            return_recv_hook=True)
        hook()
        recv = expert_x[0] if use_fp8 else expert_x
        fused_expert_output = random_bf16(recv.shape, 220 + r)
        output = torch.empty_like(p.x[r])
        _, _, recv_hook = buffer.low_latency_combine(fused_expert_output, p.idx[r], p.w[r], handle,
                                                     async_finish=False, zero_copy=False, return_recv_hook=True,
                                                     out=output)
        recv_hook()
        return expert_x, expert_num_tokens, handle, fused_expert_output, output

    runs = run_all(groups, rank)
    handles, ys = [run[2] for run in runs], [run[3] for run in runs]
    for d, (recv, count, handle, _, output) in enumerate(runs):
        check_ll_dispatch(p, d, recv, count, handle, "fp8" if use_fp8 else "bf16")
        want, scale = ll_expected_combine(p, handles, ys, d, p.w[d])
        assert_close_sum(output, want, scale, f"rank {d}")


@pytest.mark.parametrize("ranks", [2, 4])
def test_vllm_low_latency_two_micro_batches(ranks):
    """vLLM's dual-batch overlap of the low-latency path: two micro-batches, each call's send half then its
    hook, in the order d0, d1, c0, c1 (dispatch and combine of micro-batch 0 and 1)."""
    hidden = 512
    problems = [problem(ranks, seed=230 + i, tokens=M - i, hidden=hidden) for i in range(2)]
    groups = epx.Group.host(ranks)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, ranks, E)
    buffers = [deep_ep.Buffer(group=g, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                              num_qps_per_rank=E // ranks, epx_timeout_ms=TIMEOUT_MS) for g in groups]

    def rank(g):
        buffer, r = buffers[g.rank], g.rank
        handles, ys, outs = [], [], []
        for p in problems:  # d0, hook, d1, hook
            _, _, handle, _, hook = buffer.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_fp8=False,
                                                                return_recv_hook=True)
            hook()
            handles.append(handle)
        for i, p in enumerate(problems):  # c0, hook, c1, hook
            y = random_bf16((E // ranks, ranks * M, hidden), 240 + 10 * i + r)
            out, _, hook = buffer.low_latency_combine(y, p.idx[r], p.w[r], handles[i], return_recv_hook=True)
            hook()
            ys.append(y)
            outs.append(out.clone())
        return handles, ys, outs

    runs = run_all(groups, rank)
    for i, p in enumerate(problems):
        handles, ys = [run[0][i] for run in runs], [run[1][i] for run in runs]
        for d, run in enumerate(runs):
            want, scale = ll_expected_combine(p, handles, ys, d, p.w[d])
            assert_close_sum(run[2][i], want, scale, f"micro-batch {i} rank {d}")


@pytest.mark.parametrize("ranks", [2, 4])
def test_sglang_normal_then_low_latency_pattern(ranks):
    """python/sglang/srt/layers/moe/token_dispatcher/deepep.py, DeepEPMode.AUTO with async_finish: one
    Buffer for both modes; normal dispatch/combine on the comm stream with captured events (expert
    alignment 128), then clean_low_latency_buffer and the low-latency calls without hooks."""
    hidden = 512
    p = problem(ranks, seed=230 + ranks, tokens=M, hidden=hidden)
    groups = epx.Group.host(ranks)
    hidden_bytes = hidden * 2
    buffers = []
    for g in groups:
        num_nvl_bytes = num_rdma_bytes = 0
        for config in (deep_ep.Buffer.get_dispatch_config(ranks), deep_ep.Buffer.get_combine_config(ranks)):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, ranks), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, ranks), num_rdma_bytes)
        num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, ranks, E), num_rdma_bytes)
        buffers.append(deep_ep.Buffer(g, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                                      num_qps_per_rank=max(deep_ep.Buffer.num_sms, E // ranks), allow_mnnvl=True,
                                      epx_timeout_ms=TIMEOUT_MS))

    def rank(g):
        buffer, r = buffers[g.rank], g.rank
        topk_ids = p.idx[r].to(torch.int64)
        previous_event = deep_ep.Buffer.capture()
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
            buffer.get_dispatch_layout(topk_ids, E, previous_event=previous_event, async_finish=True,
                                       allocate_on_comm_stream=previous_event is not None)
        recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event = buffer.dispatch(
            p.x[r], topk_idx=topk_ids, topk_weights=p.w[r], num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=True,
            allocate_on_comm_stream=previous_event is not None, expert_alignment=128, config=None)
        event.current_stream_wait()
        y = random_bf16(recv_x.shape, 240 + r)
        previous_event = deep_ep.Buffer.capture()
        combined_x, _, event = buffer.combine(y, handle, async_finish=True, previous_event=previous_event,
                                              allocate_on_comm_stream=previous_event is not None, config=None)
        event.current_stream_wait()
        buffer.clean_low_latency_buffer(M, hidden, E)
        packed_recv_hidden, packed_recv_count, ll_handle, event, hook = buffer.low_latency_dispatch(
            p.x[r], topk_ids, M, E, use_fp8=True, async_finish=True, return_recv_hook=False)
        event.current_stream_wait()
        ll_y = random_bf16((E // ranks, ranks * M, hidden), 250 + r)
        combined_hidden_states, event, hook = buffer.low_latency_combine(
            x=ll_y, topk_idx=topk_ids, topk_weights=p.w[r], handle=ll_handle, async_finish=True,
            return_recv_hook=False)
        event.current_stream_wait()
        return recv_topk_ids, num_recv_tokens_per_expert, y, combined_x, packed_recv_hidden, packed_recv_count, \
            ll_handle, ll_y, combined_hidden_states

    runs = run_all(groups, rank)
    refs = [RefDispatch(p, d, 128) for d in range(ranks)]
    for s, run in enumerate(runs):
        assert torch.equal(run[0], refs[s].topk_idx) and run[1] == refs[s].counts
        want, scale = ref_combine(refs, [r[2] for r in runs], s, p)
        assert_close_sum(run[3], want, scale, f"rank {s} normal")
        check_ll_dispatch(p, s, run[4], run[5], run[6], "fp8")
        want, scale = ll_expected_combine(p, [r[6] for r in runs], [r[7] for r in runs], s, p.w[s])
        assert_close_sum(run[8], want, scale, f"rank {s} low latency")


def test_sglang_fork_options_are_refused():
    """SGLang passes options of its DeepEP fork (overlap / comp_signal with single-batch overlap)."""
    p = problem(1, seed=260, tokens=M, hidden=512)
    (g,) = epx.Group.host(1)
    (b,) = make_buffers([g], hidden=512)
    _, _, handle, _, _ = b.low_latency_dispatch(p.x[0], p.idx[0], M, E, use_fp8=False)
    y = torch.zeros(E, M, 512, dtype=torch.bfloat16)
    with pytest.raises(epx.Unsupported, match="comp_signal, overlap"):
        b.low_latency_combine(x=y, topk_idx=p.idx[0], topk_weights=p.w[0], handle=handle, overlap=True,
                              comp_signal=torch.zeros(1))


# --- GPU: EP1 over NCCL, the shared GPU at EP2/EP4, CUDA graphs --------------------------------------

def gpu_scenario(group, p, fp8):
    """Every kind of call of one rank; host copies of the results. Runs the same on any backend."""
    dev = group.device
    b = deep_ep.Buffer(group, num_nvl_bytes=nvl_bytes(group.size, 512),
                       num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, 512, group.size, E),
                       low_latency_mode=True, explicitly_destroy=True, epx_timeout_ms=TIMEOUT_MS)
    r = group.rank
    x, idx, w = (t.to(dev) for t in (p.x[r], p.idx[r], p.w[r]))
    config = deep_ep.Config(4)  # every rank's blocks on one GPU at once (docs/cuda.md)
    out = {}
    try:
        prev = deep_ep.Buffer.capture()
        per_rank, rdma, per_expert, in_rank, event = b.get_dispatch_layout(
            idx, E, previous_event=prev, async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_idx, recv_w, counts, handle, event = b.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=config, previous_event=event,
            async_finish=True, expert_alignment=2)
        event.current_stream_wait()
        y = (recv_x.float() * 2).bfloat16()
        combined, combined_w, event = b.combine(y, handle, topk_weights=recv_w, async_finish=True)
        event.current_stream_wait()
        out.update(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, combined=combined, combined_w=combined_w,
                   src_idx=handle[3], prefix=handle[0])
        out["counts"] = torch.tensor(counts)
        if has_cached_dispatch:
            out["cached"] = b.dispatch(x, handle=handle, async_finish=True)[0]
        for hook in (False, True):
            recv, count, ll_handle, event, recv_hook = b.low_latency_dispatch(
                x, idx, M, E, use_fp8=fp8, round_scale=fp8, use_ue8m0=fp8, return_recv_hook=hook,
                async_finish=not hook)
            recv_hook() if hook else event.current_stream_wait()
            codes = recv[0] if fp8 else recv
            ll_y = (codes.float() if not fp8 else torch.ones_like(codes, dtype=torch.float)).bfloat16()
            ll_out, event, combine_hook = b.low_latency_combine(ll_y, idx, w, ll_handle, return_recv_hook=hook)
            combine_hook() if hook else None
            out.update({f"ll{hook}_x": codes.view(torch.uint8) if fp8 else codes, f"ll{hook}_count": count,
                        f"ll{hook}_src": ll_handle[0], f"ll{hook}_range": ll_handle[1], f"ll{hook}_out": ll_out})
            if fp8:
                out[f"ll{hook}_scales"] = recv[1]
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        return {k: v.cpu() for k, v in out.items()}
    finally:
        b.destroy()


def compare_with_host(got, p, fp8):
    want = run_all(epx.Group.host(p.ranks), lambda g: gpu_scenario(g, p, fp8))
    for r in range(p.ranks):
        assert got[r].keys() == want[r].keys()
        for name in want[r]:  # every row: rows past the low-latency counts are zero on both (docs/low-latency.md)
            assert torch.equal(got[r][name], want[r][name]), f"rank {r} {name}"


@needs_gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_ep1_over_nccl_matches_host(ep1_group, fp8):
    p = problem(1, seed=300, tokens=M, hidden=512)
    compare_with_host([gpu_scenario(ep1_group, p, fp8)], p, fp8)


@needs_gpu
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_shared_gpu_matches_host(ranks, fp8):
    p = problem(ranks, seed=310 + ranks, tokens=M, hidden=512)
    groups = epx.Group.shared_gpu(ranks, 0)

    def rank(g):
        torch.cuda.set_device(0)
        with torch.cuda.stream(torch.cuda.Stream()):  # a stream per rank
            return gpu_scenario(g, p, fp8)

    compare_with_host(run_all(groups, rank), p, fp8)


def ll_graph_rank(group, problems, barrier, hook):
    """low_latency_dispatch -> stand-in expert (y = 2 x) -> low_latency_combine captured once, replayed."""
    from test_gpu import _capture

    dev, r = group.device, group.rank
    b = deep_ep.Buffer(group, num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, 512, group.size, E),
                       low_latency_mode=True, explicitly_destroy=True, epx_timeout_ms=TIMEOUT_MS)
    stream = torch.cuda.Stream(dev)
    results = []
    try:
        with torch.cuda.stream(stream):
            x, idx, w = (t.to(dev) for t in (problems[0].x[r], problems[0].idx[r], problems[0].w[r]))

            def step():
                recv, count, handle, _, recv_hook = b.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                                          return_recv_hook=hook)
                recv_hook() if hook else None
                out, _, combine_hook = b.low_latency_combine((recv.float() * 2).bfloat16(), idx, w, handle,
                                                             return_recv_hook=hook)
                combine_hook() if hook else None
                return count, out

            step()
            step()  # both sets seen eagerly: the hooks' tensors are the sets' own from here on
            torch.cuda.current_stream().synchronize()
            graph, (count, out) = _capture(step, stream)
            barrier.wait()
            for p in problems:
                x.copy_(p.x[r])
                idx.copy_(p.idx[r])
                w.copy_(p.w[r])
                graph.replay()
                torch.cuda.current_stream().synchronize()
                results.append({"count": count.cpu(), "out": out.cpu()})
            del graph
    finally:
        b.destroy()
    return results


@needs_gpu
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("hook", [False, True])
def test_low_latency_graph_replays_with_fresh_inputs(ranks, hook, ep1_group):
    problems = [problem(ranks, seed=320 + i, tokens=M, hidden=512, unused=0.1 * i) for i in range(3)]
    groups = [ep1_group] if ranks == 1 else epx.Group.shared_gpu(ranks, 0)
    barrier = threading.Barrier(ranks)
    got = run_all(groups, lambda g: ll_graph_rank(g, problems, barrier, hook))
    for i, p in enumerate(problems):
        host = epx.Group.host(ranks)
        buffers = make_buffers(host, hidden=512)

        def want(g):
            b, r = buffers[g.rank], g.rank
            recv, count, handle, _, _ = b.low_latency_dispatch(p.x[r], p.idx[r], M, E, use_fp8=False)
            return {"count": count, "out": b.low_latency_combine((recv.float() * 2).bfloat16(), p.idx[r], p.w[r],
                                                                 handle)[0]}

        for r, expected in enumerate(run_all(host, want)):
            for name in expected:
                assert torch.equal(got[r][i][name], expected[name]), f"replay {i} rank {r} {name}"


@needs_cached_dispatch
def test_cached_dispatch_in_another_wire_format_fails_every_rank():
    ranks, p = 2, problem(2, seed=400, hidden=256)
    codes, scales = fp8_inputs(p, 401)
    groups = epx.Group.host(ranks)
    buffers = make_buffers(groups, hidden=256)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        _, _, _, _, handle, _ = b.dispatch(p.x[r], **_dispatch_kwargs(b, p, r))
        return b.dispatch((codes[r], scales[r]) if r == 1 else p.x[r], handle=handle)

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[1], epx.Unsupported) and "wire format" in str(errors[1]), errors[1]
    assert isinstance(errors[0], epx.PeerFailed), errors[0]
